"""Delays injected before every collective must not change results (missing
synchronisation shows up as different numbers), and overlap is measured."""

from __future__ import annotations

import pytest
import torch
from dist_harness import run_distributed
from reference import train_engine

STEPS, BATCH = 3, 24


def _train_with_delay(env, delay_s: float, mode: str, kind: str, **options):
    from trainer import comm

    comm.stats.reset()
    with comm.delayed(delay_s):
        state = train_engine(env, mode, kind, "adamw", STEPS, BATCH, bucket_mb=0.0004, **options)
    return state, comm.stats.exposed_s, comm.stats.busy_s


# ddp int8: the AllGathers come from the continuation thread, delayed there too
@pytest.mark.parametrize(
    "mode, options",
    [("ddp", {}), ("zero", {}), ("fsdp", {}), ("ddp", {"reduce_dtype": "int8"})],
    ids=["ddp", "zero", "fsdp", "ddp-int8"],
)
def test_delay_before_each_collective_gives_the_same_parameters(mode, options):
    plain = run_distributed(_train_with_delay, 2, 0.0, mode, "mlp", **options)
    delayed = run_distributed(_train_with_delay, 2, 0.01, mode, "mlp", **options)
    for (a, _, _), (b, _, busy) in zip(plain, delayed, strict=True):
        assert busy > 0
        for k in a:
            assert torch.equal(a[k], b[k]), k


def _int8_gather_launched_during_backward(env) -> tuple[int, int, int]:
    """ddp int8 with several buckets: a probe at the model's input, whose backward runs
    after every bucket but the last has been launched, waits (up to a bound) for bucket
    0's AllGather to be launched. Returns the trace positions of that launch, of the
    probe's end and of the end of backward."""
    import time

    from reference import IN, make_model

    from trainer import comm
    from trainer.parallel import build_engine

    trace_now: list = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            # The all-to-all of bucket 0 was launched near the start of backward; its
            # AllGather is launched once that arrived. The bound only makes the old
            # behaviour (the AllGather at wait(), after backward) fail instead of hang.
            deadline = time.monotonic() + 30
            while ("launch:all_gather", "bucket0") not in trace_now:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.001)
            comm.record("probe")
            return grad

    model = make_model("mlp", seed=env.rank)
    engine = build_engine(
        model,
        mode="ddp",
        optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
        reduce_dtype="int8",
        bucket_mb=0.0004,
    )
    assert len(engine.buckets) > 2
    x = torch.randn(8, IN, generator=torch.Generator().manual_seed(env.rank)).requires_grad_()
    with comm.tracing() as trace:
        trace_now = trace
        engine(Probe.apply(x)).square().mean().backward()
        comm.record("backward done")
    return (
        trace.index(("launch:all_gather", "bucket0")),
        trace.index(("probe", "")),
        trace.index(("backward done", "")),
    )


def test_ddp_int8_launches_its_allgather_during_backward():
    """[Note: int8 AllReduce in two chained phases]: the second phase of a bucket's int8
    AllReduce is launched while backward still runs, not when the bucket is waited for."""
    for gather, probe, done in run_distributed(_int8_gather_launched_during_backward, 2):
        assert gather < probe < done
