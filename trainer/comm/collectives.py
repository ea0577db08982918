"""Every collective the trainer calls: the one place that launches torch.distributed ops.

Every collective returns a `Handle`: the call launches the operation asynchronously and
`Handle.wait()` is the one place a caller blocks on it. Keeping all of them here gives
one spot for byte counting, timing (total vs. exposed communication time, [Note:
communication streams]), backend fast paths and the test hooks, at the end of this file
(`tracing()`, `membership()`, `delayed()`, `p2p()`).

Averages follow `average_plan` ([Note: averaging over ranks]): NCCL's own `ReduceOp.AVG`
where it is safe, SUM and a division elsewhere.

Read next: sendrecv.py (the Gloo send/recv fast path for reduce-scatter and all-gather),
all_to_all.py (scatter and all-to-all, on this module's launch path), groups.py (shard
and replica groups).
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp
from torch.utils import _python_dispatch

from trainer.comm import groups, sendrecv
from trainer.comm.sendrecv import P2PWork

# ---------------------------------------------------------------------------------------
# Accounting: bytes each rank sends per collective type (ring algorithm model), the time
# collectives were in flight and the part of it a caller actually waited for.


@dataclass
class CommStats:
    bytes_sent: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    # Time with at least one collective in flight: the union of the intervals, so
    # collectives in flight together count once. CPU: launch -> completion observed in
    # wait(); CUDA: start -> end of the collective on the comm stream.
    bytes_across: float = 0.0  # of bytes_sent, what went between shard groups
    busy_s: float = 0.0
    busy_until: float = 0.0
    exposed_s: float = 0.0  # time callers (CPU) or the compute stream (CUDA) waited

    def settle(self, block: bool = True) -> None:
        """CUDA: fold collectives' event timings into busy_s / exposed_s. `block=False`
        folds only the leading ones whose events have completed, without a host sync.
        [Note: communication streams]"""
        if block and pending_timings:
            _cuda.synchronize()
            n = len(pending_timings)
        else:
            n = 0
            while n < len(pending_timings) and pending_timings[n][2].query():
                n += 1
        if n == 0:
            return
        batch = pending_timings[:n]
        del pending_timings[:n]
        self.busy_s += union_s([(a, b) for kind, a, b in batch if kind == "busy"])
        self.exposed_s += union_s([(a, b) for kind, a, b in batch if kind == "exposed"])

    def reset(self) -> None:
        pending_timings.clear()
        self.bytes_sent.clear()
        self.calls.clear()
        self.bytes_across = 0.0
        self.busy_s = 0.0
        self.busy_until = 0.0
        self.exposed_s = 0.0


stats = CommStats()

# What `launch`, `wait` and the continuation thread ([Note: a collective chained on
# another]) share: the counters above and the simulated link. Per thread: whether
# collectives are accounted (`unaccounted()`) and the link time that `launch` hands to
# the Handle made next.
_lock = threading.Lock()
_local = threading.local()


def _accounting() -> bool:
    """False inside `unaccounted()` (in this thread)."""
    return getattr(_local, "accounting", True)


@contextlib.contextmanager
def unaccounted():
    """Collectives launched inside the block stay out of `stats` (bytes, calls, busy and
    exposed time, whenever they are waited or settled): evaluation and checkpoint traffic
    is not part of a training step's figures."""
    saved, _local.accounting = _accounting(), False
    try:
        yield
    finally:
        _local.accounting = saved


