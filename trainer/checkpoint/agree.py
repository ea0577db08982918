"""What every rank must learn alike: rank 0's decisions, the errors of the ranks that
failed, which ranks find a file, and one-line messages printed once by rank 0."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from trainer import comm
from trainer.checkpoint import storage
from trainer.errors import ConfigError, StorageError
from trainer.observe import host


def agree(fn, *args: Any) -> Any:
    """`fn(*args)` on rank 0, its result (or its ConfigError or StorageError, of the same
    kind) on every rank."""
    out: list[Any] = [None]
    if comm.rank() == 0:
        try:
            out = [fn(*args)]
        except (ConfigError, StorageError) as e:
            out = [e]
    comm.broadcast_object(out)
    if isinstance(out[0], ConfigError | StorageError):
        raise type(out[0])(str(out[0]))
    return out[0]


def first_error(error: Any, device: torch.device, what: str = "checkpoint errors") -> Any:
    """Every rank learns the lowest failing rank's error (any picklable value, a line
    mostly), or None when all succeeded. `what` names the host read it makes."""
    failed = torch.zeros(comm.world_size(), device=device)
    if error is not None:
        failed[comm.rank()] = 1
    comm.all_reduce(failed, tag="checkpoint", account=False).wait()
    ranks = [r for r, f in enumerate(host.tolist(failed, what)) if f]
    if not ranks:
        return None
    message = [error]
    comm.broadcast_object(message, src=int(ranks[0]))
    return message[0]


def all_errors(error: Any, device: torch.device) -> list[tuple[int, Any]]:
    """Every failing rank's error (any picklable value), as (rank, error) in rank order, on
    every rank alike; [] when all succeeded (one small AllReduce, no more)."""
    failed = torch.zeros(comm.world_size(), device=device)
    if error is not None:
        failed[comm.rank()] = 1
    comm.all_reduce(failed, tag="checkpoint", account=False).wait()
    if not any(host.tolist(failed, "checkpoint errors")):
        return []
    gathered = comm.all_gather_object(error)
    return [(r, e) for r, e in enumerate(gathered) if e is not None]


def found_by(files: list[str], device: torch.device) -> list[tuple[list[int], list[int]]]:
    """Per file of `files` (the same list on every rank): the ranks that find it, and those
    whose storage does not say (an error other than ENOENT). No collective for no file."""
    if not files:
        return []
    counts = torch.zeros(len(files), 2, comm.world_size(), device=device)
    for i, f in enumerate(files):
        seen = storage.found(Path(f))
        if seen is not False:  # found (True), or the storage does not say (None)
            counts[i, 0 if seen else 1, comm.rank()] = 1
    comm.all_reduce(counts, tag="checkpoint", account=False).wait()
    return [
        ([r for r, v in enumerate(finds) if v], [r for r, v in enumerate(unsure) if v])
        for finds, unsure in host.tolist(counts, "checkpoint files found")
    ]


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
