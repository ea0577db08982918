"""What `mode.offload=host` keeps in host memory on a GPU run: each rank's fp32 masters
and optimizer state, stepped there by torch's fused CPU optimizer, with the gradients
copied down and the updated parameters copied back up on a stream of their own.

Masters and the gradients the step reads cross the bus every step, so they are pinned, in
one arena per rank (`PinnedArena`); the optimizer's own state stays in plain host memory.
What lives where, why one arena, the order of a step's copies and waits and why each host
buffer is safe to reuse: [Note: host offload], beside `HostOffload`.

On a CPU run the host is the device and the config refuses host offload; the tests run
this same code on CPU tensors, where each copy is a plain copy and no stream or event
exists, to hold its bookkeeping bit for bit to offload=null.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from trainer.errors import ConfigError
from trainer.observe import host
from trainer.offload.disk import ALIGN, aligned
from trainer.offload.state import BufferSteps


def _register(t: torch.Tensor) -> None:
    """Pin `t`'s memory in place (cudaHostRegister): page-locked, no copy, no rounding."""
    rc = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel(), 0)
    if int(rc) != 0:
        raise ConfigError(
            f"mode.offload=host: cannot pin {t.numel() / 2**30:.2f} GiB of host memory "
            f"({rc}); raise the locked-memory limit (ulimit -l) or free host memory"
        )