class Handle:
    """An in-flight collective. `wait()` blocks (CPU) or orders the compute stream after
    it (CUDA); the op's finishing step has run by then. [Note: communication streams]"""

    __slots__ = ("_work", "_post", "_t0", "_keep", "_end", "_account", "_link_s", "done")

    def __init__(
        self,
        work: dist.Work | P2PWork | None,
        post: Callable[[], None] | None = None,
        keep: Sequence[torch.Tensor] = (),
        *,
        start: torch.cuda.Event | None = None,
        group: dist.ProcessGroup | None = None,
    ):
        self._t0 = time.perf_counter()
        self._link_s = getattr(_local, "link_due_s", 0.0)  # [Note: a simulated link]
        _local.link_due_s = 0.0
        self._keep = keep  # CUDA: tensors the comm stream uses, alive until wait()
        self._account = _accounting()
        self._end = None
        if keep and _is_cuda(keep[0]):
            self._end = _finish_on_comm_stream(work, post, keep[0].device, start, group)
            work = post = None
        self._work = work
        self._post = post
        self.done = False

    def wait(self) -> None:
        self._wait(exposed=True)

    def _wait(self, exposed: bool) -> None:
        """`exposed=False`: the continuation thread waits, not the caller ([Note: a
        collective chained on another]): busy time, no exposed time."""
        if self.done:
            return
        if self._end is not None:
            self._wait_cuda()
        else:
            t = time.perf_counter()
            if self._work is not None:
                self._work.wait()
            end = time.perf_counter()
            if end < self._t0 + self._link_s:  # [Note: a simulated link]
                time.sleep(self._t0 + self._link_s - end)
                end = time.perf_counter()
            if self._account:
                with _lock:
                    stats.exposed_s += end - t if exposed else 0.0
                    # Waits return in time order (nearly, with the continuation thread
                    # waiting too), so the part of [t0, end] not yet counted is what lies
                    # after the last counted end.
                    stats.busy_s += max(0.0, end - max(self._t0, stats.busy_until))
                    stats.busy_until = max(stats.busy_until, end)
            if self._post is not None:
                self._post()
        self._keep = ()
        self.done = True

    def _wait_cuda(self) -> None:
        compute = _cuda.current_stream(self._keep[0].device)
        wait_begin = _timing_event(compute) if self._account else None
        compute.wait_event(self._end)  # compute waits only here, where it uses the result
        if wait_begin is not None:
            _add_timing("exposed", wait_begin, _timing_event(compute))


# [Note: communication streams]
# On CUDA every collective runs on a dedicated stream per device and process group, never
# on the compute stream, so kernels of backward keep running while gradients travel (one
# stream per group: two groups' collectives may be issued in different orders on
# different ranks, and one stream would then deadlock them, see fsdp.py's [Note: one
# collective order on every rank]):
#   launch: the comm stream first waits for the compute stream (the data it sends was
#           written there), then the collective is enqueued on it. The Handle keeps a
#           reference to every tensor the collective reads or writes until `wait()`; no
#           `record_stream`. Right after, still at launch, the comm stream is
#           ordered after the collective (NCCL runs it on a stream of its own; `work.wait()`
#           makes the current stream wait for it without blocking the CPU) and the
#           finishing step (averaging, adding received chunks) is enqueued behind it; an
#           `end` event marks the result ready.
#   wait:   the compute stream waits for `end`: only at this point, where the result is
#           consumed, and without blocking the CPU. Only then does the Handle drop its
#           references. These tensors were allocated on the compute stream, so when one
#           is freed its memory goes back to the compute stream's pool, and everything
#           the compute stream runs afterwards (a reuse of that memory included) is
#           ordered after the collective: safe without telling the allocator anything.
#           `record_stream` would instead hold the memory until the comm stream passes an
#           event the allocator records at the free, which makes reuse, and with it
#           `max_memory_allocated`, depend on timing (PyTorch's guidance, and FSDP2's
#           practice, is to hold references and order with events, as here). The rule
#           this needs: every Handle is waited for before its tensors are dropped.
# Copies into send buffers (a bucket's flat gradient) happen where the gradient is
# produced, on the compute stream, which the launch-time wait covers.
# Waits in the middle of backward: zero's bounded buckets and fsdp's unit after unit make
# the compute stream wait for the oldest ReduceScatter once newer ones are launched, to
# free its full-size input (allocated on the compute stream) for reuse. FSDP2 does the
# same (torch 2.14, `FSDPParamGroup.post_backward`: the compute stream waits for the
# oldest ReduceScatter's event, `reduce_scatter_max_input_buffers` of them kept); with
# NCCL's AVG that event is the `end` here, there being no finishing step. The results
# are consumed later: the reduced slices (and their AllReduce across replicas, [Note:
# hybrid sharding] in groups.py) become the optimizer's gradients only in the
# end-of-backward callback, as in FSDP2's `finalize_backward`.
# Timing: a `start` event before the collective and the `end` event after its finishing
# step, both on the comm stream, bound the time it occupied that stream; busy is the
# union of those intervals. Exposed time is the compute stream's stall: an event before
# its wait and one after. Events are read lazily, in `stats.settle()`; when more than
# `MAX_PENDING` wait to be read (a loop that never calls settle), the completed ones
# are folded without a host sync, and only if the GPU is that far behind does it block.
# Collectives launched under `unaccounted()` record no timing events.
# On CPU (Gloo) the same calls use Gloo's asynchronous work handles and wall-clock time.

