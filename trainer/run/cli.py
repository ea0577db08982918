"""What happens between the command line and the training loop.

- Bad input ends the process with one line on stderr and exit code 2, no traceback.
- A stop on SIGTERM ends it with one line and exit code 75 ([Note: stopping on SIGTERM]).
- `launcher.nproc=N` (outside torchrun) starts N local worker processes through
  PyTorch's elastic launch API, so `python train.py -m mode=ddp,zero,fsdp
  launcher.nproc=2` runs each mode as its own multi-process job, one after the other.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import signal
import sys
import tempfile
import time
import uuid
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import InstantiationException
from omegaconf import DictConfig, OmegaConf

from trainer.config import schema  # noqa: F401  (registers the config's types with Hydra)
from trainer.config.checks import CONF_DIR, validate
from trainer.errors import ConfigError, PeerError, TrainingError

GROUPS = ("mode", "model", "data", "optim")


def fail(message: str, code: int = 2) -> None:
    # Every rank sees the same bad input; one line from rank 0 is enough.
    if int(os.environ.get("RANK", "0")) == 0:
        say(f"error: {message}")
    _tell_launcher(f"error: {message}")
    sys.exit(code)


def _tell_launcher(line: str) -> None:
    """Leave this worker's last line where torchelastic (torchrun, launcher.nproc) looks
    for why a worker ended: the file TORCHELASTIC_ERROR_FILE names. torchrun's failure
    summary then shows the line as the worker's "traceback", instead of a link to its
    docs. The format is that of torch's own ErrorHandler.record_exception, with the line
    where a Python traceback would be: there is none, the exit was on purpose."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    stamp = str(int(time.time()))
    info = {"message": line, "extraInfo": {"py_callstack": line, "timestamp": stamp}}
    try:
        Path(path).write_text(json.dumps({"message": info}))
    except OSError:
        pass  # the line is on stderr already; the summary keeps its link


def say(line: str) -> None:
    """One line on stderr, on a line of its own: a progress bar still drawn (it ends in
    a carriage return, not a newline) is closed first."""
    from tqdm import tqdm

    for bar in list(getattr(tqdm, "_instances", ())):
        bar.close()
    print(line, file=sys.stderr, flush=True)


def check_group_choices(args: list[str]) -> None:
    """Unknown mode/model/data/optim: one line listing the valid choices (Hydra's own
    message spans a dozen lines and mentions its search path)."""
    try:
        overrides = OverridesParser.create().parse_overrides(
            [a for a in args if not a.startswith("-")]
        )
    except Exception as e:  # Hydra's parser error already names the bad override
        fail(str(e).splitlines()[0])
    for o in overrides:
        if o.key_or_group not in GROUPS:
            continue
        choices = sorted(p.stem for p in (CONF_DIR / o.key_or_group).glob("*.yaml"))
        values = list(o.sweep_string_iterator()) if o.is_sweep_override() else [o.value()]
        for v in values:
            if str(v) not in choices:
                fail(f"{o.key_or_group}={v} is not one of {', '.join(choices)}")


def check_run_dir(args: list[str]) -> None:
    """Overrides that do not compose (a key the config lacks, a value of the wrong type)
    and a run directory that cannot be created: one line each, before Hydra tries (its
    own failure is a traceback). Every rank composes, so none of them prints Hydra's
    traceback; the directory is rank 0's alone to create. A sweep (-m) composes each of
    its jobs; their directories are Hydra's to make."""
    overrides = [a for a in args if not a.startswith("-")]
    if any(a in ("-m", "--multirun") for a in args):
        for job in _sweep_jobs(overrides):
            _compose(job)
        return
    cfg = _compose(overrides)
    if int(os.environ.get("RANK", "0")) != 0:
        return
    path = Path(cfg.hydra.run.dir).absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        fail(f"run directory {path} cannot be created: {existing} is not a writable directory")
    from trainer.run.rundir import held_by

    holder = held_by(path)
    if holder is not None:  # refused before Hydra writes .hydra/ over the holder's
        fail(
            f"{path} is in use by another run ({holder}); wait for it to end, or give "
            "this run another hydra.run.dir (or ckpt.dir)"
        )
    # Root passes os.access everywhere, yet cannot create /proc/x: create a probe beside
    # where the run directory would go and remove it. Not the run directory itself: other
    # ranks' Hydra may be creating that one at this moment.
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".probe-", dir=existing))
    except OSError as e:
        fail(f"run directory {path} cannot be created: {e.strerror}")


