"""comm/collectives.py's averaging plans and its CUDA timing bookkeeping, checked on CPU."""

from __future__ import annotations

import pytest
import torch
from dist_harness import run_distributed
from torch.distributed import ReduceOp

from trainer.comm import AveragePlan, average_plan
from trainer.comm import collectives as comm  # the module whose names the fakes replace

# ---------------------------------------------------------------------------------------
# Averaging: which plan, and that the plan is carried out.


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_nccl_averages_inside_the_collective(dtype):
    assert average_plan("nccl", dtype, 8) == AveragePlan(ReduceOp.AVG)


@pytest.mark.parametrize("backend", ["gloo", "p2p"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gloo_sums_then_divides(backend, dtype):
    assert average_plan(backend, dtype, 4) == AveragePlan(ReduceOp.SUM, post=4.0)


@pytest.mark.parametrize(
    "p, pre",
    [(2, 2), (3, 2), (4, 2), (5, 4), (8, 4), (16, 4), (24, 8), (64, 8), (128, 16)],
)
@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_fp16_divides_before_and_after(backend, p, pre):
    plan = average_plan(backend, torch.float16, p)
    assert plan == AveragePlan(ReduceOp.SUM, pre=float(pre), post=p / pre)
    assert plan.pre * plan.post == p


@pytest.mark.parametrize("backend", ["nccl", "gloo"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_one_rank_does_nothing(backend, dtype):
    assert average_plan(backend, dtype, 1) == AveragePlan(ReduceOp.SUM)


@pytest.fixture
def fake_nccl(monkeypatch):
    """Four NCCL ranks without a process group: each collective records the op and the
    values it was handed, and returns its input unchanged (as if the others sent zeros
    to a SUM, or the same values to an AVG)."""
    seen: list[tuple[str, ReduceOp.RedOpType, list[float]]] = []

    def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False):
        seen.append(("all_reduce", op, tensor.tolist()))

    def reduce_scatter_single(output, input, op=ReduceOp.SUM, group=None, async_op=False):
        seen.append(("reduce_scatter", op, input.tolist()))
        output.copy_(input.view(4, -1)[0])

    monkeypatch.setattr(comm, "world_size", lambda group=None: 4)
    monkeypatch.setattr(comm, "_use_p2p", False)
    monkeypatch.setattr(comm.dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(comm.dist, "all_reduce", all_reduce)
    monkeypatch.setattr(comm.dist, "reduce_scatter_single", reduce_scatter_single)
    comm.stats.reset()
    return seen


def test_nccl_fp32_mean_uses_avg_and_no_division(fake_nccl):
    t = torch.tensor([8.0, 4.0])
    comm.all_reduce(t, average=True).wait()
    assert fake_nccl == [("all_reduce", ReduceOp.AVG, [8.0, 4.0])]
    assert t.tolist() == [8.0, 4.0]  # NCCL divided; nothing is divided again


def test_nccl_fp16_mean_divides_around_a_sum(fake_nccl):
    t = torch.tensor([8.0, 4.0], dtype=torch.float16)
    comm.all_reduce(t, average=True).wait()
    assert fake_nccl[0] == ("all_reduce", ReduceOp.SUM, [4.0, 2.0])  # pre: / 2
    assert t.tolist() == [2.0, 1.0]  # post: / 2 again
    out = torch.empty(1, dtype=torch.float16)
    full = torch.tensor([8.0, 1.0, 1.0, 1.0], dtype=torch.float16)
    comm.reduce_scatter(out, full, average=True).wait()
    assert fake_nccl[1] == ("reduce_scatter", ReduceOp.SUM, [4.0, 0.5, 0.5, 0.5])
    assert out.tolist() == [2.0]


def _fp16_means(env) -> dict[str, list[float]]:
    # 40000 on each of 2 ranks: the plain sum, 80000, is inf in fp16 (max 65504).
    out = {}
    t = torch.full((3,), 40000.0, dtype=torch.float16)
    comm.all_reduce(t, average=True).wait()
    out["all_reduce"] = t.tolist()
    for path in ("native", "p2p"):
        with comm.p2p(path == "p2p"):
            full = torch.full((4,), 40000.0, dtype=torch.float16)
            shard = torch.empty(2, dtype=torch.float16)
            comm.reduce_scatter(shard, full, average=True).wait()
        out[path] = shard.tolist()
    t = torch.full((3,), 40000.0, dtype=torch.float16)
    comm.all_reduce(t).wait()  # a plain sum: what averaging without pre-division meets
    out["sum"] = t.tolist()
    return out


def test_fp16_mean_of_large_values_does_not_overflow_on_gloo():
    for out in run_distributed(_fp16_means, 2):
        assert out["all_reduce"] == [40000.0] * 3
        assert out["native"] == out["p2p"] == [40000.0] * 2
        assert out["sum"] == [float("inf")] * 3


# ---------------------------------------------------------------------------------------
# Older torch (2.6, 2.7) lacks `all_gather_single` / `reduce_scatter_single`; comm falls
# back to `all_gather_into_tensor` / `reduce_scatter_tensor`.


def _without_single_names(env) -> dict[str, object]:
    import torch.distributed as dist

    taken = {n: getattr(dist, n) for n in ("all_gather_single", "reduce_scatter_single")}
    for name in taken:
        delattr(dist, name)
    try:
        p, r = env.world_size, env.rank
        out: dict[str, object] = {"picked": [comm.native(op).__name__ for op in comm.NATIVE_NAMES]}
        with comm.p2p(False):  # the backend's own ops, the path the fallback serves
            full = torch.arange(4.0) + 10 * r  # (P x 2,)
            shard = torch.empty(2)
            comm.reduce_scatter(shard, full, average=True).wait()
            out["reduce_scatter"] = shard.tolist()
            gathered = torch.empty(2 * p)
            comm.all_gather(gathered, torch.tensor([float(r), r + 0.5])).wait()
            out["all_gather"] = gathered.tolist()
        return out
    finally:
        for name, fn in taken.items():
            setattr(dist, name, fn)


def test_older_collective_names_give_the_same_values():
    for r, out in enumerate(run_distributed(_without_single_names, 2)):
        assert out["picked"] == ["reduce_scatter_tensor", "all_gather_into_tensor"]
        assert out["reduce_scatter"] == [5.0 + 2 * r, 6.0 + 2 * r]  # mean of r=0 and r=1
        assert out["all_gather"] == [0.0, 0.5, 1.0, 1.5]


# ---------------------------------------------------------------------------------------
# Buffers freed at the wait. Gloo's worker thread lets go of a finished op (and of the
# tensors it holds) a moment after wait() returns; the engines free the buffers they
# hand a collective themselves, so none outlives its wait. Here the op's references are
# held for as long as the test likes: the buffers' storages must be empty regardless.


def _buffers_held_after_the_wait(env) -> dict[str, object]:
    from torch import nn

    from trainer import comm as package  # the names the engines call
    from trainer.parallel import build_engine
    from trainer.parallel.broadcast import broadcast_tensors

    held: dict[str, list[torch.Tensor]] = {"broadcast": [], "reduce_scatter": []}
    real = {op: getattr(package, op) for op in held}  # what the ops were handed, kept
    package.broadcast = lambda t, *a, **k: (
        held["broadcast"].append(t),
        real["broadcast"](t, *a, **k),
    )[1]
    package.reduce_scatter = lambda out, full, *a, **k: (
        held["reduce_scatter"].append(full),
        real["reduce_scatter"](out, full, *a, **k),
    )[1]
    try:
        tensors = [torch.full((3,), env.rank + 1.0), torch.full((2, 2), env.rank + 5.0)]
        broadcast_tensors(tensors)  # two tensors: one packed buffer
        out: dict[str, object] = {"values": [t.tolist() for t in tensors]}
        torch.manual_seed(env.rank)  # build_engine broadcasts rank 0's values: a pack
        model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
        engine = build_engine(model, "zero", lambda g: torch.optim.SGD(g, lr=0.1), bucket_mb=0)
        engine(torch.randn(3, 4)).sum().backward()
        out["buckets"] = len(engine.buckets)
        out["bytes"] = {op: [t.untyped_storage().nbytes() for t in ts] for op, ts in held.items()}
        return out
    finally:
        for name, fn in real.items():
            setattr(package, name, fn)


def test_collective_buffers_are_freed_at_the_wait_while_the_op_still_holds_them():
    for out in run_distributed(_buffers_held_after_the_wait, 2):
        assert out["values"] == [[1.0] * 3, [[5.0, 5.0], [5.0, 5.0]]]  # rank 0's
        # the packs of broadcast_tensors and build_engine; one ReduceScatter per bucket
        assert out["bytes"] == {"broadcast": [0, 0], "reduce_scatter": [0] * out["buckets"]}
        assert out["buckets"] > 1


# ---------------------------------------------------------------------------------------
# CUDA timing bookkeeping, with a fake CUDA: events read a simulated GPU clock that each
# collective advances by its duration, so every figure below is known exactly. This
# checks the bookkeeping (which events are recorded, kept, folded), not real GPU timing.


class _Clock:
    now_ms = 0.0
    done_ms = float("inf")  # events recorded at or before this time have completed
    synchronized = 0
    stall_ms = 0.5  # how long the compute stream stalls in each wait


class _FakeEvent:
    def __init__(self, enable_timing: bool = False):
        self.timing = enable_timing
        self.at: float | None = None

    def record(self, stream=None) -> None:
        self.at = _Clock.now_ms

    def query(self) -> bool:
        return self.at is not None and self.at <= _Clock.done_ms

    def elapsed_time(self, other: _FakeEvent) -> float:
        assert self.timing and other.timing and self.query() and other.query()
        return other.at - self.at


class _FakeStream:
    def __init__(self, device=None):
        self.device = device

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        _Clock.now_ms += _Clock.stall_ms


class _FakeCuda:
    Event = _FakeEvent
    Stream = _FakeStream
    compute = _FakeStream()

    @staticmethod
    def stream(stream):
        import contextlib

        return contextlib.nullcontext()

    @staticmethod
    def current_stream(device=None):
        return _FakeCuda.compute

    @staticmethod
    def synchronize() -> None:
        _Clock.synchronized += 1
        _Clock.done_ms = _Clock.now_ms


class _FakeWork:
    def __init__(self, duration_ms: float):
        self.duration_ms = duration_ms

    def wait(self) -> None:  # the comm stream waits for the collective: the clock runs on
        _Clock.now_ms += self.duration_ms


@pytest.fixture
def fake_cuda(monkeypatch):
    """CPU tensors taken for CUDA ones, every collective 3 ms long plus 1 ms to average."""
    _Clock.now_ms, _Clock.done_ms, _Clock.synchronized = 0.0, float("inf"), 0

    def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False):
        return _FakeWork(3.0)

    def divide(t, n):  # the finishing step, on the comm stream: 1 ms
        def post():
            _Clock.now_ms += 1.0
            t.div_(n)

        return post

    monkeypatch.setattr(comm, "_cuda", _FakeCuda)
    monkeypatch.setattr(comm, "_is_cuda", lambda t: True)
    monkeypatch.setattr(comm, "_streams", {})
    monkeypatch.setattr(comm, "pending_timings", [])
    monkeypatch.setattr(comm, "_divide", divide)

    def record_stream(self, stream):  # [Note: communication streams]: never needed
        raise AssertionError("record_stream called")

    monkeypatch.setattr(torch.Tensor, "record_stream", record_stream)
    monkeypatch.setattr(comm, "world_size", lambda group=None: 2)
    monkeypatch.setattr(comm.dist, "get_backend", lambda group=None: "gloo")
    monkeypatch.setattr(comm.dist, "all_reduce", all_reduce)
    comm.stats.reset()
    yield
    comm.stats.reset()


def _step(t: torch.Tensor, compute_ms: float = 2.0) -> None:
    h = comm.all_reduce(t, average=True)
    _Clock.now_ms += compute_ms  # compute that overlaps the collective
    h.wait()


def test_busy_spans_the_collective_and_its_finishing_step(fake_cuda):
    t = torch.full((4,), 2.0)
    for _ in range(5):
        _step(t)
    assert len(comm.pending_timings) == 10  # a busy and an exposed pair per collective
    comm.stats.settle()
    assert comm.pending_timings == []
    assert comm.stats.busy_s == pytest.approx(5 * 4.0 / 1e3)  # 3 ms + 1 ms, five times
    assert comm.stats.exposed_s == pytest.approx(5 * 0.5 / 1e3)
    assert t.tolist() == [2.0 / 2**5] * 4  # the averaging ran, once per collective


def test_busy_is_the_union_of_intervals():
    def ev(at: float) -> _FakeEvent:
        e = _FakeEvent(enable_timing=True)
        e.at = at
        return e

    spans = [(ev(0), ev(10)), (ev(5), ev(15)), (ev(20), ev(25)), (ev(21), ev(22))]
    assert comm.union_s(spans) == pytest.approx(20 / 1e3)  # [0, 15] and [20, 25]


def test_pending_timings_stay_bounded_in_a_loop_that_never_settles(fake_cuda):
    t = torch.ones(4)
    for _ in range(1000):
        _step(t)
        assert len(comm.pending_timings) <= comm.MAX_PENDING
    assert _Clock.synchronized == 0  # completed events were folded without a host sync
    comm.stats.settle()
    assert comm.stats.busy_s == pytest.approx(1000 * 4.0 / 1e3)


def test_a_gpu_far_behind_is_waited_for_only_when_the_cap_is_reached(fake_cuda):
    _Clock.done_ms = -1.0  # no event ever completes by itself
    t = torch.ones(4)
    for _ in range(1000):
        _step(t)
        assert len(comm.pending_timings) <= comm.MAX_PENDING
    # 2000 entries, one synchronize each time the list passes 1024
    assert _Clock.synchronized == 1
    comm.stats.settle()
    assert comm.stats.busy_s == pytest.approx(1000 * 4.0 / 1e3)


def test_unaccounted_collectives_leave_no_timing_and_no_bytes(fake_cuda):
    t = torch.ones(4)
    _step(t)
    pending, sent = len(comm.pending_timings), dict(comm.stats.bytes_sent)
    with comm.unaccounted():
        for _ in range(3):
            _step(t)
        h = comm.all_reduce(t)  # launched inside, waited outside: still not counted
    h.wait()
    assert len(comm.pending_timings) == pending == 2
    assert dict(comm.stats.bytes_sent) == sent
    comm.stats.settle()
    assert comm.stats.busy_s == pytest.approx(4.0 / 1e3)


def test_unaccounted_on_cpu_leaves_busy_and_exposed_alone(monkeypatch):
    monkeypatch.setattr(comm, "world_size", lambda group=None: 2)
    monkeypatch.setattr(comm.dist, "get_backend", lambda group=None: "gloo")
    monkeypatch.setattr(comm.dist, "all_reduce", lambda *a, **k: _CpuWork())
    comm.stats.reset()
    with comm.unaccounted():
        h = comm.all_reduce(torch.ones(4))
    h.wait()
    assert comm.stats.busy_s == comm.stats.exposed_s == 0.0
    assert dict(comm.stats.bytes_sent) == {}
    comm.all_reduce(torch.ones(4)).wait()
    assert comm.stats.busy_s > 0 and comm.stats.calls["all_reduce"] == 1


class _CpuWork:
    def wait(self) -> bool:
        import time

        time.sleep(0.001)
        return True


def test_a_handle_holds_its_tensors_until_the_compute_stream_waits(fake_cuda):
    # Without record_stream, memory safety rests on the Handle: the collective's tensors
    # stay referenced until wait() has ordered the compute stream after the collective.
    import gc
    import weakref

    t = torch.ones(4)
    ref = weakref.ref(t)
    h = comm.all_reduce(t, average=True)
    del t
    gc.collect()
    assert ref() is not None  # in flight: the Handle keeps it alive
    h.wait()  # the compute stream waits for the collective's end event
    gc.collect()
    assert ref() is None  # released once waited for


def test_a_chained_collective_is_launched_at_once_behind_the_first_on_cuda(fake_cuda):
    # [Note: a collective chained on another]: on CUDA the second collective and the step
    # before it are queued on the comm stream when the chain is made, not at wait()
    t, u = torch.full((4,), 2.0), torch.full((4,), 2.0)
    launched = []

    def then() -> comm.Handle:
        launched.append(len(comm.pending_timings))  # the first's busy timing is queued
        return comm.all_reduce(u, average=True)

    h = comm.chain(comm.all_reduce(t, average=True), then)
    assert launched == [1] and comm.stats.calls["all_reduce"] == 2
    h.wait()
    comm.stats.settle()
    assert t.tolist() == u.tolist() == [1.0] * 4


def test_a_chained_step_that_raises_raises_at_wait(monkeypatch):
    monkeypatch.setattr(comm, "world_size", lambda group=None: 2)
    monkeypatch.setattr(comm.dist, "get_backend", lambda group=None: "gloo")
    monkeypatch.setattr(comm.dist, "all_reduce", lambda *a, **k: _CpuWork())

    def then() -> comm.Handle:
        raise RuntimeError("peer gone")

    h = comm.chain(comm.all_reduce(torch.ones(4)), then)
    with pytest.raises(RuntimeError, match="peer gone"):
        h.wait()
