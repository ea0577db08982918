"""Stopping cleanly on SIGTERM, as SLURM and Kubernetes send it before a kill.

[Note: stopping on SIGTERM]
The handler only sets a flag. Ranks must stop after the same step, or their collectives
stop matching, so the flag rides on the reduction of the check steps (every log step,
checkpoint step and the last one; guard.py's [Note: checking the loss without a host
sync]): no extra collective and no host sync in the steps between. A signal that
reaches one rank only (a rank-only `kill`) stops every rank at the next check step. With
SLURM's `--signal=TERM@120`, `train.log_every` steps must take well under 120 s. The
run then finishes that step, writes a checkpoint, and rank 0 prints one line; the
process exits with EXIT_CODE, so a job script can tell "stopped with a checkpoint,
requeue me" from a failure.
"""

from __future__ import annotations

import signal
import threading
from pathlib import Path

EXIT_CODE = 75  # EX_TEMPFAIL (sysexits.h): a temporary failure, worth running again

_received: list[str] = []


class Stopped(Exception):
    """Training stopped on a signal after `step`, with a checkpoint at `path`."""

    def __init__(self, step: int, path: Path | None, signame: str) -> None:
        super().__init__(
            f"stopped by {signame} at step {step}; checkpoint {path}; resume with resume=auto"
        )
        self.step, self.path = step, path


def install() -> None:
    """Catch SIGTERM from now on (a no-op outside the main thread, as in tests)."""
    _received.clear()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _handler)


def _handler(signum: int, frame) -> None:
    _received.append(signal.Signals(signum).name)


def requested() -> bool:
    return bool(_received)


def signal_name() -> str:
    return _received[0] if _received else "SIGTERM"
