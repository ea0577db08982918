"""Fake CUDA: tensors on "cuda" without a GPU, and streams and events that check the order
trainer/comm/collectives.py's [Note: communication streams] promises.

`fake_cuda()` installs it for a block and yields the `Checker`. Under torch's
FakeTensorMode, factory calls with device="cuda" make fake CUDA tensors (shapes, dtypes
and devices; no memory, no kernels), and the stand-ins here replace torch.cuda's streams,
events and synchronize. `Tracker` sees every op on a fake CUDA tensor, the fake process
group (world.py) every collective, and the `Checker` refuses, in one line naming the op,
its tag and the lines involved, a buffer used on a stream not yet ordered after its last
write on another, one written or freed while a collective still uses it, and a host read
inside a step that does not go through trainer/observe/host.py.

Read next, each beside the code it explains:
- `fake_cuda`: [Note: fake CUDA tensors], what fake tensors change and what is patched so
  that the engines run on them;
- `Checker`: [Note: checking stream order], the streams' vector clocks and the rules.
"""

from __future__ import annotations

import contextlib
import itertools
import sys
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch._dynamo  # noqa: F401  (imported before _make_subclass is wrapped: it checks its signature)
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
)
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

import trainer
from trainer.checkpoint import files
from trainer.comm import collectives
from trainer.models import materialize
from trainer.observe import host
from trainer.offload import host as offload_host
from trainer.rehearse.patches import Patches

TRAINER = str(Path(trainer.__file__).parent) + "/"
HERE = str(Path(__file__).parent) + "/"


class Violation(RuntimeError):
    """What the rehearsal refuses: one line, with the tag and the lines involved."""


def where(skip: tuple[str, ...] = ()) -> str:
    """The innermost trainer/ line running now (outside this package and `skip`), and the
    next trainer/ line in another file that called it."""
    frames = []
    f = sys._getframe(1)
    while f is not None:
        name = f.f_code.co_filename
        if name.startswith(TRAINER) and not name.startswith(HERE):
            frames.append((name[len(TRAINER) - len("trainer/") :], f.f_lineno, f.f_code.co_name))
        f = f.f_back
    frames = [fr for fr in frames if not fr[0].endswith(skip)] or frames
    if not frames:
        return "outside trainer/"
    inner = frames[0]
    text = f"{inner[0]}:{inner[1]} ({inner[2]})"
    outer = next((fr for fr in frames if fr[0] != inner[0]), None)
    if outer is not None:
        text += f", called from {outer[0]}:{outer[1]}"
    return text


# ---------------------------------------------------------------------------------------
# Streams and events


class Stream:
    """Stand-in for torch.cuda.Stream: a vector clock ([Note: checking stream order])."""

    _names = itertools.count()

    def __init__(self, device: Any = None, priority: int = 0, *, name: str | None = None):
        self.device = _cuda_device(device)
        self.name = name or f"stream {next(Stream._names)}"
        self.clock: dict[Stream, int] = {self: 0}

    def wait_stream(self, other: Stream) -> None:
        merge_clock(self.clock, other.clock)

    def wait_event(self, event: Event) -> None:
        if event.clock is not None:  # an event never recorded: nothing to wait for
            merge_clock(self.clock, event.clock)

    def record_event(self, event: Event | None = None) -> Event:
        event = event or Event()
        event.record(self)
        return event

    def synchronize(self) -> None:
        checker().host_sync("Stream.synchronize()", self.clock)

    def query(self) -> bool:
        return True

    def tick(self) -> int:
        self.clock[self] += 1
        return self.clock[self]

    def __repr__(self) -> str:
        return self.name


class Event:
    """Stand-in for torch.cuda.Event: the clock of the stream it was recorded on."""

    _times = itertools.count()

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess=False):
        self.clock: dict[Stream, int] | None = None
        self.time = 0

    def record(self, stream: Stream | None = None) -> None:
        stream = stream or current_stream()
        self.clock = dict(stream.clock)
        self.time = next(Event._times)

    def wait(self, stream: Stream | None = None) -> None:
        (stream or current_stream()).wait_event(self)

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        checker().host_sync("Event.synchronize()", self.clock or {})

    def elapsed_time(self, end: Event) -> float:
        return (end.time - self.time) * 1e-3  # ms: any increasing figure will do