def _unregister(ptr: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(ptr)


class PinnedArena:
    """`nbytes` of page-aligned host memory, registered with the driver when `pin` (a
    CUDA run), handed out as typed views; unregistered when closed or collected."""

    def __init__(self, nbytes: int, pin: bool):
        self.nbytes = int(nbytes)
        self._raw = torch.empty(self.nbytes + ALIGN, dtype=torch.uint8)
        skip = -self._raw.data_ptr() % ALIGN
        self.bytes = self._raw[skip : skip + self.nbytes]
        self._release: Callable[[], None] | None = None
        if pin and self.nbytes:
            _register(self.bytes)
            self._release = weakref.finalize(self, _unregister, self.bytes.data_ptr())

    def view(self, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        size = torch.empty((), dtype=dtype).element_size()
        return self.bytes[offset : offset + numel * size].view(dtype)

    def close(self) -> None:
        if self._release is not None:
            self._release()
            self._release = None


# [Note: host offload]
# Per rank, for its shard (S values per sharded buffer: zero's buckets, fsdp's units):
# - On the host: every buffer's fp32 master, which becomes the optimizer's (its pieces are
#   views of it, so the optimizer, the lr schedule and checkpoints see host tensors like
#   any others); the optimizer's per-element state, made there by the optimizer itself at
#   its first step, in plain host memory, since it never crosses to the device; and a
#   gradient buffer per buffer that the step reads.
# - On the device: what forward and backward need. zero: the full parameters in the
#   compute dtype; fsdp: the shard each unshard gathers, kept in the compute dtype
#   (`device_shard`), so it is cast once a step instead of at every unshard; and, in both,
#   the gradient shard from its reduction until the step has copied it.
# Master and gradient cross the bus every step, so they are pinned, in one arena per rank
# sized to the byte (`PinnedArena`: the sum of the regions, each a whole number of pages)
# and registered with the driver, instead of blocks from torch's caching host allocator,
# which rounds each up to a power of two (1.9x the memory, in several projects).
#
# The step (`step`), after the device has unscaled and clipped the gradients: each
# buffer's gradient shard is copied into its host buffer on the offload stream, which
# first waits for the compute stream, and an event is recorded per buffer. Buffer by
# buffer, the host waits for that buffer's event (the one wait a host step cannot do
# without: it reads what the copy wrote; through trainer/observe/host.py, so the rehearsal
# sees it asked for), steps that buffer alone (BufferSteps, as the disk path), and queues
# the copy of its updated master up to the device (`_copy_up`), which runs while the host
# steps the next buffer. In a mixed precision the host casts the master into the buffer's
# gradient region first (free by then, pinned), so the bus carries 2 bytes a value and the
# copy is a plain asynchronous one. Last, the compute stream waits for the offload stream,
# before anything gathers the new parameters or frees a gradient the copy read.
#
# Why each host buffer is safe to reuse: a gradient region is written by the next step's
# copy down, queued on the offload stream after this step's copies up from it; the host
# writes a master (the optimizer) or a region (the cast) only after waiting for the event
# of a copy down queued after every earlier copy up.
class HostOffload:
    """The masters and optimizer state of `buffers` (sharded.py's ShardedBuffer) on the
    host ([Note: host offload]); `targets[i]` is the device tensor buffer i's master goes
    to after each step (zero: its slice of the full parameters; fsdp: its gathered
    shard), in the compute dtype. Takes over the optimizer's parameters: build it before
    the first step."""

    kind = "host"  # mode.offload's value
    move_masters = False  # nothing goes to a file: the masters' values stay in memory

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        buffers: Sequence[Any],
        targets: Sequence[torch.Tensor],
    ):
        if optimizer.state:
            raise AssertionError("host offload takes over an optimizer that never stepped")
        self.optimizer, self.buffers, self.targets = optimizer, list(buffers), list(targets)
        self.device = targets[0].device if targets else torch.device("cpu")
        on_cuda = self.device.type == "cuda"
        sizes = [aligned(b.shard_numel * b.master.element_size()) for b in self.buffers]
        self.arena = PinnedArena(2 * sum(sizes), pin=on_cuda)
        self.stream = torch.cuda.Stream(self.device) if on_cuda else None
        swapped: dict[int, nn.Parameter] = {}
        offset = 0
        for b, size in zip(self.buffers, sizes, strict=True):
            master = self.arena.view(offset, b.shard_numel, b.master.dtype)
            b.host_grad = self.arena.view(offset + size, b.shard_numel, torch.float32)
            offset += 2 * size
            master.copy_(b.master)  # at build: the one blocking copy down
            pieces = []
            for p in b.pieces:
                mine = nn.Parameter(master.detach()[p.start : p.end].view_as(p.tensor))
                swapped[id(p.tensor)] = mine
                pieces.append(dataclasses.replace(p, tensor=mine))
            b.master, b.pieces = master, pieces  # the device master goes with its last use
        for group in optimizer.param_groups:
            group["params"] = [
                swapped[id(t)] if id(t) in swapped else _host_placeholder(t)
                for t in group["params"]
            ]
        self.last_step = {"wait_s": 0.0, "step_s": 0.0, "bytes": 0}
        # per step: each gradient down in fp32, each master up in its target's dtype
        self._bytes_per_step = sum(
            b.shard_numel * (4 + t.element_size())
            for b, t in zip(self.buffers, self.targets, strict=True)
        )

    # -- copies, on the offload stream ------------------------------------------------------
    @contextlib.contextmanager
    def _on_stream(self) -> Iterator[None]:
        if self.device.type != "cuda":
            yield
            return
        with torch.cuda.stream(self.stream):
            yield

    def _record(self) -> Any:
        if self.device.type == "cuda":
            return self.stream.record_event()
        return None

    def _copy_down(self) -> list[Any]:
        """Every buffer's gradient shard into its host buffer; one event each."""
        self._follow()
        events = []
        with self._on_stream():
            for b in self.buffers:
                if b.grad_shard is not None:
                    host.copy_to_host(b.host_grad, b.grad_shard, "host offload: gradients")
                events.append(self._record())
        return events

    def _copy_up(self, i: int) -> None:
        """Queue buffer i's master into its device target, cast on the host first where
        the target holds a lower precision (into the buffer's gradient region, pinned);
        the caller orders the offload stream around it (`_follow`, `_join`)."""
        b, target = self.buffers[i], self.targets[i]
        source = b.master
        if target.dtype != source.dtype:
            source = b.host_grad.view(torch.uint8)[: source.numel() * target.element_size()]
            source = source.view(target.dtype).copy_(b.master)
        with self._on_stream():
            target.copy_(source, non_blocking=True)

    def _follow(self) -> None:
        """The offload stream after the compute stream: the device's unscale and clipping
        of the gradients, and whatever reads the targets now, come first."""
        if self.device.type == "cuda":
            self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def _join(self) -> None:
        """The compute stream after every copy up: what reads the new parameters, or
        frees a gradient shard the copies down read, comes after."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).wait_stream(self.stream)

    # -- the step ---------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, after: Callable[[Any], None] | None = None) -> None:
        """optimizer.step() on the host, buffer by buffer, each once its gradient is
        there, its master then copied up (the host path's `after`: zero's cast is it)."""
        start, waited = time.perf_counter(), 0.0
        events = self._copy_down()
        with BufferSteps(self.optimizer, self.buffers) as steps:
            for i in range(len(self.buffers)):
                if events[i] is not None:
                    t0 = time.perf_counter()
                    host.wait_event(events[i], "host offload: gradient copied down")
                    waited += time.perf_counter() - t0
                steps.step(i)
                self._copy_up(i)
        self._join()
        self.last_step = {
            "wait_s": waited,
            "step_s": time.perf_counter() - start,
            "bytes": self._bytes_per_step,
        }
        steps.done()

    def copy_all_up(self) -> None:
        """Every master to the device (after a checkpoint is loaded into them)."""
        self._follow()
        for i in range(len(self.buffers)):
            self._copy_up(i)
        self._join()

    # -- what the disk path has, and this one has not -------------------------------------
    def on_disk(self) -> dict:
        return {}  # host tensors: a checkpoint reads them where they are

    def load_master(self, i: int) -> None:
        pass  # in memory already

    def store(self, i: int, state: dict) -> None:
        pass  # the loaded tensors are host tensors: the optimizer takes them as they are

    @contextlib.contextmanager
    def masters(self, i: int) -> Iterator[None]:
        yield

    def disk_bytes(self) -> int:
        return 0

    def host_bytes(self) -> int:
        """Host bytes this rank's state takes: the arena and the optimizer's state."""
        state = {
            (v.untyped_storage().data_ptr(), v.untyped_storage().nbytes())
            for s in self.optimizer.state.values()
            for v in s.values()
            if torch.is_tensor(v) and v.device.type == "cpu" and v.dim() > 0
        }
        return self.arena.nbytes + sum(n for _, n in state)

    def close(self) -> None:
        self.arena.close()


def _host_placeholder(t: torch.Tensor) -> nn.Parameter:
    if t.numel():
        raise AssertionError(f"host offload: an optimizer tensor of {t.shape} outside every buffer")
    return nn.Parameter(torch.empty(0, dtype=t.dtype))  # a rank whose slice is padding only
