"""The only module that calls torch.distributed collectives.

Every collective returns a `Handle`: the call launches the operation asynchronously and
`Handle.wait()` is the one place a caller blocks on it. Keeping all of them here gives
one spot for byte counting, timing (total vs. exposed communication time), backend
fast paths and the test hooks (an event trace and an injected delay).

Averages follow `average_plan` ([Note: averaging over ranks]): NCCL's own `ReduceOp.AVG`
where it is safe, SUM and a division elsewhere.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

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
    busy_s: float = 0.0
    busy_until: float = 0.0
    exposed_s: float = 0.0  # time callers (CPU) or the compute stream (CUDA) waited

    def settle(self, block: bool = True) -> None:
        """CUDA: fold collectives' event timings into busy_s / exposed_s. `block=False`
        folds only the leading ones whose events have completed, without a host sync.
        [Note: communication streams]"""
        if block and _pending_timings:
            _cuda.synchronize()
            n = len(_pending_timings)
        else:
            n = 0
            while n < len(_pending_timings) and _pending_timings[n][2].query():
                n += 1
        if n == 0:
            return
        batch = _pending_timings[:n]
        del _pending_timings[:n]
        self.busy_s += _union_s([(a, b) for kind, a, b in batch if kind == "busy"])
        self.exposed_s += _union_s([(a, b) for kind, a, b in batch if kind == "exposed"])

    def reset(self) -> None:
        _pending_timings.clear()
        self.bytes_sent.clear()
        self.calls.clear()
        self.busy_s = 0.0
        self.busy_until = 0.0
        self.exposed_s = 0.0


stats = CommStats()

# Test hooks. `trace` (a list, or None) receives (event, tag) tuples in issue order;
# `delay_s` sleeps before each launch so tests can expose missing synchronisation.
trace: list[tuple[str, str]] | None = None
delay_s: float = 0.0

_accounting = True  # False inside unaccounted()


@contextlib.contextmanager
def unaccounted():
    """Collectives launched inside the block stay out of `stats` (bytes, calls, busy and
    exposed time, whenever they are waited or settled): evaluation and checkpoint traffic
    is not part of a training step's figures."""
    global _accounting
    saved, _accounting = _accounting, False
    try:
        yield
    finally:
        _accounting = saved


def record(event: str, tag: str = "") -> None:
    """Append an event to the trace when a test is recording; free otherwise."""
    if trace is not None:
        trace.append((event, tag))


class Handle:
    """An in-flight collective. `wait()` blocks (CPU) or orders the compute stream after
    it (CUDA); the op's finishing step has run by then. [Note: communication streams]"""

    __slots__ = ("_work", "_post", "_t0", "_keep", "_end", "_account", "done")

    def __init__(
        self,
        work: dist.Work | _P2PWork | None,
        post: Callable[[], None] | None = None,
        keep: Sequence[torch.Tensor] = (),
        *,
        start: torch.cuda.Event | None = None,
        group: dist.ProcessGroup | None = None,
    ):
        self._t0 = time.perf_counter()
        self._keep = keep  # CUDA: tensors the comm stream uses, alive until wait()
        self._account = _accounting
        self._end = None
        if keep and _is_cuda(keep[0]):
            self._end = _finish_on_comm_stream(work, post, keep[0].device, start, group)
            work = post = None
        self._work = work
        self._post = post
        self.done = False

    def wait(self) -> None:
        if self.done:
            return
        if self._end is not None:
            self._wait_cuda()
        else:
            t = time.perf_counter()
            if self._work is not None:
                self._work.wait()
            end = time.perf_counter()
            if self._account:
                stats.exposed_s += end - t
                # Waits return in time order, so the part of [t0, end] not yet counted is
                # what lies after the last counted end.
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
#           written there), then the collective is enqueued on it; `record_stream` tells
#           the caching allocator that these tensors are in use on the comm stream, and the
#           Handle keeps a reference, so memory freed by the compute stream is not reused
#           under a collective in flight. Right after, still at launch, the comm stream is
#           ordered after the collective (NCCL runs it on a stream of its own; `work.wait()`
#           makes the current stream wait for it without blocking the CPU) and the
#           finishing step (averaging, adding received chunks) is enqueued behind it; an
#           `end` event marks the result ready.
#   wait:   the compute stream waits for `end`: only at this point, where the result is
#           consumed, and without blocking the CPU.
# Copies into send buffers (a bucket's flat gradient) happen where the gradient is
# produced, on the compute stream, which the launch-time wait covers.
# Timing: a `start` event before the collective and the `end` event after its finishing
# step, both on the comm stream, bound the time it occupied that stream; busy is the
# union of those intervals. Exposed time is the compute stream's stall: an event before
# its wait and one after. Events are read lazily, in `stats.settle()`; when more than
# `_MAX_PENDING` wait to be read (a loop that never calls settle), the completed ones
# are folded without a host sync, and only if the GPU is that far behind does it block.
# Collectives launched under `unaccounted()` record no timing events.
# On CPU (Gloo) the same calls use Gloo's asynchronous work handles and wall-clock time.

