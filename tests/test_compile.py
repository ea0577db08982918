"""train.compile=true: each layer's forward compiled (trainer/models/compile.py) trains as the
eager model does in every mode, at 2 ranks, with SGD, without a graph break; the
training loop applies it from the config.

The compiled runs use torch.compile's default backend, inductor (it needs a C++
compiler, which this machine has); all modes of one world size run in one process
group, eager and compiled side by side, so each rank compiles the GPT block once.
"""

from __future__ import annotations

import json

import pytest
import torch
from dist_harness import run_distributed
from reference import OPTIMIZERS, assert_state_close, batches, make_model, rank_slice
from test_cli import run_cli

from trainer.errors import ConfigError
from trainer.models.builtin import GPT, MLP
from trainer.models.compile import compile_layers, layers

MODES = ("ddp", "zero", "fsdp")
STEPS, BATCH = 3, 8


def _train(env, mode: str, compiled: bool) -> tuple[dict, list[float]]:
    from trainer.parallel import build_engine
    from trainer.run.loop import forward_backward

    model = make_model("gpt", seed=env.rank)  # rank 0's initial values win in every mode
    if compiled:
        assert compile_layers(model) == ["blocks.0", "blocks.1", "blocks.2"]
    engine = build_engine(model, mode, OPTIMIZERS["sgd"])
    losses = []
    for x, y in batches("gpt", STEPS, BATCH):
        xr, yr = rank_slice(x, env.rank, env.world_size), rank_slice(y, env.rank, env.world_size)
        loss, _ = forward_backward(engine, xr, yr, 1)
        engine.step()
        losses.append(loss.item())
    return engine.full_state_dict(), losses


def _every_mode(env) -> dict:
    import torch._dynamo.utils as dynamo_utils

    out = {}
    for mode in MODES:
        eager = _train(env, mode, compiled=False)
        dynamo_utils.counters.clear()
        compiled = _train(env, mode, compiled=True)
        out[mode] = {
            "eager": eager,
            "compiled": compiled,
            "graph_breaks": sum(dynamo_utils.counters["graph_break"].values()),
            "frames": dynamo_utils.counters["stats"]["unique_graphs"],
        }
    return out


@pytest.fixture(scope="module")
def two_ranks():
    return run_distributed(_every_mode, 2, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_compiled_layers_train_as_eager(two_ranks, mode):
    for rank in two_ranks:
        r = rank[mode]
        (want, want_losses), (got, got_losses) = r["eager"], r["compiled"]
        # Compiled kernels fuse and reorder fp32 sums: relative differences of ~1e-7 per
        # op, which 3 SGD steps carry into parameters far below assert_state_close's
        # atol 1e-5 / rtol 1e-4, and into losses far below the same bound.
        assert_state_close(got, want)
        torch.testing.assert_close(got_losses, want_losses, atol=1e-5, rtol=1e-4)
        # the engine's hooks stay outside the compiled forward: nothing breaks the graph,
        # and the three blocks share the graph compiled first (or reuse an earlier mode's)
        assert r["graph_breaks"] == 0
        assert r["frames"] <= 1


def test_layers_are_fsdp_units_by_class_and_repetition():
    assert [n for n, _ in layers(GPT(n_layer=3))] == ["blocks.0", "blocks.1", "blocks.2"]
    assert [n for n, _ in layers(MLP(depth=2))] == ["layers.0", "layers.1"]
    assert [n for n, _ in layers(GPT(), unit_classes=["FeedForward"])] == [
        "blocks.0.mlp",
        "blocks.1.mlp",
    ]
    model = GPT()
    keys = list(model.state_dict())
    compile_layers(model, backend="aot_eager")
    assert list(model.state_dict()) == keys  # no `_orig_mod.`: checkpoints as eager
    with pytest.raises(ConfigError, match="no repeated layers"):
        compile_layers(torch.nn.Linear(2, 2))
    with pytest.raises(ConfigError, match="train.compile_backend='nope'"):
        compile_layers(GPT(), backend="nope")


@pytest.mark.slow
def test_cli_compile_true_trains_and_a_wrong_type_is_refused(tmp_path):
    args = ["model=gpt", "data=tokens", "train.steps=4", "train.log_every=2", "train.batch_size=8"]
    args += ["train.eval_every=0", f"run.root={tmp_path}", "train.compile=true"]
    proc = run_cli(args, nproc=None)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    final = json.loads((run_dir / "final_metrics.json").read_text())
    assert final["step"] == 4 and final["train/loss"] > 0
    state = torch.load(run_dir / "final_model.pt", weights_only=True)
    assert "blocks.0.attn.c_attn.weight" in state

    bad = run_cli([*args[:-1], "train.compile=maybe"], nproc=None)
    assert bad.returncode != 0 and "train.compile" in bad.stderr