def merge_clock(into: dict[Stream, int], other: dict[Stream, int]) -> None:
    """`into` is ordered after everything `other` is ordered after (a vector clock's join)."""
    for s, n in other.items():
        if into.get(s, 0) < n:
            into[s] = n


def _cuda_device(device: Any) -> torch.device:
    if device is None:
        return torch.device("cuda", 0)
    d = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    return d if d.index is not None else torch.device("cuda", 0)


_local = threading.local()


def current_stream(device: Any = None) -> Stream:
    stack = getattr(_local, "streams", None)
    if stack:
        return stack[-1]
    return checker().compute


def default_stream(device: Any = None) -> Stream:
    return checker().compute


@contextlib.contextmanager
def stream(s: Stream | None) -> Iterator[None]:
    """Stand-in for torch.cuda.stream(s): ops inside run on `s`."""
    if s is None:
        yield
        return
    if not hasattr(_local, "streams"):
        _local.streams = []
    _local.streams.append(s)
    try:
        yield
    finally:
        _local.streams.pop()


def synchronize(device: Any = None) -> None:
    c = checker()
    everything: dict[Stream, int] = {}
    for s in c.streams:
        merge_clock(everything, s.clock)
    c.host_sync("torch.cuda.synchronize()", everything)


# ---------------------------------------------------------------------------------------
# What each storage went through


@dataclass
class Use:
    stream: Stream
    n: int  # the op's position on its stream
    what: str  # e.g. "all_reduce 'bucket0' output"
    at: str  # the trainer line that launched it


@dataclass
class Record:
    alloc: Stream  # the stream it was allocated on: its memory goes back to that pool
    write: Use | None = None
    reads: dict[Stream, Use] = field(default_factory=dict)
    kept: set[Stream] = field(default_factory=set)  # record_stream(s) was called
    freed: bool = False
    watched: bool = False  # in Checker.inflight
    ref: Any = None  # a StorageWeakRef, while watched

    def uses(self) -> list[Use]:
        return ([self.write] if self.write else []) + list(self.reads.values())

    def covers(self, u: Use) -> bool:
        """Whether reusing the memory on its allocating stream now is ordered after `u`."""
        if u.stream is self.alloc or u.stream in self.kept:
            return True
        return any(s.clock.get(u.stream, 0) >= u.n for s in (self.alloc, *self.kept))


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _bytes_of(t: torch.Tensor) -> tuple[int, int]:
    """[first, last) bytes of its storage that `t` spans (contiguous or not)."""
    size = t.element_size()
    lo = t.storage_offset() * size
    span = sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True) if n) + 1
    return lo, lo + (span * size if t.numel() else 0)


def is_fake_cuda(t: Any) -> bool:
    return isinstance(t, FakeTensor) and t.fake_device.type == "cuda"