# The CUDA entry points this module uses, in one name: tests stand a fake in for it.
_cuda = torch.cuda

_MAX_PENDING = 1024
_streams: dict[tuple[torch.device, dist.ProcessGroup | None], torch.cuda.Stream] = {}
# ("busy" | "exposed", first event, second event), in the order they were recorded
_pending_timings: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []


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
    _pending_timings.append((kind, first, second))
    if len(_pending_timings) > _MAX_PENDING:  # [Note: communication streams]
        stats.settle(block=False)
        if len(_pending_timings) > _MAX_PENDING:
            stats.settle()


def _union_s(intervals: Sequence[tuple[torch.cuda.Event, torch.cuda.Event]]) -> float:
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
    work: dist.Work | _P2PWork | None,
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
def _on_comm_stream(*tensors: torch.Tensor | None, group: dist.ProcessGroup | None = None):
    """CUDA: run the enclosed launch on the group's comm stream, ordered after compute.
    Yields the launch's start event (CUDA, accounted) or None, for the Handle."""
    live = [t for t in tensors if t is not None]
    if not live or not _is_cuda(live[0]):
        yield None
        return
    stream = _comm_stream(live[0].device, group)
    stream.wait_stream(_cuda.current_stream(stream.device))
    for t in live:
        t.record_stream(stream)
    start = _timing_event(stream) if _accounting else None
    with _cuda.stream(stream):
        yield start


_second_groups: dict[dist.ProcessGroup, dist.ProcessGroup] = {}


def second_group() -> dist.ProcessGroup:
    """A second group over all ranks, with the default group's backend, made once per
    process group: its collectives are matched among themselves only, whatever order they
    interleave with the default group's on each rank (fsdp's AllGathers, [Note: one
    collective order on every rank]). Every rank must first call it at the same point."""
    default = dist.group.WORLD
    if default not in _second_groups:
        _second_groups[default] = dist.new_group(backend=dist.get_backend())
    return _second_groups[default]


def world_size(group: dist.ProcessGroup | None = None) -> int:
    return dist.get_world_size(group)


def rank(group: dist.ProcessGroup | None = None) -> int:
    return dist.get_rank(group)


def _launch(op: str, tag: str, nbytes: float, account: bool = True) -> None:
    if delay_s:
        time.sleep(delay_s)
    if account and _accounting:
        stats.bytes_sent[op] += nbytes
        stats.calls[op] += 1
    record(f"launch:{op}", tag)


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
    "p2p" for this module's send/recv collectives). [Note: averaging over ranks]"""
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
    _launch("all_reduce", tag, 2 * (p - 1) / p * _nbytes(tensor), account)
    with _on_comm_stream(tensor, group=group) as start:
        if plan.pre != 1:
            tensor.div_(plan.pre)
        work = dist.all_reduce(tensor, op=plan.op, group=group, async_op=True)
    return Handle(work, _divide(tensor, plan.post), keep=(tensor,), start=start, group=group)


def reduce_scatter(
    output: torch.Tensor, input: torch.Tensor, *, average: bool = False, tag: str = "", group=None
) -> Handle:
    """Rank r receives the sum (or mean) of every rank's r-th 1/P slice of flat `input`.
    An fp16 mean divides `input` in place before sending it ([Note: averaging over
    ranks]): it is a send buffer, not to be read afterwards."""
    p = world_size(group)
    _check_split(output, input, p, "reduce_scatter")
    p2p = _p2p_enabled(group)
    plan = _plan(average, input, group, p2p)
    _launch("reduce_scatter", tag, (p - 1) / p * _nbytes(input))
    with _on_comm_stream(output, input, group=group) as start:
        if plan.pre != 1:
            input.div_(plan.pre)
        if p2p:  # [Note: p2p collectives on Gloo]
            work = _p2p_reduce_scatter(output, input, group)
        else:
            work = dist.reduce_scatter_single(output, input, op=plan.op, group=group, async_op=True)
    return Handle(work, _divide(output, plan.post), keep=(output, input), start=start, group=group)