# The CUDA entry points this module uses, in one name: tests stand a fake in for it.
_cuda = torch.cuda

MAX_PENDING = 1024
_streams: dict[tuple[torch.device, dist.ProcessGroup | None], torch.cuda.Stream] = {}
# ("busy" | "exposed", first event, second event), in the order they were recorded
pending_timings: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []


def _is_cuda(t: torch.Tensor) -> bool:
    return t.is_cuda


def _comm_stream(device: torch.device, group: dist.ProcessGroup | None = None) -> torch.cuda.Stream:
    if (device, group) not in _streams:
        _streams[device, group] = _cuda.Stream(device=device)
    return _streams[device, group]


def _timing_event(stream: torch.cuda.Stream) -> torch.cuda.Event:
    ev = _cuda.Event(enable_timing=True)
    ev.record(stream)
    return ev


def _add_timing(kind: str, first: torch.cuda.Event, second: torch.cuda.Event) -> None:
    pending_timings.append((kind, first, second))
    if len(pending_timings) > MAX_PENDING:  # [Note: communication streams]
        stats.settle(block=False)
        if len(pending_timings) > MAX_PENDING:
            stats.settle()


def union_s(intervals: Sequence[tuple[torch.cuda.Event, torch.cuda.Event]]) -> float:
    """Seconds covered by the union of (start, end) event intervals."""
    if not intervals:
        return 0.0
    ref = intervals[0][0]
    spans = sorted((ref.elapsed_time(a), ref.elapsed_time(b)) for a, b in intervals)  # ms
    total, until = 0.0, float("-inf")
    for a, b in spans:
        if b > until:
            total += b - max(a, until)
            until = b
    return total / 1e3


def _finish_on_comm_stream(
    work: dist.Work | P2PWork | None,
    post: Callable[[], None] | None,
    device: torch.device,
    start: torch.cuda.Event | None,
    group: dist.ProcessGroup | None = None,
) -> torch.cuda.Event:
    """CUDA, at launch: order the comm stream after the collective, enqueue the finishing
    step behind it and return the event that marks the result ready."""
    stream = _comm_stream(device, group)
    with _cuda.stream(stream):
        if work is not None:
            work.wait()  # NCCL: the comm stream waits for NCCL's stream; the CPU does not
        if post is not None:
            post()  # averaging, adding received chunks: on the comm stream
    if start is None:
        end = _cuda.Event()
        end.record(stream)
        return end
    end = _timing_event(stream)
    _add_timing("busy", start, end)
    return end


