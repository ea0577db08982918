"""comm/quantized.py: int8 blocks ([Note: int8 blocks]) and the collectives that send them,
at P = 2, 3, 4, against references computed from the same quantized values."""

from __future__ import annotations

import pytest
import torch
from dist_harness import run_distributed
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from trainer.comm.quantized import dequantize, n_blocks, pack, quantize, row_bytes, unpack

EPS32 = torch.finfo(torch.float32).eps
HALF_SUBNORMAL = 2.0**-150  # half the spacing of fp32 values below 2^-126


class LargestNewFloat32(TorchDispatchMode):
    """The largest fp32 storage, in elements, that a tensor op under it creates (not one of
    its inputs' storages): the tensors a collective allocates, measured as they are made,
    in the continuation thread too ([Note: a collective chained on another])."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {
            t.untyped_storage().data_ptr()
            for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, torch.Tensor)
        }
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                storage = t.untyped_storage()
                if storage.data_ptr() not in given:
                    self.largest = max(self.largest, storage.nbytes() // 4)
        return out


def _bound(x: torch.Tensor, block: int) -> torch.Tensor:
    """Per element, from `x` alone (not from `quantize`): half a step, m / 254 with m the
    largest magnitude of its block, plus fp32 rounding of the ratio x / m, of 127 times it
    and of the two products that dequantize (at most 2^-24 of a value <= m each, so
    4 * 2^-24 * m = 2 * EPS32 * m), plus half the spacing of subnormals for a result that
    lands there."""
    n = x.shape[-1]
    nb = -(-n // block)
    padded = torch.zeros(*x.shape[:-1], nb * block, dtype=torch.float64)
    padded[..., :n] = x.double()
    peak = padded.view(*x.shape[:-1], nb, block).abs().amax(-1)
    peak = peak.repeat_interleave(block, dim=-1)[..., :n]
    return peak / 254 + 2 * EPS32 * peak + HALF_SUBNORMAL


def _off(back: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return (back.double() - x.double()).abs()


@pytest.mark.parametrize("numel, block", [(1000, 256), (256, 256), (7, 256), (513, 64)])
def test_error_within_half_a_step(numel, block):
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * 3
    q, scale = quantize(x, block)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32
    assert q.numel() == n_blocks(numel, block) * block and scale.numel() == n_blocks(numel, block)
    back = dequantize(q, scale, numel)
    assert _off(back, x).le(_bound(x, block)).all()
    # the block's largest value is exact up to fp32 rounding: q = +-127
    assert q.abs().max() == 127


@pytest.mark.parametrize(
    "magnitude", [3e38, 1.0, 1e-30, 4e-36, 1e-37, 1e-39, 1e-42, 2.0**-149], ids=str
)
def test_every_magnitude_within_half_a_step(magnitude):
    """Blocks whose step m / 127 is subnormal (m below ~1.5e-36) or whose values are
    subnormal themselves: each value within half a step of what was sent, also through
    the packed bytes. The largest fp32 and the smallest subnormal included."""
    g = torch.Generator().manual_seed(3)
    x = (torch.rand(3, 256, generator=g, dtype=torch.float64) * 2 - 1) * magnitude
    x[:, 0] = magnitude  # every block reaches the magnitude: its step is m / 127
    x[1, 1:] = x[1, 1:].sign() * magnitude  # a block of +-m only
    x = x.float()
    assert x.abs().amax().item() == pytest.approx(magnitude, rel=1e-6)
    q, scale = quantize(x, 256)
    back = dequantize(q, scale, 256)
    assert torch.isfinite(back).all()
    assert _off(back, x).le(_bound(x, 256)).all(), _off(back, x).max() / (magnitude / 127)
    values, _ = unpack(pack(x, 256), 256, 256)
    assert torch.equal(values, back)


def test_all_zero_block_is_zero_and_finite():
    x = torch.zeros(600)
    x[300:310] = torch.linspace(-1, 1, 10)  # block 1 not zero, blocks 0 and 2 all zero
    q, scale = quantize(x, 256)
    assert scale[0] == 0 and scale[2] == 0
    back = dequantize(q, scale, 600)
    assert torch.isfinite(back).all()
    assert back[:256].eq(0).all() and back[512:].eq(0).all()


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_a_non_finite_value_makes_its_block_non_finite(bad):
    x = torch.randn(600, generator=torch.Generator().manual_seed(1))
    x[260] = bad
    back = dequantize(*quantize(x, 256), 600)
    assert not torch.isfinite(back[256:512]).any()  # the whole block: the check sees it
    assert torch.isfinite(back[:256]).all() and torch.isfinite(back[512:]).all()
    assert _off(back[:256], x[:256]).le(_bound(x[:256], 256)).all()


def test_pack_round_trip_with_exact_tail():
    x = torch.randn(3, 300, generator=torch.Generator().manual_seed(2))
    tail = torch.tensor([[0.0, 1.0], [1.0, 1.0], [0.0, 0.0]])
    rows = pack(x, 256, tail)
    assert rows.dtype == torch.uint8 and rows.shape == (3, row_bytes(300, 256, 2))
    assert row_bytes(300, 256, 2) == 512 + 8 + 8
    values, exact = unpack(rows, 300, 256, 2)
    q, scale = quantize(x, 256)
    assert torch.equal(values, dequantize(q, scale, 300))
    assert torch.equal(exact, tail)


def _collectives(env, block: int) -> dict:
    """Each quantized collective on this rank's seeded data, with the bytes it handed over."""
    from trainer import comm

    r, p = comm.rank(), comm.world_size()
    g = torch.Generator().manual_seed(100 + r)
    out: dict = {}
    # A shard of 301 values: not a multiple of the block
    shard = torch.randn(301, generator=g)
    shard_before = shard.clone()
    full = torch.empty(301 * p)
    comm.stats.reset()
    comm.all_gather_int8(full, shard, block=block, tag="t").wait()
    out["gather"] = (shard, full, dict(comm.stats.bytes_sent))
    assert torch.equal(shard, shard_before)  # the shard itself is never quantized
    # ReduceScatter input (P, 200 + 2): 200 gradients and 2 exact flag columns per row
    grads = torch.randn(p, 202, generator=g)
    grads[:, 200:] = torch.tensor([float(r % 2), 1.0])
    grads[1, :block] = 0  # an all-zero block on its way to rank 1, from every rank
    reduced = torch.empty(202)
    comm.stats.reset()
    comm.reduce_scatter_int8(
        reduced, grads.clone().view(-1), average=True, block=block, exact_tail=2
    ).wait()
    out["reduce_scatter"] = (grads, reduced, dict(comm.stats.bytes_sent))
    # AllReduce of 1001 values (not divisible by P) plus a 3-value exact tail
    t = torch.randn(1004, generator=g)
    t[1001:] = torch.tensor([1.0, float(r), 0.0])
    before = t.clone()
    comm.stats.reset()
    with LargestNewFloat32() as allocated:
        comm.all_reduce_int8(t, average=True, block=block, exact_tail=3).wait()
    out["all_reduce"] = (before, t, dict(comm.stats.bytes_sent), allocated.largest)
    # fp16 overflow: an inf on one rank reaches every rank as a non-finite gradient
    h = torch.randn(p, 64, generator=g)
    if r == p - 1:
        h[0, 5] = float("inf")
    res = torch.empty(64)
    comm.reduce_scatter_int8(res, h.view(-1), average=True, block=block).wait()
    out["inf"] = bool(torch.isfinite(res).all())
    # a simulated link of 0.05 Gb/s and 2 ms: each collective lasts at least its bytes / link
    import time

    comm.simulated_link(0.05, 0.002)
    full = torch.empty_like(full)  # the gather above is returned: keep it as it was
    try:
        took = {}
        for name, call in (
            ("all_gather", lambda: comm.all_gather(full, shard)),
            ("all_gather_int8", lambda: comm.all_gather_int8(full, shard, block=block)),
            ("barrier", lambda: comm.barrier()),  # sends nothing: no link time
        ):
            comm.stats.reset()
            t = time.perf_counter()
            call().wait()
            took[name] = (time.perf_counter() - t, sum(comm.stats.bytes_sent.values()))
        # two in flight together share the one link: the second ends after both
        comm.stats.reset()
        t = time.perf_counter()
        first, second = comm.all_gather(full, shard), comm.all_gather(full.clone(), shard)
        first.wait()
        second.wait()
        took["two"] = (time.perf_counter() - t, sum(comm.stats.bytes_sent.values()))
    finally:
        comm.simulated_link(None)
    out["link"] = took
    return out


