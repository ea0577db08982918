"""comm.py's averaging plans and its CUDA timing bookkeeping, checked on CPU."""

from __future__ import annotations

import pytest
import torch
from dist_harness import run_distributed
from torch.distributed import ReduceOp

from trainer import comm
from trainer.comm import AveragePlan, average_plan

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
    monkeypatch.setattr(comm, "use_p2p", False)
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
        comm.use_p2p = path == "p2p"
        full = torch.full((4,), 40000.0, dtype=torch.float16)
        shard = torch.empty(2, dtype=torch.float16)
        comm.reduce_scatter(shard, full, average=True).wait()
        out[path] = shard.tolist()
    comm.use_p2p = None
    t = torch.full((3,), 40000.0, dtype=torch.float16)
    comm.all_reduce(t).wait()  # a plain sum: what averaging without pre-division meets
    out["sum"] = t.tolist()
    return out


def test_fp16_mean_of_large_values_does_not_overflow_on_gloo():
    for out in run_distributed(_fp16_means, 2):
        assert out["all_reduce"] == [40000.0] * 3
        assert out["native"] == out["p2p"] == [40000.0] * 2
        assert out["sum"] == [float("inf")] * 3