def all_gather(output: torch.Tensor, input: torch.Tensor, *, tag: str = "", group=None) -> Handle:
    """Every rank receives all ranks' `input` shards concatenated in rank order."""
    p = world_size(group)
    _check_split(input, output, p, "all_gather")
    _launch("all_gather", tag, (p - 1) * _nbytes(input))
    with _on_comm_stream(output, input, group=group) as start:
        if _p2p_enabled(group):  # [Note: p2p collectives on Gloo]
            work = _p2p_all_gather(output, input, group)
        else:
            work = dist.all_gather_single(output, input, group=group, async_op=True)
    return Handle(work, keep=(output, input), start=start, group=group)


def broadcast(tensor: torch.Tensor, src: int = 0, *, tag: str = "", group=None) -> Handle:
    _launch("broadcast", tag, _nbytes(tensor) if rank(group) == src else 0)
    with _on_comm_stream(tensor, group=group) as start:
        work = dist.broadcast(tensor, src, group=group, async_op=True)
    return Handle(work, keep=(tensor,), start=start, group=group)


def reduce(tensor: torch.Tensor, dst: int = 0, *, tag: str = "", group=None) -> Handle:
    """Sum `tensor` into rank `dst`; other ranks' copies are left undefined."""
    _launch("reduce", tag, _nbytes(tensor))
    with _on_comm_stream(tensor, group=group) as start:
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
    _launch("gather", tag, _nbytes(tensor) if rank(group) != dst else 0)
    return Handle(dist.gather(tensor, gather_list, dst, group=group, async_op=True))


def scatter(
    output: torch.Tensor,
    scatter_list: list[torch.Tensor] | None,
    src: int = 0,
    *,
    tag: str = "",
    group=None,
) -> Handle:
    """Rank r receives `scatter_list[r]` from rank `src`."""
    sent = sum(_nbytes(t) for t in scatter_list[1:]) if scatter_list and rank(group) == src else 0
    _launch("scatter", tag, sent)
    return Handle(dist.scatter(output, scatter_list, src, group=group, async_op=True))


def all_to_all(
    output: torch.Tensor,
    input: torch.Tensor,
    output_splits: Sequence[int] | None = None,
    input_splits: Sequence[int] | None = None,
    *,
    tag: str = "",
    group=None,
) -> Handle:
    """Rank r's j-th input piece lands as rank j's r-th output piece (splits along dim 0)."""
    p = world_size(group)
    if input_splits is None:
        sent = (p - 1) / p * _nbytes(input)
    else:
        row = _nbytes(input) / max(input.shape[0], 1)
        sent = row * (sum(input_splits) - input_splits[rank(group)])
    _launch("all_to_all", tag, sent)
    with _on_comm_stream(output, input, group=group) as start:
        work = dist.all_to_all_single(
            output, input, output_splits, input_splits, group=group, async_op=True
        )
    return Handle(work, keep=(output, input), start=start, group=group)


def barrier(*, tag: str = "", group=None) -> Handle:
    _launch("barrier", tag, 0)
    return Handle(dist.barrier(group=group, async_op=True))


def broadcast_object(objects: list, src: int = 0, group=None) -> None:
    """Replace `objects` in place with rank `src`'s list (picklable Python objects)."""
    _launch("broadcast_object", "", 0)
    dist.broadcast_object_list(objects, src, group=group)


def wait_all(handles: Sequence[Handle]) -> None:
    for h in handles:
        h.wait()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _check_split(shard: torch.Tensor, full: torch.Tensor, p: int, op: str) -> None:
    if full.numel() != shard.numel() * p:
        raise ValueError(
            f"{op}: full tensor has {full.numel()} elements, expected {p} x {shard.numel()}"
        )


# ---------------------------------------------------------------------------------------
# Reduce-scatter and all-gather built from point-to-point sends: the Gloo fast path.
#
# [Note: p2p collectives on Gloo]
# Gloo runs reduce_scatter as a whole all-reduce and its all_gather is slow. Both are
# short to write from sends and receives that move exactly the textbook (P-1)/P of the
# full buffer per rank, the same bytes as the ring algorithm:
#
#   reduce-scatter: rank r sends its chunk j to rank j (every j != r) and receives chunk
#       r from every other rank; wait() adds those P-1 chunks to its own chunk r.
#   all-gather: rank r sends its shard to every other rank and receives theirs straight
#       into their places in `output`.
#
# All 2(P-1) messages are posted at once (one batch_isend_irecv) and the backend's
# threads move them, so the Handle is in flight while the caller computes. Every rank's
# k-th message goes k ranks ahead, so the first messages spread over all ranks instead
# of all landing on rank 0. A ring (P-1 dependent steps: receive from r-1, add, forward
# to r+1) sends the same bytes but needs a helper thread to chain its steps; it measured
# slower than this on Gloo at every size and world size tried (docs/comm_bench.md). The
# price is a receive buffer of (P-2)/P of the input per reduce-scatter in flight, (P-1)/P
# when the output is the input's own chunk (a ring needs 2/P).
# NCCL's native collectives are already bandwidth-optimal rings/trees: NCCL stays native.