@pytest.fixture(scope="module", params=[2, 3, 4])
def runs(request):
    p = request.param
    return p, run_distributed(_collectives, p, 64)


def _deq(x: torch.Tensor, block: int = 64) -> torch.Tensor:
    """What a receiver reconstructs of `x`'s rows (R, n)."""
    q, scale = quantize(x, block)
    return dequantize(q, scale, x.shape[-1])


def test_all_gather_int8_every_rank_the_same_dequantized_values(runs):
    p, res = runs
    shards = [r["gather"][0] for r in res]
    expected = torch.cat([_deq(s.view(1, -1))[0] for s in shards])
    for r in range(p):
        assert torch.equal(res[r]["gather"][1], expected)  # the owner's piece included
    exact = torch.cat(shards)
    assert (expected - exact).abs().le(torch.cat([_bound(s, 64) for s in shards])).all()
    # bytes handed to the collective: (P-1) x one packed row, scales included
    assert res[0]["gather"][2] == {"all_gather": (p - 1) * row_bytes(301, 64)}
    assert row_bytes(301, 64) == 320 + 4 * 5


def test_reduce_scatter_int8_sums_in_fp32_in_source_order(runs):
    p, res = runs
    for owner in range(p):
        parts = [
            _deq(res[src]["reduce_scatter"][0][owner : owner + 1, :200])[0] for src in range(p)
        ]
        total = parts[0].clone()
        for x in parts[1:]:
            total.add_(x)
        got = res[owner]["reduce_scatter"][1]
        assert torch.equal(got[:200], total / p)
        flags = torch.tensor([sum(float(s % 2) for s in range(p)), float(p)]) / p
        assert torch.equal(got[200:], flags)  # the exact tail arrives exactly
    sent = (p - 1) / p * p * row_bytes(200, 64, 2)
    assert res[0]["reduce_scatter"][2] == {"all_to_all": sent}
    # against fp32: the error of one quantization per value, averaged
    exact = torch.stack([r["reduce_scatter"][0] for r in res]).mean(0)  # (P, 202)
    for owner in range(p):
        bound = sum(_bound(res[s]["reduce_scatter"][0][owner, :200], 64) for s in range(p)) / p
        err = (res[owner]["reduce_scatter"][1][:200] - exact[owner, :200]).abs()
        assert err.le(bound + 4 * p * EPS32 * exact[owner, :200].abs().max()).all()