def _compose(overrides: list[str]) -> DictConfig:
    """The config these overrides make, resolved, or one `error:` line."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import ConfigCompositionException

    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        try:
            cfg = compose("config", overrides=overrides, return_hydra_config=True)
        except ConfigCompositionException as e:  # "Could not override 'mode.foo'. ..."
            cause = str(e.__cause__ or "").strip().splitlines()
            # A wrong type (trainer/config/schema.py): the override, then OmegaConf's reason.
            reason = f": {cause[0]}" if cause and "Error merging" in str(e) else ""
            fail(" ".join(str(e).split()).replace("Error merging override ", "") + reason)
    try:  # an interpolation that cannot resolve (${oc.env:NOPE}) names itself here
        OmegaConf.resolve(cfg)
    except Exception as e:
        fail(" ".join(str(e).split("\n")[0].split()))
    return cfg


def _sweep_jobs(overrides: list[str], most: int = 100) -> list[list[str]]:
    """The overrides of each job of a sweep (`mode=ddp,zero` makes two), as Hydra's
    basic sweeper makes them; none if they are more than `most` or not plain lists."""
    choices = []
    for o in OverridesParser.create().parse_overrides(overrides):
        key = o.get_key_element()
        if not o.is_sweep_override():
            choices.append([o.input_line])
        elif o.is_choice_sweep() or o.is_range_sweep():
            choices.append([f"{key}={v}" for v in o.sweep_string_iterator()])
        else:  # glob sweeps and the like: left to Hydra
            return []
    jobs = list(itertools.islice(itertools.product(*choices), most + 1))
    return [list(job) for job in jobs] if len(jobs) <= most else []


def run_and_exit(cfg: DictConfig) -> None:
    if cfg.launcher.nproc > 1 and "LOCAL_RANK" not in os.environ:
        try:  # refused here, before any worker starts, as each worker would refuse it
            validate(cfg, cfg.launcher.nproc)
        except ConfigError as e:
            fail(str(e))
        return _launch_workers(cfg)
    from trainer.run.loop import train
    from trainer.run.preempt import EXIT_CODE, Stopped

    try:
        train(cfg)
    except Stopped as e:  # a checkpoint is written (or none was due); run again to resume
        if int(os.environ.get("RANK", "0")) == 0:
            say(str(e))
        _tell_launcher(str(e))
        sys.exit(EXIT_CODE)
    except PeerError as e:  # said by whichever rank noticed, not by rank 0 alone
        say(f"error: {e}")
        _tell_launcher(f"error: {e}")
        sys.exit(1)
    except ConfigError as e:
        fail(str(e))
    except TrainingError as e:
        fail(str(e), code=1)
    except InstantiationException as e:
        if isinstance(e.__cause__, ConfigError):  # raised inside a model/dataset builder
            fail(str(e.__cause__))
        raise


def _launch_workers(cfg: DictConfig) -> None:
    """Run this job as `cfg.launcher.nproc` local processes (torchrun --standalone).

    SIGTERM before the workers start stops this process at once with one line; once they
    run, torch's agent forwards it to them (they stop as [Note: stopping on SIGTERM]
    says, rank 0 printing the line) and waits for them: TORCH_ELASTIC_SHUTDOWN_TIMEOUT
    seconds (30 by default) before it kills them. Exit code 75 either way."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from trainer.run import preempt

    # The workers speak for themselves; the agent's own failure log would repeat them.
    # Some of its modules set their own level (from LOGLEVEL), so each is quietened.
    for name in ["torch.distributed.elastic", *logging.root.manager.loggerDict]:
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    hc = HydraConfig.get()
    overrides = [o for o in hc.overrides.task if not o.startswith("hydra.run.dir=")]
    # Workers write into the directory Hydra made for this job (a sweep's subdirectory
    # in multirun), so every mode of a sweep lands beside the others.
    args = [str(Path(sys.argv[0]).resolve()), *overrides, f"hydra.run.dir={hc.runtime.output_dir}"]
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=cfg.launcher.nproc,
        run_id=str(uuid.uuid4()),
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=cfg.launcher.max_restarts,
    )
    try:
        with preempt.raising():
            elastic_launch(config, entrypoint=sys.executable)(*args)
    except preempt.Stopped as e:  # before any worker started
        say(str(e))
        sys.exit(preempt.EXIT_CODE)
    except SignalException as e:
        if e.sigval != signal.SIGTERM:
            raise
        sys.exit(preempt.EXIT_CODE)  # forwarded: the workers have stopped and said so
    except ChildFailedError as e:
        codes = sorted({f.exitcode for f in e.failures.values()})
        if 2 in codes:  # bad input: the workers' rank 0 has already said what
            sys.exit(2)
        if codes == [preempt.EXIT_CODE]:  # stopped by SIGTERM with a checkpoint; rank 0 said so
            sys.exit(preempt.EXIT_CODE)
        fail(f"{hc.job.name} workers failed with exit code(s) {codes}; see their messages above")
