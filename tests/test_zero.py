"""mode=zero: parity with one process and torch DDP, no_sync, sharded memory, errors."""

import functools

import pytest
import torch
from dist_harness import run_distributed
from reference import (
    assert_state_close,
    make_model,
    train_engine,
    train_single,
    train_torch_ddp,
)
from torch import nn

STEPS, BATCH = 3, 24


def _engine_and_torch_ddp(env, kind, optim, steps, batch, accum=1, **options):
    """Both distributed runs in one process group: a process start-up less per case."""
    got = train_engine(env, "zero", kind, optim, steps, batch, accum, **options)
    return got, train_torch_ddp(env, kind, optim, steps, batch, accum)


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("optim", ["adamw", "sgd"])
def test_parity_with_single_process_and_torch_ddp(world, optim):
    # "buffer": odd parameter shapes (no count divisible by 2 or 4, so every bucket is
    # padded) and a buffer. bucket_mb small enough that the model spans several buckets.
    want = train_single("buffer", optim, STEPS, BATCH)
    out = run_distributed(
        _engine_and_torch_ddp, world, "buffer", optim, STEPS, BATCH, bucket_mb=0.0004
    )
    for got, ref in out:
        assert_state_close(got, want)
        assert_state_close(got, ref)


@pytest.mark.parametrize("world", [2, 4])
def test_no_sync_accumulation_equals_big_batch(world):
    want = train_single("mlp", "adamw", STEPS, BATCH, accum=3)
    out = run_distributed(
        _engine_and_torch_ddp, world, "mlp", "adamw", STEPS, BATCH, 3, bucket_mb=0.0004
    )
    for got, ref in out:
        assert_state_close(got, want)
        assert_state_close(got, ref)


# ---------------------------------------------------------------------------------------
# Memory, measured from live tensors.

LAYERS, WIDTH = 12, 33
LAYER = WIDTH * WIDTH + WIDTH  # 1122 elements: one bucket, not divisible by 4


