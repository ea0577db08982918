"""Entry point: `python train.py` or `torchrun --nproc-per-node=N train.py mode=zero`."""

from __future__ import annotations

import os
import sys

from trainer.run import preempt

if __name__ == "__main__":
    # Before the slower imports: a SIGTERM from the first moment on stops the run with
    # one line, never half-started ([Note: stopping on SIGTERM] in trainer/run/preempt.py).
    preempt.install()

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from trainer.run.cli import check_group_choices, check_run_dir, run_and_exit  # noqa: E402


def _one_run_directory_for_all_ranks() -> None:
    """Hydra resolves ${now:} separately in every process, so ranks could each create a
    different run directory. Only rank 0 lets Hydra create one; the other ranks run
    Hydra without an output directory and take rank 0's over the process group."""
    if int(os.environ.get("RANK", "0")) == 0:
        return
    args = sys.argv[1:]
    extra = [
        "hydra.output_subdir=null",
        "hydra/job_logging=disabled",
        "hydra/hydra_logging=disabled",
    ]
    if not any(a.startswith(("hydra.run.dir=", "hydra.sweep.dir=")) for a in args):
        extra.append("hydra.run.dir=.")
    sys.argv += [e for e in extra if e not in args]


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run_and_exit(cfg)


if __name__ == "__main__":
    check_group_choices(sys.argv[1:])
    check_run_dir(sys.argv[1:])
    _one_run_directory_for_all_ranks()
    main()