def test_reduce_scatter_int8_all_zero_block(runs):
    """Every rank sends an all-zero block to rank 1 (at any P): it arrives as exact zeros,
    next to a block that is not zero and comes back within its bound."""
    p, res = runs
    got = res[1]["reduce_scatter"][1]
    assert got[:64].eq(0).all() and not got[:64].signbit().any()
    rows = torch.stack([r["reduce_scatter"][0][1, :200] for r in res])  # (P, 200) sent
    assert rows[:, :64].eq(0).all() and rows[:, 64:128].ne(0).all()
    bound = sum(_bound(rows[s], 64) for s in range(p)) / p
    mean = rows.mean(0)  # fp32 sums: a few ulps of the largest value, as above
    slack = 4 * p * EPS32 * mean[64:].abs().max()
    assert _off(got[64:200], mean[64:]).le(bound[64:] + slack).all()


def test_all_reduce_int8_identical_everywhere_and_within_two_quantizations(runs):
    p, res = runs
    results = [r["all_reduce"][1] for r in res]
    for t in results[1:]:
        assert torch.equal(t, results[0])
    inputs = torch.stack([r["all_reduce"][0] for r in res])
    mean = inputs.mean(0)
    assert torch.equal(results[0][1001:], torch.tensor([1.0, sum(range(p)) / p, 0.0]))
    # reference from the same quantized values: chunks of ceil(1001 / P), summed in order
    chunk = -(-1001 // p)
    padded = torch.zeros(p, p * chunk)
    padded[:, :1001] = inputs[:, :1001]
    owned = []
    for owner in range(p):
        parts = [
            _deq(padded[s, owner * chunk : (owner + 1) * chunk].view(1, -1))[0] for s in range(p)
        ]
        total = parts[0].clone()
        for x in parts[1:]:
            total.add_(x)
        owned.append(_deq((total / p).view(1, -1))[0])
    assert torch.equal(results[0][:1001], torch.cat(owned)[:1001])
    # two quantizations: each input once (averaged), the sum once more
    in_bound = sum(_bound(inputs[s, :1001], 64) for s in range(p)) / p
    out_bound = _bound(mean[:1001], 64) * 2  # the sum's block maxima, widened by the first error
    assert (results[0][:1001] - mean[:1001]).abs().le(in_bound + out_bound).all()
    a2a = (p - 1) / p * p * row_bytes(chunk, 64, 3)
    assert res[0]["all_reduce"][2] == {
        "all_to_all": a2a,
        "all_gather": (p - 1) * row_bytes(chunk, 64),
    }


def test_all_reduce_int8_allocates_no_fp32_copy_of_the_tensor(runs):
    """[Note: int8 AllReduce in two chained phases]: the largest fp32 tensor it makes is
    one chunk (this rank's sum and exact tail, or one chunk padded to whole blocks), not
    the tensor's 1004 values."""
    p, res = runs
    chunk = -(-1001 // p)
    for r in res:
        assert 0 < r["all_reduce"][3] < chunk + 64  # block = 64
        assert r["all_reduce"][3] < 1001  # no full copy, at any P


def test_inf_on_one_rank_reaches_its_owner(runs):
    p, res = runs
    assert res[0]["inf"] is False  # rank p-1's inf went to rank 0's slice
    assert all(r["inf"] for r in res[1:])


def test_simulated_link_holds_each_collective_for_its_bytes(runs):
    p, res = runs
    for r in res:
        for name in ("all_gather", "all_gather_int8"):
            seconds, sent = r["link"][name]
            assert sent > 0 and seconds >= sent * 8 / 0.05e9 + 0.002, (name, seconds, sent)
        # fp32 vs packed int8: the link time follows the bytes actually handed over
        assert r["link"]["all_gather_int8"][1] < 0.3 * r["link"]["all_gather"][1]
        assert r["link"]["barrier"][1] == 0
        seconds, sent = r["link"]["two"]
        assert seconds >= sent * 8 / 0.05e9 + 2 * 0.002, (seconds, sent)
