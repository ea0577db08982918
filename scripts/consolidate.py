"""Write one full model state_dict from a sharded checkpoint, whatever its mode and world
size; no process group and no model are needed.

    python scripts/consolidate.py runs/<run>/checkpoints/step_000300 model.pt
    python scripts/consolidate.py runs/<run>/checkpoints model.pt     # the newest one

The output loads with plain `torch.load(path, weights_only=True)` into the model:
`model.load_state_dict(torch.load("model.pt", weights_only=True))`. The checkpoint is
read range by range, without its optimizer state; writing a torch file holds the model
once (4Ψ in fp32: torch.save needs the whole dict). An output named `*.safetensors` is
written one tensor at a time instead (every state_dict key, tied weights under each of
their names; `safetensors.torch.load_file` reads it), in the memory of the largest
tensor. The model to build is the one the run directory's newest run used (its
.hydra/config.yaml): a checkpoint of another model (say, an older run's in the same
directory) is refused, naming the difference, unless --any-model is given.
"""

from __future__ import annotations

import argparse
import errno
import math
import os
import sys
from pathlib import Path

from omegaconf import OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer import checkpoint  # noqa: E402
from trainer.checkpoint.export import write_model  # noqa: E402
from trainer.checkpoint.recutting import model_entries  # noqa: E402
from trainer.errors import ConfigError, TrainingError  # noqa: E402

# Model options that do not change the parameters.
_NOT_IN_THE_WEIGHTS = ("activation_checkpointing",)


def check_model(path: Path) -> None:
    """Refuse checkpoint `path` if its model differs from the one the newest run of its
    run directory used: the run's `.hydra/config.yaml` beside `checkpoints/` (the default
    ckpt.dir), or in the checkpoint directory itself. Nothing to compare: no refusal."""
    run_config = _run_config(path)
    saved = checkpoint.read_meta(path).get("config")
    if run_config is None or not saved:
        return
    try:
        run = _model(OmegaConf.load(run_config).get("model"))
    except Exception as e:
        why = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ConfigError(f"cannot read {run_config}: {why}") from None
    held = _model(OmegaConf.create(saved).get("model"))
    differ = [
        f"model.{k}={held.get(k)} (that run: {run.get(k)})"
        for k in sorted(held.keys() | run.keys(), key=str)
        if held.get(k) != run.get(k)
    ]
    if differ:
        raise ConfigError(
            f"checkpoint {path} holds another model than the newest run in "
            f"{run_config.parent.parent} used: {', '.join(differ)}; consolidate a checkpoint "
            "of that run, or pass --any-model to write this one anyway"
        )


def _run_config(path: Path) -> Path | None:
    for directory in (path.parent.parent, path.parent):
        if (directory / ".hydra" / "config.yaml").is_file():
            return directory / ".hydra" / "config.yaml"
    return None


def _model(node) -> dict:
    model = OmegaConf.to_container(node, resolve=False) if node is not None else {}
    return {k: v for k, v in model.items() if k not in _NOT_IN_THE_WEIGHTS}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path, help="a step_* directory, or ckpt.dir")
    parser.add_argument(
        "out", type=Path, help="where to write the state_dict (.pt, or .safetensors)"
    )
    parser.add_argument(
        "--any-model",
        action="store_true",
        help="write it even if the run directory's newest run used another model",
    )
    args = parser.parse_args(argv)
    if args.out.is_dir():
        print(f"error: {args.out} is a directory; give the file to write (.pt)", file=sys.stderr)
        return 2
    path = args.checkpoint
    if not (path / "meta.pt").exists() and path.is_dir():
        found = checkpoint.find_checkpoints(path)
        if found:
            path = found[0]
    try:
        if not args.any_model:
            check_model(path)
        safetensors = args.out.suffix == ".safetensors"
        entries = model_entries(path)
        state = {} if safetensors else checkpoint.consolidate(path)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        if args.out.parent.exists() and not args.out.parent.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR))
        args.out.parent.mkdir(parents=True, exist_ok=True)
        if safetensors:  # [Note: streamed export]: every key, one tensor at a time
            write_model(path, args.out.parent, lambda k: k, list, stem=args.out.stem)
        else:
            checkpoint.write_file(args.out, state)  # never a half-written file under the final name
    except OSError as e:
        print(f"error: cannot write {args.out}: {e.strerror}", file=sys.stderr)
        return 2
    except TrainingError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    numel = sum(math.prod(shape) for _, _, _, shape in entries)
    print(f"{path} -> {args.out}: {len(entries)} tensors, {numel} elements")
    return 0


if __name__ == "__main__":
    sys.exit(main())