@contextlib.contextmanager
def on_comm_stream(*tensors: torch.Tensor | None, group: dist.ProcessGroup | None = None):
    """CUDA: run the enclosed launch on the group's comm stream, ordered after compute.
    Yields the launch's start event (CUDA, accounted) or None, for the Handle."""
    live = [t for t in tensors if t is not None]
    if not live or not _is_cuda(live[0]):
        yield None
        return
    stream = _comm_stream(live[0].device, group)
    stream.wait_stream(_cuda.current_stream(stream.device))
    start = _timing_event(stream) if _accounting() else None
    with _cuda.stream(stream):
        yield start


# [Note: a collective chained on another]
# Some collectives need what another delivered: all_reduce_int8's AllGather sends the
# owner's sum of what its all-to-all brought (quantized.py). Launched from `wait()`, the
# second would start only when the caller waits (ddp: after backward, bucket after
# bucket, nothing overlapping). `chain(first, then)` runs `then`, the finishing step and
# the launch of the next collective (it returns that one's Handle), as soon as `first`
# is done, without the caller waiting:
#   CUDA: at once, on the host, inside `first`'s comm stream: `then`'s kernels and its
#       collective queue behind `first` there, so the stream orders them and nothing
#       blocks. Launched from the caller's thread in its order: the same on every rank.
#   CPU (Gloo): one continuation thread per process takes the chains in the order they
#       were made: waits for `first` (its simulated link included: the sum cannot start
#       before the bytes arrive), then runs `then`. Its collective must go over a group
#       no other thread launches on (quantized.py uses a twin, groups.gather_group):
#       two threads launching on one group interleave differently on every rank and
#       would pair different collectives. One thread, in submission order, keeps one
#       order on the twin, the same on every rank.
# `then` runs under the dispatch modes the chain was made under, so a mode that samples
# every tensor op (the CPU step peak, observe/heap.py) sees its tensors too, and its
# collective is accounted as the caller's would be (not if made in `unaccounted()`).
# The chained Handle's `wait()` waits for `then` to have run (re-raising what it
# raised), then for its collective; on CPU the caller's exposed time is that whole wait,
# the continuation's own wait for `first` counts as busy time only.


class Chained(Handle):
    """`first`, then the collective `then` launches once `first` is done, in flight as
    one Handle. [Note: a collective chained on another]"""

    __slots__ = ("_first", "_then", "_next", "_ran", "_error", "_modes", "_host")

    def __init__(self, first: Handle, then: Callable[[], Handle]):
        super().__init__(None)
        self._first, self._then = first, then
        self._next: Handle | None = None
        self._error: BaseException | None = None
        self._ran = threading.Event()
        self._modes = _python_dispatch._get_current_dispatch_mode_stack()
        self._host = first._end is None  # CPU: the continuation thread runs `then`

    def _run(self, wait_first: bool) -> None:
        """Wait for `first` (CPU; on CUDA the comm stream has it), then run `then` as
        the caller would have: its accounting setting and dispatch modes."""
        saved = _accounting()
        _local.accounting = self._account
        pushed = 0
        try:
            if wait_first:
                self._first._wait(exposed=False)
            # On the continuation thread the caller's modes are pushed again; on CUDA
            # `then` runs in the caller's thread, under them already (pushing a mode
            # twice would dispatch every op to it twice, and FakeTensorMode refuses)
            for mode in self._modes if wait_first else ():
                _python_dispatch._push_mode(mode)
                pushed += 1
            with torch.no_grad():
                self._next = self._then()
        except BaseException as e:  # handed to the caller at wait()
            self._error = e
        finally:
            for _ in range(pushed):
                _python_dispatch._pop_mode()
            _local.accounting = saved
            self._then = self._modes = None
            self._ran.set()

    def wait(self) -> None:
        if self.done:
            return
        t = time.perf_counter()
        self._ran.wait()
        if self._account and self._host:  # (CUDA: `then` has run at launch)
            with _lock:
                stats.exposed_s += time.perf_counter() - t
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        self._next.wait()  # counts its own exposed time
        self._first = self._next = None  # CUDA: `first`'s buffers, kept until now
        self.done = True


