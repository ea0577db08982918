"""Stopping cleanly on SIGTERM, as SLURM and Kubernetes send it before a kill.

[Note: stopping on SIGTERM]
The handler only sets a flag. It is installed first thing in train.py, so a signal that
comes during start-up (imports, Hydra, joining the group, building the model, loading a
checkpoint) is kept too. Ranks must stop after the same step, or their collectives
stop matching, so the flag rides on the reduction of the check steps (every log step,
checkpoint step and the last one; guard.py's [Note: checking the loss without a host
sync]): no extra collective and no host sync in the steps between. One more such
reduction right before the first step stops a run signalled during its set-up with
nothing new to save. A signal that reaches one rank only (a rank-only `kill`) stops
every rank at the next check step. With SLURM's `--signal=TERM@120`, `train.log_every`
steps must take well under 120 s. The run then finishes that step, writes a checkpoint
(with `ckpt.async`, waiting for its write and commit: [Note: async save]), and rank 0
prints one line; the process exits with EXIT_CODE, so a job script can tell
"stopped with a checkpoint, requeue me" from a failure.

A launcher (`launcher.nproc`) has no step to finish: before its workers start, a signal
stops it at once (`raising()`); while they run, torch's elastic agent holds SIGTERM and
forwards it to them.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

EXIT_CODE = 75  # EX_TEMPFAIL (sysexits.h): a temporary failure, worth running again

_received: list[str] = []
_raise_at_once = False


class Stopped(Exception):
    """Training stopped on a signal: after `step` with a checkpoint at `path`, or before
    its first step (`path` None), with nothing new to save."""

    def __init__(self, message: str, step: int = 0, path: Path | None = None) -> None:
        super().__init__(message)
        self.step, self.path = step, path

    @classmethod
    def at_step(cls, step: int, path: Path | None, signame: str) -> Stopped:
        return cls(
            f"stopped by {signame} at step {step}; checkpoint {path}; resume with resume=auto",
            step,
            path,
        )

    @classmethod
    def before_training(cls, signame: str, step: int = 0) -> Stopped:
        """Stopped before the first step of this process: at `step`, the checkpoint it
        resumed from (0: none), which is unchanged."""
        when = "before training started"
        if step:
            when = f"before its first step after resuming at step {step}"
        return cls(
            f"stopped by {signame} {when}; nothing new to save; run the same command again",
            step,
        )


def install() -> None:
    """Catch SIGTERM from now on (a no-op outside the main thread, as in tests). Called
    again, it keeps a signal already received."""
    if threading.current_thread() is not threading.main_thread():
        _received.clear()
        return
    if signal.getsignal(signal.SIGTERM) is not _handler:
        _received.clear()
        signal.signal(signal.SIGTERM, _handler)


@contextmanager
def raising() -> Iterator[None]:
    """In a launcher: a signal raises Stopped where the process is, at once if one came
    already. Whoever installs its own handler inside (torch's agent) takes over; on the
    way out the flag-setting handler is back."""
    global _raise_at_once
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    if _received:
        raise Stopped.before_training(_received[0])
    _raise_at_once = True
    signal.signal(signal.SIGTERM, _handler)
    try:
        yield
    finally:
        _raise_at_once = False
        signal.signal(signal.SIGTERM, _handler)


def _handler(signum: int, frame) -> None:
    name = signal.Signals(signum).name
    _received.append(name)
    if _raise_at_once:
        raise Stopped.before_training(name)


def requested() -> bool:
    return bool(_received)


def signal_name() -> str:
    return _received[0] if _received else "SIGTERM"