# [Note: checking stream order]
# Every stream keeps a vector clock: the number of ops it has run, and for every other
# stream the last of that stream's ops it is ordered after (through `wait_stream`,
# `wait_event` and a host synchronize). The dispatch mode below sees every op on a fake
# CUDA tensor, the arguments it writes (the schema's `a!`) and those it reads, and the
# fake process group (world.py) records what each collective reads and writes on NCCL's
# own stream. For each storage the checker keeps its last write and the reads since, and
# refuses, naming the collective's op and tag and the lines involved:
#   - a read or write of a buffer last written on another stream that this stream is
#     not ordered after (a result consumed before the wait on its event);
#   - a write of a buffer that an op on another stream still reads (a send buffer
#     reused while its collective is in flight);
#   - the free of a buffer (its last reference dropped, or `resize_(0)` of its storage)
#     that another stream used after the stream it was allocated on last waited for it,
#     unless `record_stream` named that stream: the allocator would hand the memory out
#     again on the allocating stream while the collective still uses it. A Handle's
#     hold list keeps its tensors alive until its wait, which is why the trainer needs
#     no `record_stream`.
# Inside a step (`Checker.step()`), a host read of a CUDA value (`.item()`, `nonzero`,
# `.cpu()`, a copy to the host) or a synchronize is refused unless it goes through
# trainer/observe/host.py; the values such reads return are made up (the tensors have
# none), chosen per read in `Checker.values`.
class Checker:
    """The state of one rehearsal: streams, storages, what a step may read on the host."""

    def __init__(self) -> None:
        self.compute = Stream(name="the compute stream")
        self.streams: list[Stream] = [self.compute]
        self.records: dict[int, Record] = {}
        self.inflight: list[Record] = []  # storages a collective on another stream used
        self.violations: list[str] = []
        self.in_step = False
        self.permitted: list[str] = []  # host.* reads under way
        self.syncs: list[str] = []  # every host read or sync seen, with its reason
        self.ops = 0
        # Host memory a copy on a stream reads or writes (mode.offload=host's pinned
        # buffers): its uses by storage, and how far the host has waited on each stream
        self.host_uses: dict[int, list[tuple[Use, bool, tuple[int, int]]]] = {}
        self.host_clock: dict[Stream, int] = {}
        self.mode: FakeTensorMode | None = None
        # Made-up results of the host reads the code is meant to make (the fake tensors
        # have no values), by `why`: a function of the tensor read.
        self.values: dict[str, Callable[[torch.Tensor], Any]] = {}

    # -- streams -------------------------------------------------------------------------
    def new_stream(self, device: Any = None, priority: int = 0, name: str | None = None) -> Stream:
        s = Stream(device, priority, name=name)
        self.streams.append(s)
        return s

    # -- accesses ------------------------------------------------------------------------
    def fail(self, message: str) -> None:
        self.violations.append(message)
        raise Violation(message)

    def allocated(self, t: torch.Tensor, s: Stream) -> None:
        self.records[_key(t)] = Record(s)

    def access(self, t: torch.Tensor, s: Stream, write: bool, what: str, at: str = "") -> None:
        """Op `what` on stream `s` reads (or writes) `t`'s storage."""
        key = _key(t)
        rec = self.records.get(key)
        if rec is None or rec.freed:
            rec = self.records[key] = Record(s)
        n = s.clock[s]  # the op was ticked already
        w = rec.write
        if w is not None and w.stream is not s and s.clock.get(w.stream, 0) < w.n:
            self.fail(
                f"{w.what} (launched at {w.at}) wrote a buffer that {what} "
                f"{'writes' if write else 'reads'} on {s} at {at or where()} before {s} "
                f"waited for it (a wait on an event recorded after the collective)"
            )
        if write:
            for r in rec.reads.values():
                if r.stream is not s and s.clock.get(r.stream, 0) < r.n:
                    self.fail(
                        f"{what} on {s} at {at or where()} overwrites a buffer that "
                        f"{r.what} (launched at {r.at}) may still be reading: reused in flight"
                    )
            rec.write, rec.reads = Use(s, n, what, at), {}
        else:
            rec.reads[s] = Use(s, n, what, at)

    def watch(self, t: torch.Tensor) -> None:
        """Check the free of `t`'s storage (used by a collective on another stream): its
        last reference dropped, or `resize_(0)`, before its allocating stream waited."""
        rec = self.records.get(_key(t))
        if rec is not None and not rec.watched:
            rec.watched = True
            rec.ref = StorageWeakRef(t.untyped_storage())
            self.inflight.append(rec)

    def poll(self) -> None:
        """Before each op: a watched storage freed while a use on another stream is still
        unordered with its allocating stream is a violation (the next allocation there
        could reuse it); one now ordered is no longer watched."""
        still = []
        for rec in self.inflight:
            pending = [u for u in rec.uses() if not rec.covers(u)]
            if not pending:
                rec.watched = False
                continue
            if rec.freed or rec.ref.expired():
                u = pending[0]
                rec.freed = True
                self.violations.append(
                    f"a buffer that {u.what} (launched at {u.at}) uses was freed before "
                    f"{rec.alloc} waited for that collective, with no record_stream and "
                    f"no Handle holding it (next op at {where()}): its memory can be "
                    "reused while the collective runs"
                )
                continue
            still.append(rec)
        self.inflight = still

    def resized(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        rec = self.records.get(storage._cdata)
        if rec is not None and nbytes == 0:
            rec.freed = True
            self.poll()
            self.records.pop(storage._cdata, None)

    def kept(self, t: torch.Tensor, s: Stream) -> None:
        rec = self.records.get(_key(t))
        if rec is not None:
            rec.kept.add(s)

    # -- host reads ----------------------------------------------------------------------
    def host_read(self, what: str) -> None:
        self.syncs.append(f"{what}: {self.permitted[-1] if self.permitted else where()}")
        if self.in_step and not self.permitted:
            self.fail(
                f"a host read of a CUDA value ({what}) in a step, at {where()}: it stalls the "
                "CPU until the GPU catches up; read through trainer/observe/host.py where "
                "a read is meant to be"
            )

    def host_sync(self, what: str, clock: dict[Stream, int]) -> None:
        self.host_read(what)
        for s in self.streams:  # everything queued later is ordered after what finished
            merge_clock(s.clock, clock)
        merge_clock(self.host_clock, clock)

    def host_written(self, t: torch.Tensor, why: str) -> None:
        """A copy queued on the current stream writes host tensor `t`."""
        s = current_stream()
        self._host_use(t, Use(s, s.clock[s], why, where()), True)

    def device_reads_host(self, t: torch.Tensor, s: Stream, what: str) -> None:
        """An asynchronous copy on stream `s` reads host tensor `t`."""
        self._host_use(t, Use(s, s.clock[s], what, where()), False)

    def _host_use(self, t: torch.Tensor, use: Use, writes: bool) -> None:
        self.host_uses.setdefault(_key(t), []).append((use, writes, _bytes_of(t)))

    def host_access(self, t: torch.Tensor, write: bool, what: str) -> None:
        """The host (an op on CPU tensors) reads or writes `t`: a copy on a stream that
        writes its bytes, or (for a write) reads them, must be one the host has waited
        for. By byte range: one pinned arena holds many buffers."""
        uses = self.host_uses.get(_key(t))
        if not uses:
            return
        left = [u for u in uses if self.host_clock.get(u[0].stream, 0) < u[0].n]
        self.host_uses[_key(t)] = left
        lo, hi = _bytes_of(t)
        for u, copy_writes, (a, b) in left:
            if (copy_writes or write) and a < hi and lo < b:
                self.fail(
                    f"{what} at {where()} {'writes' if write else 'reads'} host memory that "
                    f"{u.what} (queued on {u.stream} at {u.at}) "
                    f"{'writes' if copy_writes else 'reads'} before the host waited for it "
                    "(an event recorded after the copy, waited through trainer/observe/host.py)"
                )

    def value(self, t: torch.Tensor, why: str, kind: str) -> Any:
        make = self.values.get(why)
        if make is not None:
            return make(t)
        return _zero(t) if kind == "item" else [_zero(t)] * t.numel()

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """A training step: no host reads but through host.py; a step's violations raised."""
        self.in_step = True
        try:
            yield
        finally:
            self.in_step = False
        self.check()

    def check(self) -> None:
        if self.violations:
            raise Violation(self.violations[0])


def _zero(t: torch.Tensor) -> Any:
    """A made-up value where no `Checker.values` entry says better: 1 (a count, a sum of
    losses: a log line divides by such), False for a flag."""
    if t.dtype == torch.bool:
        return False
    return 1 if not t.is_floating_point() else 1.0


_checker: Checker | None = None


def checker() -> Checker:
    if _checker is None:
        raise RuntimeError("fake CUDA is not installed (trainer.rehearse.fake_cuda())")
    return _checker


# ---------------------------------------------------------------------------------------
# The dispatch mode that sees every op


SYNCING_OPS = {"_local_scalar_dense", "nonzero", "is_nonzero", "equal", "unique", "masked_select"}


# In-place ops without a fake kernel in torch: the fused optimizers given the lr as a
# tensor (fp16's device-side schedule, trainer/run/optim.py)
NO_FAKE_KERNEL = {
    getattr(torch.ops.aten, op).tensor_lr
    for op in ("_fused_adam_", "_fused_adamw_", "_fused_sgd_")
    if hasattr(getattr(torch.ops.aten, op), "tensor_lr")
}


def _schema_of(func) -> tuple[list[tuple[int, str, bool]], bool]:
    """(position, name, written) of each argument, and whether the op returns new storage."""
    args = [
        (i, a.name, a.alias_info is not None and a.alias_info.is_write)
        for i, a in enumerate(func._schema.arguments)
    ]
    fresh = all(r.alias_info is None for r in func._schema.returns)
    return args, fresh


class Tracker(TorchDispatchMode):
    """Every op on fake CUDA tensors: its reads and writes on the current stream, host
    reads, and devices mixed ([Note: checking stream order])."""

    def __init__(self, c: Checker) -> None:
        super().__init__()
        self.c = c
        self.schemas: dict[Any, tuple[list[tuple[int, str, bool]], bool]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        c = self.c
        c.ops += 1
        if c.inflight:
            c.poll()
        name = func.overloadpacket.__name__
        leaves = _tensors(args, kwargs)
        if any(type(t) is not FakeTensor and t.is_meta for t in leaves):
            args, kwargs = self._on_fake_device(leaves, args, kwargs)
            leaves = _tensors(args, kwargs)
        _adopt_meta(leaves)
        cuda_args = [t for t in leaves if is_fake_cuda(t)]
        if cuda_args and (name in SYNCING_OPS or _to_host(name, args, kwargs)):
            c.host_read(f"aten.{name}")
            if name == "_local_scalar_dense":
                return c.value(args[0], "", "item") if not c.permitted else 0
        if name == "_local_scalar_dense":  # a CPU value: no sync, but fake has none
            return 1 if not args[0].is_floating_point() else 1.0
        try:
            if func in NO_FAKE_KERNEL:  # in place, nothing returned: only the devices matter
                devices = {t.fake_device for t in leaves if isinstance(t, FakeTensor)}
                if len(devices - {torch.device("meta")}) > 1:  # meta: see find_common_device
                    c.fail(f"{name} mixes devices {sorted(map(str, devices))} at {where()}")
                out = None
            else:
                out = func(*args, **kwargs)
        except torch._subclasses.fake_tensor.FakeTensorDeviceMismatchError as e:
            c.fail(f"{name} mixes devices at {where()}: {e}")
        except (DataDependentOutputException, DynamicOutputShapeException):
            c.fail(
                f"{name} at {where()} needs a tensor's values (a host read not through "
                "trainer/observe/host.py, or a shape that depends on values)"
            )
        if func not in self.schemas:
            self.schemas[func] = _schema_of(func)
        schema, fresh = self.schemas[func]
        if not cuda_args and not any(is_fake_cuda(t) for t in _leaves(out)):
            if c.host_uses:  # a host op: after the copies of what it touches
                for i, arg, written in schema:
                    for t in _leaves(args[i] if i < len(args) else kwargs.get(arg)):
                        c.host_access(t, written, f"aten.{name}")
            return out
        s = current_stream()
        s.tick()
        # an asynchronous copy from host memory: the host must not write it until waited
        from_host = name == "copy_" and bool(
            args[2] if len(args) > 2 else kwargs.get("non_blocking")
        )
        for i, arg, written in schema:
            value = args[i] if i < len(args) else kwargs.get(arg)
            for t in _leaves(value):
                if is_fake_cuda(t):
                    c.access(t, s, written, f"aten.{name}")
                elif from_host and not written and isinstance(t, FakeTensor):
                    c.device_reads_host(t, s, f"aten.{name}")
        if fresh:
            for t in _leaves(out):
                if is_fake_cuda(t):
                    c.allocated(t, s)
        return out

    def _on_fake_device(self, leaves, args, kwargs):
        """A real meta tensor here was made by C++ from a fake tensor's options (which say
        meta: [Note: fake CUDA tensors]), a scalar of a composite op: put it on the fake
        device of the op's other tensors."""
        device = next((t.fake_device for t in leaves if isinstance(t, FakeTensor)), None)
        if device is None or device.type == "meta":
            return args, kwargs
        mode = self.c.mode

        def fix(t):
            if isinstance(t, torch.Tensor) and type(t) is not FakeTensor and t.is_meta:
                return FakeTensor(mode, t, device)
            return t

        return pytree.tree_map(fix, (args, kwargs))


def _adopt_meta(leaves: list) -> None:
    """A fake tensor on meta beside tensors of one other device was made by C++ from a
    fake tensor's options ([Note: fake CUDA tensors]): it is on that device."""
    metas = [t for t in leaves if isinstance(t, FakeTensor) and t.fake_device.type == "meta"]
    if not metas:
        return
    devices = {t.fake_device for t in leaves if isinstance(t, FakeTensor)} - {META}
    if len(devices) == 1:
        device = devices.pop()
        for t in metas:
            t.fake_device = device


META = torch.device("meta")


def _zeros_like_numpy(t: torch.Tensor):
    import numpy as np

    with _disable_current_modes():
        return np.zeros(tuple(t.shape), dtype=torch.empty((), dtype=t.dtype).numpy().dtype)


def _leaves(value: Any) -> list:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, torch.Tensor)]
    return []