class _Continuations:
    """The continuation thread: runs chains in the order they were made."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Chained] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, chain: Chained) -> None:
        if self._thread is None or not self._thread.is_alive():  # none yet, or forked
            self._queue = queue.SimpleQueue()
            self._thread = threading.Thread(target=self._serve, name="comm-chain", daemon=True)
            self._thread.start()
        self._queue.put(chain)

    def _serve(self) -> None:
        while True:
            chain = self._queue.get()
            chain._run(wait_first=True)
            chain = None  # holds no buffers (nor groups) while idle


_continuations = _Continuations()


def chain(first: Handle, then: Callable[[], Handle], group=None) -> Handle:
    """A Handle for `first` (launched over `group`) followed by the collective that
    `then` launches (its Handle returned) once `first` is done: at once behind it on the
    comm stream (CUDA), or from the continuation thread (CPU), whose collectives must go
    over a group nothing else launches on. [Note: a collective chained on another]"""
    chained = Chained(first, then)
    if chained._host:
        _continuations.submit(chained)
        return chained
    stream = _comm_stream(first._keep[0].device, group)
    with _cuda.stream(stream):
        stream.wait_event(first._end)  # `first` and its finishing step, on this stream
        chained._run(wait_first=False)
    return chained


def world_size(group: dist.ProcessGroup | None = None) -> int:
    return dist.get_world_size(group)


def rank(group: dist.ProcessGroup | None = None) -> int:
    return dist.get_rank(group)


def launch(op: str, tag: str, sent: float, account: bool = True, group=None) -> None:
    """Count, trace and (under `delayed()`) hold back the launch of `op` sending `sent`
    bytes: what every collective does first, the ones in all_to_all.py included."""
    global _link_free_at
    if _delay_s:
        time.sleep(_delay_s)
    with _lock:  # the continuation thread launches too
        if _link is not None and sent > 0:  # [Note: a simulated link]: the Handle made next
            now = time.perf_counter()
            _link_free_at = max(now, _link_free_at) + sent * 8 / (_link[0] * 1e9) + _link[1]
            _local.link_due_s = _link_free_at - now
        if account and _accounting():
            stats.bytes_sent[op] += sent
            stats.calls[op] += 1
            if groups.crosses_groups(group):  # [Note: hybrid sharding] in groups.py
                stats.bytes_across += sent
        record(f"launch:{op}", tag)
        if _members is not None:
            ranks = tuple(dist.get_process_group_ranks(group or dist.group.WORLD))
            _members.append((op, ranks))


# [Note: averaging over ranks]
# A mean over P ranks is a sum divided by P; where the division happens matters:
#   NCCL, fp32/bf16 (and fp64): `ReduceOp.AVG`, NCCL divides inside the collective: no
#       separate kernel, and these dtypes' range makes overflow of the sum a non-issue.
#   fp16, any backend: the sum of P gradients can exceed fp16's 65504 where each one does
#       not. Each rank divides its input by `pre` before the collective and the result is
#       divided by `post` = P / pre after it, with `pre` the smallest power of two at least
#       √P, as FSDP2 does: the sum then grows by at most P / pre ≈ √P, small values shrink
#       by at most `pre` before they are added, and a power of two divides exactly.
#   Gloo (and the p2p path), fp32/bf16: SUM, then a division by P at wait time:
#       `ReduceOp.AVG` is missing on Gloo and has been silently wrong in some releases.
# P = 1 does nothing: NCCL's AVG has been reported wrong at world size 1.


@dataclass(frozen=True)
class AveragePlan:
    """Divide every rank's input by `pre`, reduce with `op`, divide the result by `post`."""

    op: ReduceOp.RedOpType
    pre: float = 1.0
    post: float = 1.0