use_p2p: bool | None = None  # None: p2p on Gloo, native elsewhere; True/False force either

_P2P_TAG = 0x50325043  # tag of these messages, apart from any other p2p traffic


def _p2p_enabled(group) -> bool:
    if use_p2p is not None:
        return use_p2p
    return dist.get_backend(group) == "gloo"


class _P2PWork:
    """Sends and receives in flight; `wait()` waits for all, then runs `finish`."""

    def __init__(self, works: list[dist.Work], finish: Callable[[], None] | None = None):
        self._works = works
        self._finish = finish

    def wait(self) -> bool:
        for work in self._works:
            work.wait()
        if self._finish is not None:
            self._finish()
        return True


def _exchange(
    sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]], group
) -> list[dist.Work]:
    """Post every (tensor, group rank) send and receive at once."""
    ops = [
        dist.P2POp(dist.isend, t, group=group, tag=_P2P_TAG, group_peer=peer) for t, peer in sends
    ]
    ops += [
        dist.P2POp(dist.irecv, t, group=group, tag=_P2P_TAG, group_peer=peer) for t, peer in recvs
    ]
    return dist.batch_isend_irecv(ops) if ops else []


def _p2p_reduce_scatter(output: torch.Tensor, input: torch.Tensor, group) -> _P2PWork:
    p, r = world_size(group), rank(group)
    chunks = input.view(p, -1)  # (P, n): chunk j is summed on rank j
    out = output.view(-1)  # (n,); may be chunks[r] itself (in place)
    # Out of place, the first chunk received lands straight in `out`: one receive buffer
    # fewer (none at P=2) and no copy of chunks[r]; a + b == b + a, so the sum is the same.
    direct = p > 1 and out.data_ptr() != chunks[r].data_ptr()
    received = input.new_empty((p - 1 - direct, out.numel()))  # (P-1 or P-2, n)
    rows = [out, *received] if direct else list(received)  # row k-1 from rank r-k
    works = _exchange(
        [(chunks[(r + k) % p], (r + k) % p) for k in range(1, p)],
        [(rows[k - 1], (r - k) % p) for k in range(1, p)],
        group,
    )

    def finish() -> None:
        if direct:
            out.add_(chunks[r])
        elif out.data_ptr() != chunks[r].data_ptr():  # P = 1
            out.copy_(chunks[r])
        for row in received:
            out.add_(row)

    return _P2PWork(works, finish)


def _p2p_all_gather(output: torch.Tensor, input: torch.Tensor, group) -> _P2PWork:
    p, r = world_size(group), rank(group)
    chunks = output.view(p, -1)  # (P, n): chunk j is rank j's shard
    shard = input.view(-1)  # (n,); may be chunks[r] itself (in place)
    if shard.data_ptr() != chunks[r].data_ptr():
        chunks[r].copy_(shard)
    works = _exchange(
        [(chunks[r], (r + k) % p) for k in range(1, p)],
        [(chunks[(r - k) % p], (r - k) % p) for k in range(1, p)],
        group,
    )
    return _P2PWork(works)


# ---------------------------------------------------------------------------------------
# Uneven all-to-all, as MoE token dispatch uses it.


def all_to_all_uneven(
    pieces: Sequence[torch.Tensor], *, tag: str = "", group=None
) -> tuple[list[torch.Tensor], Handle]:
    """Send `pieces[j]` (any number of rows along dim 0, zero included) to rank j.

    The receiver cannot size its buffer without knowing what is coming, so the split
    sizes go first, in a small all-to-all this call waits for; the payload all-to-all is
    returned in flight. Returns the received pieces in source-rank order (valid once the
    handle is waited) and the handle.
    """
    p = world_size(group)
    if len(pieces) != p:
        raise ValueError(f"all_to_all_uneven: got {len(pieces)} pieces for world size {p}")
    sizes = torch.tensor([t.shape[0] for t in pieces], dtype=torch.int64, device=pieces[0].device)
    incoming = torch.empty_like(sizes)
    all_to_all(incoming, sizes, tag=tag, group=group).wait()  # (P,): rows from each rank
    input_splits, output_splits = sizes.tolist(), incoming.tolist()
    input = torch.cat(list(pieces))  # (sum sent, ...)
    output = input.new_empty((sum(output_splits), *input.shape[1:]))  # (sum received, ...)
    handle = all_to_all(output, input, output_splits, input_splits, tag=tag, group=group)
    return list(output.split(output_splits)), handle
