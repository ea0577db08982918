"""Delays injected before every collective must not change results (missing
synchronisation shows up as different numbers), and overlap is measured."""

from __future__ import annotations

import pytest
import torch
from dist_harness import run_distributed
from reference import train_engine

STEPS, BATCH = 3, 24


def _train_with_delay(env, delay_s: float, mode: str, kind: str):
    from trainer import comm

    comm.stats.reset()
    with comm.delayed(delay_s):
        state = train_engine(env, mode, kind, "adamw", STEPS, BATCH, bucket_mb=0.0004)
    return state, comm.stats.exposed_s, comm.stats.busy_s


@pytest.mark.parametrize("mode", ["ddp", "zero", "fsdp"])
def test_delay_before_each_collective_gives_the_same_parameters(mode):
    plain = run_distributed(_train_with_delay, 2, 0.0, mode, "mlp")
    delayed = run_distributed(_train_with_delay, 2, 0.01, mode, "mlp")
    for (a, _, _), (b, _, busy) in zip(plain, delayed, strict=True):
        assert busy > 0
        for k in a:
            assert torch.equal(a[k], b[k]), k