def average_plan(backend: str, dtype: torch.dtype, p: int) -> AveragePlan:
    """How a collective averages `dtype` over `p` ranks on `backend` ("nccl", "gloo", or
    "p2p" for sendrecv.py's send/recv collectives). [Note: averaging over ranks]"""
    if p <= 1:
        return AveragePlan(ReduceOp.SUM)
    if dtype == torch.float16:
        pre = 1
        while pre * pre < p:
            pre *= 2
        return AveragePlan(ReduceOp.SUM, pre=float(pre), post=p / pre)
    if backend == "nccl":
        return AveragePlan(ReduceOp.AVG)
    return AveragePlan(ReduceOp.SUM, post=float(p))


def _plan(average: bool, tensor: torch.Tensor, group, p2p: bool = False) -> AveragePlan:
    if not average:
        return AveragePlan(ReduceOp.SUM)
    backend = "p2p" if p2p else str(dist.get_backend(group))
    return average_plan(backend, tensor.dtype, world_size(group))


def _divide(t: torch.Tensor, n: float) -> Callable[[], None] | None:
    return (lambda: t.div_(n)) if n != 1 else None


# Flat-tensor collectives: recent torch names them `*_single`; torch 2.6 and 2.7 have only
# the older names, same arguments. Looked up per call, so a test can take one away.
NATIVE_NAMES = {
    "reduce_scatter": ("reduce_scatter_single", "reduce_scatter_tensor"),
    "all_gather": ("all_gather_single", "all_gather_into_tensor"),
}


def native(op: str) -> Callable[..., dist.Work | None]:
    new, old = NATIVE_NAMES[op]
    return getattr(dist, new, None) or getattr(dist, old)


# ---------------------------------------------------------------------------------------
# The collectives the trainer uses.


def all_reduce(
    tensor: torch.Tensor,
    *,
    average: bool = False,
    tag: str = "",
    account: bool = True,
    group=None,
) -> Handle:
    """Sum (or average) `tensor` over ranks in place. `account=False` keeps small control
    messages out of the training traffic figures."""
    p = world_size(group)
    plan = _plan(average, tensor, group)
    launch("all_reduce", tag, 2 * (p - 1) / p * nbytes(tensor), account, group)
    if p == 1:  # the sum (and mean) over one rank is the tensor itself: nothing runs
        return _finished()  # (Gloo would still copy it: ~2 ms a step for 3 MB on CPU)
    with on_comm_stream(tensor, group=group) as start:
        if plan.pre != 1:
            tensor.div_(plan.pre)
        work = dist.all_reduce(tensor, op=plan.op, group=group, async_op=True)
    return Handle(work, _divide(tensor, plan.post), keep=(tensor,), start=start, group=group)


def _finished() -> Handle:
    """The handle of a collective that had nothing to do: waiting for it is free."""
    handle = Handle(None)
    handle.done = True
    return handle


def reduce_scatter(
    output: torch.Tensor, input: torch.Tensor, *, average: bool = False, tag: str = "", group=None
) -> Handle:
    """Rank r receives the sum (or mean) of every rank's r-th 1/P slice of flat `input`.
    An fp16 mean divides `input` in place before sending it ([Note: averaging over
    ranks]): it is a send buffer, not to be read afterwards."""
    p = world_size(group)
    _check_split(output, input, p, "reduce_scatter")
    via_p2p = p2p_enabled(group)
    plan = _plan(average, input, group, via_p2p)
    launch("reduce_scatter", tag, (p - 1) / p * nbytes(input), group=group)
    with on_comm_stream(output, input, group=group) as start:
        if plan.pre != 1:
            input.div_(plan.pre)
        if via_p2p:  # sendrecv.py, [Note: p2p collectives on Gloo]
            work = sendrecv.reduce_scatter(output, input, group)
        else:
            work = native("reduce_scatter")(output, input, op=plan.op, group=group, async_op=True)
    return Handle(work, _divide(output, plan.post), keep=(output, input), start=start, group=group)


