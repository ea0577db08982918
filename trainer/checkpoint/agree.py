"""What every rank must learn alike: rank 0's decisions, the first error of any rank,
and one-line messages printed once by rank 0."""

from __future__ import annotations

from typing import Any

import torch
from tqdm import tqdm

from trainer import comm
from trainer.errors import ConfigError
from trainer.observe import host


def agree(fn, *args: Any) -> Any:
    """`fn(*args)` on rank 0, its result (or ConfigError) on every rank."""
    out: list[Any] = [None]
    if comm.rank() == 0:
        try:
            out = [fn(*args)]
        except ConfigError as e:
            out = [e]
    comm.broadcast_object(out)
    if isinstance(out[0], ConfigError):
        raise ConfigError(str(out[0]))
    return out[0]


def first_error(error: Any, device: torch.device) -> Any:
    """Every rank learns the lowest failing rank's error (any picklable value, a line
    mostly), or None when all succeeded."""
    failed = torch.zeros(comm.world_size(), device=device)
    if error is not None:
        failed[comm.rank()] = 1
    comm.all_reduce(failed, tag="checkpoint", account=False).wait()
    ranks = [r for r, f in enumerate(host.tolist(failed, "checkpoint errors")) if f]
    if not ranks:
        return None
    message = [error]
    comm.broadcast_object(message, src=int(ranks[0]))
    return message[0]


def device_of(engine) -> torch.device:
    # A device the backend can reduce on: where the model lives (cuda for nccl).
    return next(engine.module.parameters()).device


said: set[str] = set()  # the messages `say` has printed in this process


def say(message: str) -> None:
    # Once per process: a checkpoint skipped again (a later load, a restart's retry)
    # would otherwise repeat the same warning.
    if comm.rank() == 0 and message not in said:
        said.add(message)
        tqdm.write(message)  # above the progress bar, not through it


def line(e: BaseException, limit: int = 400) -> str:
    """The first line of an error's message, for a one-line report; a line longer than
    `limit` (a library's paragraph) is cut, visibly."""
    text = str(e).strip().splitlines()
    first = text[0] if text else type(e).__name__
    return first if len(first) <= limit else first[:limit] + " [...]"