def _elements(tensors) -> int:
    """Elements of the storages behind `tensors`, each storage counted once and whole."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage() for t in tensors}
    return sum(s.nbytes() for s in storages.values()) // 4  # all fp32 here


def _memory_probe(env):
    import gc

    from trainer import comm
    from trainer.parallel import build_engine
    from trainer.parallel.engine import optimizer_state_tensors

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    engine = build_engine(
        model,
        "zero",
        optimizer=functools.partial(torch.optim.AdamW, lr=1e-3, eps=1e-3),  # as every test
        bucket_mb=LAYER * 4 / 2**20,  # one layer per bucket
    )
    params = list(model.parameters())

    def grad_elements() -> int:
        live = engine.state_tensors()
        return _elements(
            live["grads"]
            + live["comm"]
            + [p.grad for p in params if p.grad is not None]
            + [b.grad_shard for b in engine.buckets if b.grad_shard is not None]
        )

    peak = 0

    def probe(_):
        nonlocal peak
        peak = max(peak, grad_elements())

    for p in params:  # registered after the engine's hooks, so they run after them
        p.register_post_accumulate_grad_hook(probe)
    params[0].register_post_accumulate_grad_hook(lambda p: comm.record("grad_ready", "layer0"))

    x = torch.randn(8, WIDTH)
    with comm.tracing() as trace:
        out = engine(x)
        loss = out.square().mean()
        engine.backward(loss)
        after = grad_elements()
        grads_none = all(p.grad is None for p in params)
        # Every other fp32 storage alive in this process must be gradient state.
        known = {t.untyped_storage().data_ptr() for t in [x, out, loss]}
        known |= {b.full.untyped_storage().data_ptr() for b in engine.buckets}
        gc.collect()
        swept = _elements(
            o
            for o in gc.get_objects()
            if issubclass(type(o), torch.Tensor)
            and o.dtype == torch.float32
            and o.untyped_storage().data_ptr() not in known
        )
        engine.step()
    flats = {b.full.untyped_storage().data_ptr() for b in engine.buckets}
    return {
        "psi": sum(p.numel() for p in params),
        "shards": sum(b.master.numel() for b in engine.buckets),
        "buckets": len(engine.buckets),
        "bucket": max(b.full.numel() for b in engine.buckets),
        "optimizer": _elements(optimizer_state_tensors(engine.optimizer)),
        "optimizer_2d": sum(
            t.numel() for t in optimizer_state_tensors(engine.optimizer) if t.dim()
        ),
        "params": _elements(engine.state_tensors()["params"]),
        "params_in_flats": all(p.untyped_storage().data_ptr() in flats for p in params)
        and all(b.master.untyped_storage().data_ptr() in flats for b in engine.buckets),
        "grads_after": after,
        "grads_swept": swept,
        "grads_peak": peak,
        "grads_none": grads_none,
        "trace": trace,
    }


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_memory_from_live_tensors(world):
    from trainer.parallel.zero import BUCKETS_IN_FLIGHT

    m = run_distributed(_memory_probe, world)[0]
    psi, shards, bucket = m["psi"], m["shards"], m["bucket"]
    assert m["buckets"] == LAYERS and bucket == -(-LAYER // world) * world
    # Each bucket's shard is its padded size / P: Ψ/P plus less than one element per bucket.
    assert psi / world <= shards < psi / world + m["buckets"]
    # Parameters stay full, once: the model's params and the shards are views of the flats.
    assert m["params_in_flats"] and m["params"] == shards * world
    # AdamW keeps exp_avg and exp_avg_sq per shard: 2 x Ψ/P, plus a scalar step per
    # parameter piece (a bucket holds one layer: its weight and bias, at most two pieces).
    assert m["optimizer_2d"] == 2 * shards
    assert m["optimizer"] <= 2 * shards + 2 * m["buckets"]
    # After backward: no autograd .grad left, only the averaged shards.
    assert m["grads_none"]
    assert psi / world <= m["grads_after"] <= psi / world + bucket
    assert m["grads_swept"] <= psi / world + bucket, m
    # During backward at most BUCKETS_IN_FLIGHT + 1 full buckets (and their shard outputs)
    # are alive: well under the full gradient that plain ZeRO-2 bookkeeping would keep.
    bound = shards + (BUCKETS_IN_FLIGHT + 1) * bucket + BUCKETS_IN_FLIGHT * bucket // world
    assert m["grads_peak"] <= bound < psi
    # Overlap: bucket 0 (the last layer) is on the wire before layer 0 has its gradient;
    # after the step every bucket is AllGathered.
    events = m["trace"]
    first = events.index(("launch:reduce_scatter", "bucket0"))
    assert first < events.index(("grad_ready", "layer0")), events
    gathers = [t for e, t in events if e == "launch:all_gather"]
    assert gathers == [f"bucket{i}" for i in range(LAYERS)]


# ---------------------------------------------------------------------------------------
# Unused parameters and misuse.


class _Reentrant(nn.Module):
    """`mid` applied in two nested reentrant checkpoints: its gradient accumulates in two
    backwards nested in the outer one."""

    def __init__(self):
        super().__init__()
        self.inp, self.mid = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        h = self.inp(x)
        return checkpoint(self.mid, checkpoint(self.mid, h, use_reentrant=True), use_reentrant=True)


def _unused_and_reentrant(env):
    from trainer.parallel import build_engine

    state = train_engine(env, "zero", "unused", "sgd", STEPS, BATCH, bucket_mb=0.0004)
    results = {}
    for mode in ("ddp", "zero", "fsdp"):
        torch.manual_seed(0)
        options = {"min_unit_params": 10, "unit_classes": []} if mode == "fsdp" else {}
        sgd = functools.partial(torch.optim.SGD, lr=0.1)
        engine = build_engine(_Reentrant(), mode, sgd, **options)
        torch.manual_seed(1 + env.rank)
        try:
            engine(torch.randn(2, 4)).sum().backward()
            engine.step()
            results[mode] = engine.full_state_dict()
        except RuntimeError as e:
            results[mode] = str(e)
    return state, results


def _reentrant_reference(world: int) -> dict:
    """One process: the mean over ranks of each rank's gradient, one SGD step."""
    torch.manual_seed(0)
    model = _Reentrant()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for r in range(world):
        torch.manual_seed(1 + r)
        (model(torch.randn(2, 4)).sum() / world).backward()
    opt.step()
    return model.state_dict()


def test_unused_parameter_does_not_hang_and_reentrant_checkpointing():
    out = run_distributed(_unused_and_reentrant, 2)
    init = make_model("unused", seed=0).state_dict()
    want = _reentrant_reference(2)
    for state, results in out:
        # no gradient: it stays at rank 0's initial value on every rank
        assert torch.equal(state["fc_unused.weight"], init["fc_unused.weight"])
        assert_state_close(state, out[0][0])
        # ddp and zero reduce what each nested backward produced: the sum is right
        for mode in ("ddp", "zero"):
            assert_state_close(results[mode], want)
        # fsdp would leave the second gradient behind: refused, the parameter named
        assert "'mid." in results["fsdp"] and "its gradient twice" in results["fsdp"]
        assert "use_reentrant=False" in results["fsdp"]