def all_gather(output: torch.Tensor, input: torch.Tensor, *, tag: str = "", group=None) -> Handle:
    """Every rank receives all ranks' `input` shards concatenated in rank order."""
    p = world_size(group)
    _check_split(input, output, p, "all_gather")
    launch("all_gather", tag, (p - 1) * nbytes(input), group=group)
    with on_comm_stream(output, input, group=group) as start:
        if p2p_enabled(group):  # sendrecv.py, [Note: p2p collectives on Gloo]
            work = sendrecv.all_gather(output, input, group)
        else:
            work = native("all_gather")(output, input, group=group, async_op=True)
    return Handle(work, keep=(output, input), start=start, group=group)


def broadcast(tensor: torch.Tensor, src: int = 0, *, tag: str = "", group=None) -> Handle:
    launch("broadcast", tag, nbytes(tensor) if rank(group) == src else 0, group=group)
    with on_comm_stream(tensor, group=group) as start:
        work = dist.broadcast(tensor, src, group=group, async_op=True)
    return Handle(work, keep=(tensor,), start=start, group=group)


def reduce(tensor: torch.Tensor, dst: int = 0, *, tag: str = "", group=None) -> Handle:
    """Sum `tensor` into rank `dst`; other ranks' copies are left undefined."""
    launch("reduce", tag, nbytes(tensor), group=group)
    with on_comm_stream(tensor, group=group) as start:
        work = dist.reduce(tensor, dst, group=group, async_op=True)
    return Handle(work, keep=(tensor,), start=start, group=group)


def gather(
    tensor: torch.Tensor,
    gather_list: list[torch.Tensor] | None,
    dst: int = 0,
    *,
    tag: str = "",
    group=None,
) -> Handle:
    """Rank `dst` receives every rank's `tensor` in `gather_list` (None elsewhere)."""
    launch("gather", tag, nbytes(tensor) if rank(group) != dst else 0, group=group)
    return Handle(dist.gather(tensor, gather_list, dst, group=group, async_op=True))


def barrier(*, tag: str = "", group=None) -> Handle:
    launch("barrier", tag, 0, group=group)
    return Handle(dist.barrier(group=group, async_op=True))


def broadcast_object(objects: list, src: int = 0, group=None) -> None:
    """Replace `objects` in place with rank `src`'s list (picklable Python objects)."""
    launch("broadcast_object", "", 0, group=group)
    dist.broadcast_object_list(objects, src, group=group)


def all_gather_object(obj: object, group=None) -> list:
    """Every rank's picklable `obj`, in rank order (control messages: not in the stats)."""
    out: list = [None] * world_size(group)
    launch("all_gather_object", "", 0, account=False, group=group)
    dist.all_gather_object(out, obj, group=group)
    return out


def wait_all(handles: Sequence[Handle]) -> None:
    for h in handles:
        h.wait()


def free_storage(t: torch.Tensor) -> None:
    """Free the memory of `t`, a buffer a waited-for collective used, now.

    Dropping the last Python reference is not enough: Gloo runs an op on a worker thread
    that lets go of it (and of its tensors) a moment after `wait()` returns, so the
    buffer would outlive the wait by a scheduling delay and sit beside whatever is
    allocated next. Only for tensors that own their storage (no views of it remain in
    use). On CUDA the compute stream has waited for the op by then, so its memory is free
    to reuse there."""
    t.untyped_storage().resize_(0)


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _check_split(shard: torch.Tensor, full: torch.Tensor, p: int, op: str) -> None:
    if full.numel() != shard.numel() * p:
        raise ValueError(
            f"{op}: full tensor has {full.numel()} elements, expected {p} x {shard.numel()}"
        )


# ---------------------------------------------------------------------------------------
# Test hooks, each a context manager that restores the previous setting on exit:
# `tracing()` records (event, tag) tuples in issue order, `membership()` the ranks of
# each launch's group, `delayed(s)` sleeps before each launch so tests can expose missing
# synchronisation, `p2p(flag)` forces sendrecv.py's send/recv collectives on or off.
# `launch` and the collectives above read this state; `record` is the engines' own way
# into the trace.

