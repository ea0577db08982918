"""Async save (`ckpt.async=true`): the files written by a thread while training goes on,
committed later by the main thread. Training stalls for a copy to the host only; the
writer thread does local file I/O only, and the commit runs on the main thread at points
every rank reaches alike ([Note: async save], beside `Pending`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from trainer import comm
from trainer.observe import host

# commit(error): the agreement and rename, on the main thread; raises on any rank's error
Commit = Callable[[str | None], None]


# [Note: async save]
# A save stalls training for the time it takes to write and fsync this rank's data file. With
# `ckpt.async=true` the stall is only a copy: on the main thread, every rank copies what it
# writes into one host buffer (`stage_entries`, laid out as `rank{r}.bin`; pinned on CUDA,
# the device-to-host copy waited for before training goes on, so later steps cannot change
# it), takes its RNG states and the samplers' state, and hands the copy to one writer thread.
# That copy is the memory the option trades for the stall: the size of this rank's data file,
# allocated at the first async save and kept (pinned allocations are slow) until the run ends.
#
# The writer thread does local file I/O only: `rank{r}.bin`, `rank{r}.pt` and rank 0's
# `meta.pt` into the temporary directory. Collectives never run on it: they would interleave
# with the training collectives of the same group. The commit of [Note: atomic checkpoints]
# (agree that every rank's files are written, then rank 0's marker, rename and prune) runs
# on the main thread, at one of these points, which every rank reaches alike:
# - a check step (loop.py's `Every.check`): one small AllReduce counts the ranks still
#   writing and those whose write failed; when all are done the save is committed, when one
#   failed every rank ends the run with that rank's one line (as every rank does when rank
#   0's commit fails: [Note: a failed commit] in saving.py); else training goes on;
# - the next save, which first waits for this one's write and commits it (a second save waits
#   for the first: one host copy, one writer);
# - the last step and a stop on SIGTERM, which wait for their own save's write and commit it
#   before the run ends ([Note: stopping on SIGTERM]).
# A run that fails otherwise joins the thread and leaves the uncommitted directory under its
# temporary name, which the next successful save removes.
class Pending:
    """One async save: its writer thread (None when staging already failed) and its commit."""

    def __init__(
        self, write: Callable[[], str | None] | None, commit: Commit, error: str | None
    ) -> None:
        self.commit, self.error = commit, error
        self.thread = None
        if write is not None:
            self.thread = threading.Thread(target=self._run, args=(write,), daemon=True)
            self.thread.start()

    def _run(self, write: Callable[[], str | None]) -> None:
        self.error = write()

    def done(self) -> bool:
        return self.thread is None or not self.thread.is_alive()

    def join(self) -> str | None:
        if self.thread is not None:
            self.thread.join()
        return self.error


_pending: Pending | None = None
_host: torch.Tensor | None = None  # the host copy, kept from one async save to the next


def host_buffer(nbytes: int, pinned: bool) -> torch.Tensor:
    """A host buffer of at least `nbytes` for the copy a save stages; reused when large
    enough (no save is pending when it is asked for)."""
    global _host
    if _host is None or _host.numel() < nbytes or _host.is_pinned() != pinned:
        _host = None  # the old one goes before the new one is allocated
        _host = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=pinned)
    return _host


def start(pending: Pending) -> None:
    global _pending
    assert _pending is None, "a save is still pending: finish() it first"
    _pending = pending


def finish() -> None:
    """Wait for the pending save's write and commit it (every rank calls it). Raises the
    failing rank's line if a write failed. No-op when none is pending."""
    global _pending
    if _pending is None:
        return
    pending, _pending = _pending, None
    error = pending.join()
    with comm.unaccounted():
        pending.commit(error)


def check(device: torch.device) -> None:
    """At a check step (every rank alike): commit the pending save if every rank's write is
    done, end the run with its line if one failed, else leave it writing."""
    if _pending is None:
        return
    done = _pending.done()  # once: the thread may end between two looks
    running, failed = not done, done and _pending.error is not None
    counts = torch.tensor([float(running), float(failed)], device=device)
    with comm.unaccounted():
        comm.all_reduce(counts, tag="checkpoint", account=False).wait()
    running_ranks, failed_ranks = host.tolist(counts, "async save")
    if failed_ranks > 0 or running_ranks == 0:
        finish()


def drop() -> None:
    """Leave: join the writer (local I/O only) without committing, free the host copy.
    For a run that ends on an error or that has no save pending."""
    global _pending, _host
    if _pending is not None:
        _pending.join()
    _pending, _host = None, None
