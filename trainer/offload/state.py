"""What `mode.offload=disk` keeps out of memory between optimizer steps, and the step
that brings it back one sharded buffer at a time (zero's buckets, fsdp's units).

Between steps a rank's optimizer state (and zero's separate fp32 masters) sits in its
offload file (disk.py, [Note: the offload file]); a tensor moved out keeps its place in
the optimizer, its storage resized to 0 bytes. The step reads one buffer's state while the
one before steps and the one before that is written, and gives offload=null's bits. What
moves and what stays, the step and a failed read or write: [Note: offloaded state],
beside `OffloadedState`.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainer.errors import ConfigError
from trainer.observe import heap
from trainer.offload.disk import ALIGN, SLOT_BYTES, OffloadFile, OnDisk, aligned


def _waited(wait: Callable[..., Any], *args: Any) -> float:
    start = time.perf_counter()
    wait(*args)
    return time.perf_counter() - start


def per_element_keys(optimizer: torch.optim.Optimizer) -> list[str]:
    """The optimizer's state kept per element of a parameter (AdamW: exp_avg, exp_avg_sq;
    SGD with momentum: momentum_buffer; none for plain SGD), found by stepping a copy of
    it, built with the same options, once on a one-element parameter."""
    probe = nn.Parameter(torch.zeros(1))
    probe.grad = torch.zeros(1)
    accepted = inspect.signature(type(optimizer)).parameters  # defaults may hold more
    options = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    twin = type(optimizer)([probe], **options)
    twin.step()
    state = twin.state[probe]
    return sorted(
        k for k, v in state.items() if k != "step" and torch.is_tensor(v) and v.shape == (1,)
    )


class BufferSteps:
    """One optimizer step taken buffer by buffer (`step(i)`): inside the block, every
    buffer's pieces have their `.grad` hidden but while that buffer steps, so each
    `optimizer.step()` updates one buffer (torch's optimizers skip a tensor without a
    gradient); what watches optimizer steps (the memory monitor, the step peak) sees one
    step: its post-hooks are held back, and `done()` runs them once, after the last
    buffer. Leaving the block puts everything back."""

    def __init__(self, optimizer: torch.optim.Optimizer, buffers: Sequence[Any]):
        self.optimizer = optimizer
        self.grads = [[(p.tensor, p.tensor.grad) for p in b.pieces] for b in buffers]
        self._hooks = optimizer._optimizer_step_post_hooks  # torch's, by handle id
        self._held: dict = {}

    def __enter__(self) -> BufferSteps:
        for pairs in self.grads:
            for t, _ in pairs:
                t.grad = None
        self._held = dict(self._hooks)
        self._hooks.clear()
        return self

    def step(self, i: int) -> None:
        for t, g in self.grads[i]:
            t.grad = g
        self.optimizer.step()
        for t, _ in self.grads[i]:
            t.grad = None

    def __exit__(self, *exc: object) -> None:
        self._hooks.update(self._held)

    def done(self) -> None:
        for hook in self._held.values():
            hook(self.optimizer, (), {})


# [Note: offloaded state]
# Each rank's share of the optimizer state lives in its offload file (disk.py) between
# steps: the per-element tensors of every piece (AdamW's two moments, SGD's momentum), and,
# where the mode keeps it apart from the compute parameters and reads it only in the step,
# the fp32 master (zero in bf16/fp16; not zero in fp32, where the master is a view of the
# parameters, and not fsdp, which gathers every unit from its master at each unshard).
# Gradient shards stay in memory: accumulation and clipping need them before the step.
#
# A tensor moved out keeps its place in the optimizer: the same tensor object, its storage
# resized to 0 bytes (what FSDP does to its flat parameters), resized back and read into
# before it is used. Where a tensor is is therefore its storage size, nothing else to keep
# in step with; the memory monitor, which counts storages, sees it gone.
#
# The step (`step`): buffer i's state is read while buffer i-1 steps and buffer i-2's is
# written, on the file's reader and writer threads; so three buffers' state are in memory at
# most, and a step costs about max(the optimizer's arithmetic, the file's I/O). Each buffer
# steps on its own: the other buffers' pieces have no `.grad` while it does, which torch's
# optimizers skip. Their arithmetic is per tensor (one piece, one update, whatever else is in
# the list, the same kernels), so stepping the buffers one by one gives the bits of one step
# over all of them: exactly offload=null's, which the parity tests hold it to. An fp16 step
# skipped on the device (`optimizer.found_inf`) is skipped by every buffer's call alike.
#
# A failed read or write stops the step with the error (StorageError, one line): buffers
# before it stepped, the others not, so the run cannot go on; a checkpoint resumes it.
class OffloadedState:
    """The optimizer state (and `move_masters`: the fp32 masters) of `buffers`, each with
    `pieces` and `master` (sharded.py's ShardedBuffer), kept in a file at `path` between
    steps ([Note: offloaded state])."""

    kind = "disk"  # mode.offload's value

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        buffers: Sequence[Any],
        move_masters: bool,
        path: Path | str,
    ):
        if any(b.master.device.type != "cpu" for b in buffers):
            raise ConfigError(
                "mode.offload=disk steps the optimizer on the CPU, where these masters are "
                "not; on CUDA use mode.offload=host"
            )
        self.optimizer, self.buffers, self.move_masters = optimizer, list(buffers), move_masters
        self.keys = per_element_keys(optimizer)
        # Regions: per buffer, one per kind of tensor, laid out like its master (S,),
        # each page-aligned and a whole number of pages ([Note: the offload file])
        self.regions: list[dict[str, int]] = []
        self.region_bytes: list[int] = []
        end = 0
        for b in self.buffers:
            size = aligned(b.shard_numel * b.master.element_size())
            region = {}
            for kind in (["master"] if move_masters else []) + self.keys:
                region[kind], end = end, end + size
            self.regions.append(region)
            self.region_bytes.append(size)
        # staging slots no larger than a region: a small model's cost them little
        slot = min(SLOT_BYTES, max(self.region_bytes, default=ALIGN))
        self.file = OffloadFile(path, end, slot_bytes=slot)
        # the last step's figures: seconds waited for the file, in all, bytes moved
        self.last_step = {"wait_s": 0.0, "step_s": 0.0, "bytes": 0}
        self._moved = 0  # bytes read and written since the last step began
        for i in range(len(self.buffers)):  # the masters go now; the state after its first step
            self._wait_written(self._evict(i))

    @property
    def nbytes(self) -> int:
        """Bytes of the offload file: what this rank keeps on disk."""
        return self.file.nbytes

    # -- where each tensor is ---------------------------------------------------------------
    def _held(
        self, i: int, state: dict[Any, dict[str, Any]] | None = None, masters_only: bool = False
    ) -> list[tuple[int, list[tuple[torch.Tensor, int]]]]:
        """Buffer i's regions as (offset in the file, [(tensor, its first byte in the
        region)]): its master's, and one per kind of its pieces' per-element state (from
        `state`, by default the optimizer's)."""
        b, region = self.buffers[i], self.regions[i]
        state = self.optimizer.state if state is None else state
        held = [(region["master"], [(b.master, 0)])] if self.move_masters else []
        if masters_only:
            return held
        size = b.master.element_size()
        for k in self.keys:
            parts = []
            for piece in b.pieces:
                v = state.get(piece.tensor, {}).get(k)
                if torch.is_tensor(v) and v.numel():
                    if v.storage_offset() or not v.is_contiguous():
                        raise AssertionError(f"offload: {piece.name}'s {k} is not its own tensor")
                    parts.append((v, piece.start * size))
            if parts:
                held.append((region[k], parts))
        return held

    @staticmethod
    def _resident(t: torch.Tensor) -> bool:
        return t.untyped_storage().nbytes() > 0

    def _fetch(self, i: int, masters_only: bool = False) -> Future:
        """Start reading buffer i's state back into its tensors (allocated here)."""
        jobs = []
        for offset, parts in self._held(i, masters_only=masters_only):
            away = [(t, r) for t, r in parts if not self._resident(t)]
            for t, _ in away:
                t.untyped_storage().resize_(t.numel() * t.element_size())
            if away:
                jobs.append((offset, self.region_bytes[i], away))
                self._moved += self.region_bytes[i]
        return self.file.read_async(jobs)

    def _evict(
        self, i: int, state: dict | None = None, masters_only: bool = False
    ) -> tuple[Future, list[torch.Tensor]]:
        """Start writing buffer i's state out, whole regions; `_wait_written` frees it."""
        jobs, tensors = [], []
        for offset, parts in self._held(i, state, masters_only):
            here = [t for t, _ in parts if self._resident(t)]
            if not here:
                continue
            if len(here) != len(parts):  # the region is written whole: all or nothing
                raise AssertionError(f"offload: buffer {i}'s region at {offset} is half in memory")
            jobs.append((offset, self.region_bytes[i], parts))
            tensors += here
            self._moved += self.region_bytes[i]
        return self.file.write_async(jobs), tensors

    @staticmethod
    def _wait_written(writing: tuple[Future, list[torch.Tensor]] | None) -> None:
        if writing is None:
            return
        future, tensors = writing
        future.result()
        for t in tensors:
            t.untyped_storage().resize_(0)

    # -- the step ---------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, after: Callable[[Any], None] | None = None) -> None:
        """optimizer.step(), buffer by buffer, each while its state is in memory;
        `after(buffer)` then, before it is written out (zero casts its master)."""
        self.file.check()
        start, waited, self._moved = time.perf_counter(), 0.0, 0
        with BufferSteps(self.optimizer, self.buffers) as steps:
            reading: Future | None = self._fetch(0) if self.buffers else None
            writing = None
            for i, b in enumerate(self.buffers):
                ready = reading
                reading = self._fetch(i + 1) if i + 1 < len(self.buffers) else None
                waited += _waited(ready.result)
                steps.step(i)
                if after is not None:
                    after(b)
                waited += _waited(self._wait_written, writing)  # one written behind
                writing = self._evict(i)
            waited += _waited(self._wait_written, writing)
        heap.release_free_pages()  # the freed state's pages, not kept for the next step
        self.last_step = {
            "wait_s": waited,
            "step_s": time.perf_counter() - start,
            "bytes": self._moved,
        }
        steps.done()

    def disk_bytes(self) -> int:
        """Bytes of disk the file takes now (its allocated blocks)."""
        return self.file.allocated_bytes()

    def host_bytes(self) -> int:
        return 0  # a CPU run: the host is the device, its figures are the memory kinds'

    @contextmanager
    def masters(self, i: int) -> Iterator[None]:
        """Buffer i's master in memory inside (a final model's gather, zero's cast after a
        load), written back and freed after."""
        self._fetch(i, masters_only=True).result()
        try:
            yield
        finally:
            self._wait_written(self._evict(i, masters_only=True))

    # -- checkpoints ------------------------------------------------------------------------
    def on_disk(self) -> dict[int, OnDisk]:
        """id of each tensor now in the file -> where: what a save streams from the file
        instead of memory ([Note: streamed checkpoint files] in checkpoint/stream.py)."""
        return {
            id(t): OnDisk(self.file, offset + r, t.numel(), t.dtype)
            for i in range(len(self.buffers))
            for offset, parts in self._held(i)
            for t, r in parts
            if not self._resident(t)
        }

    def load_master(self, i: int) -> None:
        """Buffer i's master in memory, for a checkpoint to be loaded into it (`store`)."""
        self._fetch(i, masters_only=True).result()

    def store(self, i: int, state: dict[Any, dict[str, Any]]) -> None:
        """A loaded checkpoint's buffer i: its master (filled in memory) and the new
        per-element tensors `state` (by piece tensor, not yet the optimizer's), written
        out and freed before the next buffer is loaded."""
        self._wait_written(self._evict(i, state))

    def close(self) -> None:
        self.file.close()