def _tensors(args, kwargs) -> list:
    out = []
    for v in itertools.chain(args, kwargs.values()):
        out += _leaves(v)
    return out


def _to_host(name: str, args, kwargs) -> bool:
    """A copy of a CUDA tensor into host memory: the CPU waits for it."""
    if name == "_to_copy":
        device = kwargs.get("device")
        return device is not None and torch.device(device).type == "cpu"
    if name == "copy_":
        dst = args[0]
        return isinstance(dst, FakeTensor) and dst.fake_device.type == "cpu"
    return False


# ---------------------------------------------------------------------------------------
# Installing it


# [Note: fake CUDA tensors]
# torch's FakeTensorMode makes `device="cuda"` tensors on a CPU-only machine: shapes,
# dtypes and devices propagate, nothing is allocated, no kernel runs, and an op mixing a
# CPU tensor with a CUDA one raises FakeTensorDeviceMismatchError. Two things stop the
# real engines there, and `fake_cuda()` changes both while it is installed:
#   - autograd: a fake tensor tells C++ its device is cuda, so the backward engine asks
#     the CUDA driver for the current streams and fails. Fake tensors are made with
#     their C++ device left at meta (`dispatch_device=False`); `.device` and `.is_cuda`
#     answer from the fake device in Python, which is all trainer code looks at.
#   - torch.cuda's streams, events and synchronize need a driver: the stand-ins above
#     (`Stream`, `Event`, `synchronize`) replace them, in torch.cuda and in
#     collectives.py's `_cuda`.
# What C++ then believes has consequences, each undone here: a tensor C++ makes from a
# fake tensor's options (inside a composite op, or in torch's grouping of tensors by
# device) is on meta, and takes the device of the op's other tensors (`_adopt_meta`, and
# `_find_common_device` ignoring meta beside them: CPU and CUDA still may not mix);
# `Tensor.to` compares C++ devices, so to("meta") and to("cuda") of a tensor already
# there answer from the fake device; `swap_tensors` (materialize.swap_into) refuses the
# weak reference FakeTensorMode keeps to every fake tensor; torch.load and checkpoint
# checksums run on real host tensors, and a fake host tensor's bytes are zeros.
@contextlib.contextmanager
def fake_cuda(device_name: str = "NVIDIA H100 80GB HBM3") -> Iterator[Checker]:
    """Install fake CUDA ([Note: fake CUDA tensors]) and its checker for the block; yields
    the Checker. Factory calls with device="cuda" make fake CUDA tensors; every other
    tensor made inside is a fake CPU tensor."""
    global _checker
    c = Checker()
    patches = Patches()
    make_subclass = torch.Tensor._make_subclass

    def _make_subclass(cls, data, require_grad=False, **kwargs):
        if cls is FakeTensor and kwargs.get("dispatch_device"):
            kwargs["dispatch_device"] = False  # C++ sees meta: autograd stays on the CPU
        return make_subclass(cls, data, require_grad, **kwargs)

    patches.set(torch.Tensor, "_make_subclass", staticmethod(_make_subclass))
    patches.set(FakeTensor, "is_cuda", property(lambda t: t.fake_device.type == "cuda"))
    patches.set(FakeTensor, "is_cpu", property(lambda t: t.fake_device.type == "cpu"))
    patches.set(FakeTensor, "is_meta", property(lambda t: t.fake_device.type == "meta"))
    patches.set(FakeTensor, "get_device", lambda t: t.fake_device.index if t.is_cuda else -1)

    to = torch.Tensor.to

    def to_meta_too(t: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        # C++ sees every fake tensor on meta, so Tensor.to("meta") would return it as it is
        # and to("cuda") would copy a tensor that is there already
        parsed = {k: v for k, v in kwargs.items() if k != "copy"}  # _parse_to takes no copy=
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **parsed)
        if device is not None and device.type == "meta" and t.fake_device.type != "meta":
            return torch.ops.aten._to_copy.default(t, dtype=dtype or t.dtype, device=device)
        if device is not None and device.type == "cuda" and not kwargs.get("copy", False):
            here = t.fake_device
            same = here.type == "cuda" and device.index in (None, here.index)
            if same and (dtype is None or dtype == t.dtype):
                return t
        return to(t, *args, **kwargs)

    patches.set(FakeTensor, "to", to_meta_too)
    common_device = FakeTensor._find_common_device

    def find_common_device(func, flat_args):
        # Tensors C++ made from a fake tensor's options are on meta: they take the device
        # of the op's other tensors. CPU and CUDA still may not mix.
        others = [a for a in flat_args if not (isinstance(a, FakeTensor) and a.is_meta)]
        if len(others) < len(flat_args) and any(isinstance(a, FakeTensor) for a in others):
            flat_args = others
        return common_device(func, flat_args)

    patches.set(FakeTensor, "_find_common_device", staticmethod(find_common_device))

    like = materialize.parameter_like

    def like_fake(param: torch.nn.Parameter, data: torch.Tensor) -> torch.nn.Parameter:
        # A FakeTensor keeps its device in its __dict__, which parameter_like copies from `param`
        new = like(param, data)
        if isinstance(data, FakeTensor):
            new.__dict__.update(data.__dict__)
        return new

    patches.set(materialize, "parameter_like", like_fake)
    # swap_tensors (materialize.swap_into) refuses a tensor with weak references, and
    # FakeTensorMode keeps one to every fake tensor, for its own bookkeeping only
    patches.set(
        torch.utils,
        "weakref",
        SimpleNamespace(
            getweakrefs=lambda t: [] if isinstance(t, FakeTensor) else weakref.getweakrefs(t)
        ),
    )

    def numpy(t: torch.Tensor, *, force: bool = False):
        # A fake host tensor has no bytes: a checkpoint writes zeros of its size
        if t.fake_device.type != "cpu":
            raise TypeError(f"can't convert {t.fake_device} tensor to numpy")
        return _zeros_like_numpy(t)

    patches.set(FakeTensor, "numpy", numpy)

    def reduce_ex(t: torch.Tensor, protocol: int):
        # torch.save of a fake tensor (a checkpoint's scalars) saves zeros of its kind
        with _disable_current_modes():
            real = torch.zeros(tuple(t.shape), dtype=t.dtype)
        return real.__reduce_ex__(protocol)

    patches.set(FakeTensor, "__reduce_ex__", reduce_ex)
    # Host files are read and checked for real (the RNG states, the checksums), on any
    # thread, while the device tensors written are fake (zeros)
    load, checksum = torch.load, files.checksum

    def real_load(*args: Any, **kwargs: Any) -> Any:
        with _disable_current_modes():
            return load(*args, **kwargs)

    def real_checksum(obj: Any, crc: int = 0) -> int:
        with _disable_current_modes():
            return checksum(obj, crc)

    patches.set(torch, "load", real_load)
    patches.set(files, "checksum", real_checksum)
    set_rng_state = torch.set_rng_state  # a state loaded under the fake mode is fake
    patches.set(
        torch, "set_rng_state", lambda s: None if isinstance(s, FakeTensor) else set_rng_state(s)
    )

    def record_stream(t: torch.Tensor, s: Stream) -> None:
        c.kept(t, s)

    patches.set(FakeTensor, "record_stream", record_stream)
    resize = torch.UntypedStorage.resize_

    def resize_(storage, nbytes):
        c.resized(storage, nbytes)
        return resize(storage, nbytes)

    patches.set(torch.UntypedStorage, "resize_", resize_)

    # torch.cuda's entry points the trainer calls, and collectives.py's `_cuda`
    cuda_rng = torch.zeros(16, dtype=torch.uint8)  # real: checkpoints save it
    fake = SimpleNamespace(
        Stream=lambda device=None, priority=0: c.new_stream(device, priority),
        Event=Event,
        current_stream=current_stream,
        default_stream=default_stream,
        stream=stream,
        synchronize=synchronize,
    )
    patches.set(collectives, "_cuda", fake)
    for name in ("current_stream", "default_stream", "stream", "synchronize"):
        patches.set(torch.cuda, name, getattr(fake, name))
    patches.set(torch.cuda, "Stream", fake.Stream)
    patches.set(torch.cuda, "Event", Event)
    patches.set(torch.cuda, "max_memory_allocated", lambda device=None: 0)
    patches.set(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    patches.set(torch.cuda, "get_device_name", lambda device=None: device_name)
    patches.set(torch.cuda, "current_device", lambda: 0)
    patches.set(torch.cuda, "is_initialized", lambda: True)
    patches.set(torch.cuda, "get_rng_state", lambda device=None: cuda_rng)
    patches.set(torch.cuda, "set_rng_state", lambda state, device=None: None)
    patches.set(torch.cuda, "manual_seed", lambda seed: None)
    patches.set(torch.cuda, "default_generators", tuple(torch.Generator() for _ in range(8)))

    # host.py: the reads meant to be, counted as before, answered with made-up values
    item, tolist = host.item, host.tolist

    def fake_item(t: torch.Tensor, why: str):
        if not is_fake_cuda(t):
            return item(t, why)
        c.permitted.append(why)
        try:
            host.count_read(why)
            c.host_read(f"host.item ({why})")
            return c.value(t, why, "item")
        finally:
            c.permitted.pop()

    def fake_tolist(t: torch.Tensor, why: str):
        if not is_fake_cuda(t):
            return tolist(t, why)
        c.permitted.append(why)
        try:
            host.count_read(why)
            c.host_read(f"host.tolist ({why})")
            return c.value(t, why, "tolist")
        finally:
            c.permitted.pop()

    synchronize_ = host.synchronize

    def fake_synchronize(device: torch.device, why: str) -> None:
        c.permitted.append(why)
        try:
            synchronize_(device, why)
        finally:
            c.permitted.pop()

    copy_to_host, wait_event = host.copy_to_host, host.wait_event

    def fake_copy_to_host(dst: torch.Tensor, src: torch.Tensor, why: str) -> None:
        c.permitted.append(why)  # a copy queued on the stream: the wait comes later
        try:
            copy_to_host(dst, src, why)
        finally:
            c.permitted.pop()
        c.host_written(dst, why)

    def fake_wait_event(event: Event, why: str) -> None:
        c.permitted.append(why)
        try:
            wait_event(event, why)
        finally:
            c.permitted.pop()

    patches.set(host, "item", fake_item)
    patches.set(host, "tolist", fake_tolist)
    patches.set(host, "synchronize", fake_synchronize)
    patches.set(host, "copy_to_host", fake_copy_to_host)
    patches.set(host, "wait_event", fake_wait_event)
    # host offload's pinned arena: registered with the driver, which is not here
    patches.set(offload_host, "_register", lambda t: None)
    patches.set(offload_host, "_unregister", lambda ptr: None)

    _checker = c
    FakeTensorMode.cache_clear()  # results cached under another current device
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    mode.allow_meta = True  # meta builds: parameters on meta inside the fake mode
    c.mode = mode
    try:
        with mode, Tracker(c), warnings.catch_warnings():
            # memory.py keys storages by data_ptr(), which a fake tensor answers with a warning
            warnings.filterwarnings("ignore", "Accessing the data pointer of FakeTensor")
            yield c
    finally:
        _checker = None
        patches.undo()
