"""mode=ddp: parity with one process and with torch DDP, accumulation, overlap."""

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

STEPS, BATCH = 4, 24


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("optim", ["adamw", "sgd"])
def test_parity_with_single_process_and_torch_ddp(world, optim):
    want = train_single("buffer", optim, STEPS, BATCH)
    # bucket_mb small enough that the model spans several buckets
    got = run_distributed(
        train_engine, world, "ddp", "buffer", optim, STEPS, BATCH, bucket_mb=0.0004
    )
    ref = run_distributed(train_torch_ddp, world, "buffer", optim, STEPS, BATCH)
    for r in range(world):
        assert_state_close(got[r], want)
        assert_state_close(got[r], ref[r])


@pytest.mark.parametrize("world", [2, 4])
def test_no_sync_accumulation_equals_big_batch(world):
    want = train_single("mlp", "adamw", STEPS, BATCH)
    got = run_distributed(train_engine, world, "ddp", "mlp", "adamw", STEPS, BATCH, accum=3)
    ref = run_distributed(train_torch_ddp, world, "mlp", "adamw", STEPS, BATCH, accum=3)
    assert_state_close(got[0], want)
    assert_state_close(got[1], ref[1])


def test_batchnorm_buffers_follow_torch_ddp():
    got = run_distributed(train_engine, 2, "ddp", "bn", "sgd", STEPS, BATCH)
    ref = run_distributed(train_torch_ddp, 2, "bn", "sgd", STEPS, BATCH)
    for r in range(2):
        assert_state_close(got[r], ref[r])


def test_unused_parameter_does_not_hang():
    got = run_distributed(train_engine, 2, "ddp", "unused", "sgd", STEPS, BATCH)
    init = make_model("unused", seed=0).state_dict()
    # it never had a gradient, so it stays at rank 0's initial value on every rank
    for r in range(2):
        assert torch.equal(got[r]["fc_unused.weight"], init["fc_unused.weight"])
    assert_state_close(got[0], got[1])


def _unused_vs_torch_ddp(env, precision: str) -> tuple[dict, dict, torch.Tensor]:
    """AdamW with weight decay: fc_unused is used by no rank, fc_rank0 by rank 0 only."""
    import functools

    from reference import IN, OUT, any_loss, batches, rank_slice
    from torch import nn

    from trainer.parallel import build_engine

    def model():
        m = make_model("unused", seed=0)
        m.fc_rank0 = nn.Linear(IN, OUT)
        plain = m.forward
        m.forward = lambda x: plain(x) + m.fc_rank0(x) if env.rank == 0 else plain(x)
        return m

    # eps=1e-3: the default 1e-8 would turn the rounding noise of near-zero gradients into
    # lr-sized steps that differ between our sum order and torch DDP's
    adamw = functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1, eps=1e-3)
    start = model().fc_rank0.weight.detach().clone()
    ours = build_engine(model(), "ddp", adamw, precision=precision, bucket_mb=0.0004)
    torch_ddp = nn.parallel.DistributedDataParallel(model(), find_unused_parameters=True)
    opt = adamw(torch_ddp.parameters())
    for x, y in batches("unused", STEPS, BATCH):
        x, y = rank_slice(x, env.rank, 2), rank_slice(y, env.rank, 2)
        ours.backward(any_loss(ours(x), y))
        ours.step()
        any_loss(torch_ddp(x), y).backward()
        opt.step()
        opt.zero_grad()
    return ours.full_state_dict(), torch_ddp.module.state_dict(), start


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_unused_parameters_are_skipped_as_torch_ddp_does(precision):
    init = make_model("unused", seed=0).state_dict()
    for ours, ref, start in run_distributed(_unused_vs_torch_ddp, 2, precision):
        # no gradient anywhere: AdamW neither decays it nor moves it, in both
        assert torch.equal(ours["fc_unused.weight"], init["fc_unused.weight"])
        assert torch.equal(ref["fc_unused.weight"], init["fc_unused.weight"])
        if precision == "fp32":  # bf16 computes otherwise; the unused weight is the point
            assert_state_close(ours, ref)
        # used on rank 0 alone: trained on every rank
        assert (ours["fc_rank0.weight"] - start).abs().max() > 1e-3


def _overlap_trace(env):
    from torch import nn

    from trainer import comm
    from trainer.parallel import build_engine

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)])
    engine = build_engine(
        model,
        "ddp",
        optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
        bucket_mb=64 * 65 * 4 / 2**20,
    )  # one layer per bucket
    first = model[0].weight  # the last gradient backward produces
    first.register_post_accumulate_grad_hook(lambda p: comm.record("grad_ready", "layer0"))
    with comm.tracing() as events:
        engine.backward(model(torch.randn(8, 64)).square().mean())
    return len(engine.buckets), events


def test_first_bucket_allreduce_launches_before_backward_ends():
    nbuckets, events = run_distributed(_overlap_trace, 2)[0]
    assert nbuckets == 6
    launches = [i for i, e in enumerate(events) if e == ("launch:all_reduce", "bucket0")]
    last_grad = events.index(("grad_ready", "layer0"))
    assert launches and launches[0] < last_grad, events