# [Note: a simulated link]
# `simulated_link(gbps, latency_s)` gives each rank one link (its NIC) that every
# collective sending bytes occupies for sent * 8 / (gbps * 1e9) + latency_s, on the bytes
# this rank hands to it (what `stats` counts: an int8 collective's packed bytes, scales
# included). Collectives in flight together share it in launch order: one finishes at
# the latest of its launch and the previous one's finish, plus its own time. `launch`
# computes that finish and the Handle made right after it takes it; `wait` sleeps until
# then if the real collective ended earlier. Time the caller spends computing before it
# waits overlaps the link, as it would with a real one: a collective in flight during
# backward costs only what is still left at its wait.
# Gloo on loopback moves bytes at memory speed (GB/s), so without this a CPU run cannot
# show what fewer bytes buy on a network. CPU (Gloo) only: on CUDA the delay would have
# to run on the comm stream; the run refuses `comm.link_gbps` there (run/loop.py).
_link: tuple[float, float] | None = None  # (Gb/s, latency s)
# _local.link_due_s: the link time of the collective being launched, for its Handle
_link_free_at = 0.0  # perf_counter() time at which the link has sent all launched bytes


def simulated_link(gbps: float | None, latency_s: float = 0.0) -> None:
    """Every collective from now on takes at least bytes / `gbps` + `latency_s` (None:
    no simulated link). [Note: a simulated link]"""
    global _link, _link_free_at
    _link_free_at = 0.0
    if gbps is not None and not gbps > 0:
        raise ValueError(f"simulated link: {gbps} Gb/s must be > 0")
    _link = None if gbps is None else (float(gbps), float(latency_s))


_trace: list[tuple[str, str]] | None = None
_members: list[tuple[str, tuple[int, ...]]] | None = None
_delay_s: float = 0.0
_use_p2p: bool | None = None  # None: p2p on Gloo, native elsewhere; True/False force either


@contextlib.contextmanager
def tracing() -> Iterator[list[tuple[str, str]]]:
    """Yield the list that launches and `record` events append to while the block runs."""
    global _trace
    saved, _trace = _trace, []
    try:
        yield _trace
    finally:
        _trace = saved


@contextlib.contextmanager
def membership() -> Iterator[list[tuple[str, tuple[int, ...]]]]:
    """Yield the list that every launch inside the block appends (op, global ranks of
    its group) to: which ranks each collective ran between."""
    global _members
    saved, _members = _members, []
    try:
        yield _members
    finally:
        _members = saved


@contextlib.contextmanager
def delayed(seconds: float) -> Iterator[None]:
    """Sleep `seconds` before every collective launched inside the block."""
    global _delay_s
    saved, _delay_s = _delay_s, seconds
    try:
        yield
    finally:
        _delay_s = saved


@contextlib.contextmanager
def p2p(enabled: bool | None) -> Iterator[None]:
    """Force reduce_scatter / all_gather onto sendrecv.py's sends (True) or the backend's
    native op (False) inside the block; None restores the choice by backend."""
    global _use_p2p
    saved, _use_p2p = _use_p2p, enabled
    try:
        yield
    finally:
        _use_p2p = saved


def p2p_enabled(group) -> bool:
    """Whether reduce_scatter / all_gather over `group` go through sendrecv.py's sends:
    on Gloo unless `p2p()` says otherwise ([Note: p2p collectives on Gloo] in sendrecv.py)."""
    if _use_p2p is not None:
        return _use_p2p
    return dist.get_backend(group) == "gloo"


def record(event: str, tag: str = "") -> None:
    """Append an event to the trace inside `tracing()`; free otherwise."""
    if _trace is not None:
        _trace.append((event, tag))
