"""comm's own reduce-scatter / all-gather (point-to-point sends) equal the native ops.

Each world size runs once (a module fixture); every case runs both paths on the same
inputs, and the parent checks both against a reference summed from the regenerated
per-rank inputs, so a wrong p2p path and a wrong native op are told apart.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
from dist_harness import run_distributed

SHARDS = [1, 3, 1000, 4099]  # elements per rank; odd sizes catch chunk-offset mistakes


def _data(rank: int, p: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank `rank`'s full (P*n,) input; the parent regenerates it for the reference."""
    g = torch.Generator().manual_seed(7919 * rank + n)
    if dtype is torch.int64:
        return torch.randint(-1000, 1000, (p * n,), generator=g)
    return torch.randn(p * n, generator=g)


def _both_paths(fn) -> dict[str, object]:
    from trainer import comm

    out = {}
    for path in ("native", "p2p"):
        with comm.p2p(path == "p2p"):
            comm.stats.reset()
            out[path] = fn()
            out[path + "_bytes"] = dict(comm.stats.bytes_sent)
    return out


def _rs(full: torch.Tensor, n: int, average: bool) -> torch.Tensor:
    from trainer import comm

    out = torch.empty(n, dtype=full.dtype)
    comm.reduce_scatter(out, full.clone(), average=average).wait()
    return out


def _rs_in_place(full: torch.Tensor, p: int, r: int) -> torch.Tensor:
    from trainer import comm

    buf = full.clone()
    comm.reduce_scatter(buf.view(p, -1)[r], buf).wait()  # output is the own chunk of input
    return buf.view(p, -1)[r].clone()


def _ag(shard: torch.Tensor, p: int, r: int, in_place: bool) -> torch.Tensor:
    from trainer import comm

    out = torch.zeros(p * shard.numel(), dtype=shard.dtype)
    if in_place:  # input is this rank's slice of output
        own = out.view(p, -1)[r]
        own.copy_(shard)
        shard = own
    comm.all_gather(out, shard).wait()
    return out


def _worker(env) -> dict:
    import torch.distributed as dist

    from trainer import comm

    p, r = env.world_size, env.rank
    res: dict = {"auto_p2p": comm.p2p_enabled(None)}
    for n in SHARDS:
        for dtype in (torch.float32, torch.int64):
            full = _data(r, p, n, dtype)
            for average in (False, True) if dtype.is_floating_point else (False,):
                res["rs", n, dtype, average] = _both_paths(partial(_rs, full, n, average))
            res["rs_in_place", n, dtype] = _both_paths(partial(_rs_in_place, full, p, r))
            res["ag", n, dtype] = _both_paths(partial(_ag, full[:n], p, r, in_place=False))
            res["ag_in_place", n, dtype] = _both_paths(partial(_ag, full[:n], p, r, in_place=True))

    # Several in flight at once, a native collective launched between them, waited in
    # reverse order: every rank's sends must still meet the matching receives.
    with comm.p2p(True):
        fulls = [torch.full((p * k,), float(r + 1)) + torch.arange(p * k) for k in (5, 64, 1)]
        outs = [torch.empty(k) for k in (5, 64, 1)]
        handles = [comm.reduce_scatter(o, f) for o, f in zip(outs, fulls, strict=True)]
        summed = torch.full((3,), float(r))
        handles.append(comm.all_reduce(summed))
        gathered = torch.empty(p * 2)
        handles.append(comm.all_gather(gathered, torch.tensor([10.0 * r, 10.0 * r + 1])))
        for h in reversed(handles):
            h.wait()
    res["in_flight"] = (outs, summed, gathered)

    # A subgroup: ranks split into evens and odds, each half exchanges on its own.
    if p == 4:
        halves = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        mine = halves[r % 2]
        full = torch.arange(4.0) + 100 * r  # (2 ranks x 2,)
        res["subgroup"] = _both_paths(lambda: _subgroup_rs(comm, full, mine))
    return res


def _subgroup_rs(comm, full: torch.Tensor, group) -> torch.Tensor:
    out = torch.empty(2)
    comm.reduce_scatter(out, full, group=group).wait()
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=lambda p: f"P{p}")
def p2p_run(request):
    p = request.param
    return p, run_distributed(_worker, p)


def _expected_rs(p: int, r: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    total = sum(_data(q, p, n, dtype).to(torch.float64) for q in range(p))
    return total.view(p, -1)[r]


def _expected_ag(p: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.cat([_data(q, p, n, dtype)[:n] for q in range(p)])


def _check(got: torch.Tensor, want: torch.Tensor) -> None:
    if got.dtype is torch.int64:
        assert torch.equal(got, want.to(torch.int64))
    else:
        torch.testing.assert_close(got, want.to(got.dtype), rtol=1e-5, atol=1e-5)


def test_gloo_picks_p2p_by_default(p2p_run):
    _, results = p2p_run
    assert all(res["auto_p2p"] for res in results)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64], ids=str)
@pytest.mark.parametrize("n", SHARDS)
def test_reduce_scatter_p2p_equals_native(p2p_run, n, dtype):
    p, results = p2p_run
    for r, res in enumerate(results):
        for average in (False, True) if dtype.is_floating_point else (False,):
            case = res["rs", n, dtype, average]
            want = _expected_rs(p, r, n, dtype) / (p if average else 1)
            _check(case["native"], want)
            _check(case["p2p"], want)
            torch.testing.assert_close(case["p2p"], case["native"])
            assert case["p2p_bytes"] == case["native_bytes"]  # same accounting
        in_place = res["rs_in_place", n, dtype]
        _check(in_place["p2p"], _expected_rs(p, r, n, dtype))
        torch.testing.assert_close(in_place["p2p"], in_place["native"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64], ids=str)
@pytest.mark.parametrize("n", SHARDS)
def test_all_gather_p2p_equals_native(p2p_run, n, dtype):
    p, results = p2p_run
    want = _expected_ag(p, n, dtype)
    for res in results:
        for case in (res["ag", n, dtype], res["ag_in_place", n, dtype]):
            assert torch.equal(case["p2p"], want.to(dtype))
            assert torch.equal(case["native"], want.to(dtype))
            assert case["p2p_bytes"] == case["native_bytes"]


def test_several_in_flight_stay_matched(p2p_run):
    p, results = p2p_run
    for r, res in enumerate(results):
        outs, summed, gathered = res["in_flight"]
        for out, k in zip(outs, (5, 64, 1), strict=True):
            # sum over ranks q of (q + 1 + i) for i in rank r's chunk
            idx = torch.arange(p * k).view(p, -1)[r].float()
            assert torch.equal(out, p * idx + p * (p + 1) / 2)
        assert torch.equal(summed, torch.full((3,), p * (p - 1) / 2))
        want = torch.tensor([[10.0 * q, 10.0 * q + 1] for q in range(p)]).flatten()
        assert torch.equal(gathered, want)


def test_p2p_on_a_subgroup(p2p_run):
    p, results = p2p_run
    if p != 4:
        pytest.skip("subgroups are split out of 4 ranks")
    for r, res in enumerate(results):
        partner = r ^ 2  # 0<->2, 1<->3; group rank = r // 2
        want = (torch.arange(4.0) * 2 + 100 * (r + partner)).view(2, -1)[r // 2]
        assert torch.equal(res["subgroup"]["p2p"], want)
        assert torch.equal(res["subgroup"]["native"], want)
