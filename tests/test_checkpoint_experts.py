"""Checkpoints of expert-parallel runs ([Note: expert groups in a checkpoint] in
parallel/state.py): stop and resume at the same E is bitwise equal to the uninterrupted
run in every mode; a resume at another E or world size re-cuts the experts by ranges; the
full model read from an EP checkpoint is the stacked layout; and under torchrun a killed
rank's group restarts from its checkpoint and ends bitwise equal."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from dist_harness import run_distributed
from test_checkpoint import _cfg, _torchrun
from test_checkpoint import _train as train_saving

pytestmark = pytest.mark.slow  # starting ranks is most of it

STEPS, STOP = 6, 4  # as test_checkpoint: saves at 2, 4, 6; the resumed run goes 4 -> 6
MODES = ("ddp", "zero", "fsdp")
# Small buckets and units: several expert groups with padded shards in zero and fsdp.
OPTIONS = {"ddp": {"bucket_mb": 0.0005}, "zero": {"bucket_mb": 0.0005}, "fsdp": {}}
SIZES = dict(
    vocab_size=17, block_size=8, n_layer=2, n_head=2, n_embd=12, n_experts=4, top_k=2,
    moe_every=1, aux_loss_coef=0.0,
)  # fmt: skip
# No aux loss: the load-balancing loss is a function of each rank's own tokens, so another
# world size trains another loss; what is tested here is where the state goes.


def _build(env, mode: str, seed: int, e: int):
    from trainer.data.datasets import make_loader, synthetic_tokens
    from trainer.models.builtin import GPTMoE
    from trainer.parallel import build_engine

    torch.manual_seed(seed)
    # eps 1e-3: see reference.OPTIMIZERS (zero-gradient parameters and rounding noise)
    adamw = functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.01, eps=1e-3)
    engine = build_engine(GPTMoE(**SIZES), mode, adamw, expert_parallel=e, **OPTIONS[mode])
    dataset = synthetic_tokens(n=40, block_size=8, vocab_size=17)
    return engine, make_loader(dataset, 8, env.rank, env.world_size, seed=0)


def _with_aux_loss(engine, x, y) -> None:
    from trainer.run.loop import forward_backward

    forward_backward(engine, x, y, 1)  # the MoE aux loss added as the loop adds it


def _train(env, engine, loader, cfg, stop: int = STEPS):
    return train_saving(env, engine, loader, cfg, stop, backward=_with_aux_loss)


def _stop_and_resume(env, mode: str, root: Path, other_e: int):
    """At E=2: the uninterrupted run, a run stopped at STOP and its resume into a new
    engine from other initial values; then a resume of the stopped run's checkpoint at
    E=`other_e` (another E, same world size)."""
    _, want = _train(env, *_build(env, mode, 0, 2), _cfg(root / "whole"))
    _train(env, *_build(env, mode, 0, 2), _cfg(root / "ckpt"), stop=STOP)
    start, got = _train(env, *_build(env, mode, 1, 2), _cfg(root / "ckpt", resume="auto"))
    path = str(root / "ckpt" / "step_000004")
    _, other = _train(env, *_build(env, mode, 2, other_e), _cfg(root / "other", resume=path))
    return start, want, got, other


def _resume_at(env, mode: str, e: int, path: Path, root: Path):
    return _train(env, *_build(env, mode, 3, e), _cfg(root, resume=str(path)))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Per mode, on 2 ranks: (resumed step, uninterrupted final state, stopped-and-resumed
    final state, resumed at E=1, directory with the checkpoints)."""
    cache = {}

    def get(mode: str):
        if mode not in cache:
            root = tmp_path_factory.mktemp(mode)
            rank0, rank1 = run_distributed(_stop_and_resume, 2, mode, root, 1)
            assert rank0[0] == rank1[0]
            cache[mode] = (*rank0, root)
        return cache[mode]

    return get


# Another E (or world size, or mode) sums in another order: each expert's matmul covers
# other rows, the gradient AllReduce/ReduceScatter adds in another order. fp32 rounding
# after 2 more AdamW steps stays far inside 1e-4, and far below what one misplaced expert
# row or lost optimizer moment produces (steps of lr = 1e-2).
TOL = {"rtol": 1e-4, "atol": 1e-4}


@pytest.mark.parametrize("mode", MODES)
def test_stop_and_resume_at_the_same_e_is_bitwise_equal(saved, mode):
    start, want, got, other, root = saved(mode)
    assert start == STOP
    assert want.keys() == got.keys()
    assert want["blocks.0.moe.experts.w_in"].shape[0] == SIZES["n_experts"]  # stacked
    for k in want:
        assert torch.equal(got[k], want[k]), k
    names = sorted(p.name for p in (root / "ckpt" / "step_000006").iterdir())
    assert names == ["COMPLETE", "meta.pt", "rank0.bin", "rank0.pt", "rank1.bin", "rank1.pt"]
    # Resumed at E=1 on the same ranks: every expert re-cut from both EP positions' files.
    for k in want:
        torch.testing.assert_close(other[k], want[k], **TOL, msg=k)


@pytest.mark.parametrize(
    "src, dst, e, world",
    [("zero", "fsdp", 4, 4), ("fsdp", "ddp", 1, 1), ("ddp", "zero", 2, 4)],
)
def test_resume_at_another_e_or_world_size_recuts_the_experts(saved, tmp_path, src, dst, e, world):
    _, want, _, _, root = saved(src)
    results = run_distributed(_resume_at, world, dst, e, root / "ckpt" / "step_000004", tmp_path)
    for start, got in results[:1]:
        assert start == STOP
        for k in want:
            torch.testing.assert_close(got[k], want[k], **TOL, msg=k)


@pytest.mark.parametrize("mode", MODES)
def test_full_model_of_an_ep_checkpoint_is_the_stacked_layout(saved, mode):
    from trainer.checkpoint.recutting import consolidate

    _, _, got, _, root = saved(mode)
    full = consolidate(root / "ckpt" / "step_000006")
    assert full.keys() == got.keys()
    for k in got:
        assert torch.equal(full[k], got[k]), k


# ---------------------------------------------------------------------------------------
# Under torchrun: model=gpt_moe with mode.expert_parallel=2, a rank killed after step 5

CLI_ARGS = [
    "model=gpt_moe",
    "data=tokens",
    "mode.expert_parallel=2",
    "model.n_experts=4",
    "model.n_layer=2",
    "train.steps=8",
    "train.log_every=4",
    "train.batch_size=8",
    "ckpt.every=2",
]


@pytest.mark.parametrize("mode", ["zero", "fsdp"])
def test_killed_rank_restarts_and_ends_equal(tmp_path, mode):
    args = [*CLI_ARGS, f"mode={mode}"]
    whole = _torchrun([*args, f"hydra.run.dir={tmp_path / 'whole'}"], {})
    assert whole.returncode == 0, whole.stderr[-3000:]
    want = torch.load(tmp_path / "whole" / "final_model.pt", weights_only=True)
    run_dir, marker = tmp_path / "run", tmp_path / "fired"
    faults = {"SHARDTRAIN_FAULT": "1:5:kill", "SHARDTRAIN_FAULT_ONCE": str(marker)}
    proc = _torchrun([*args, f"hydra.run.dir={run_dir}"], faults, restarts=1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert marker.exists(), "the fault never fired"
    assert f"resumed from {run_dir / 'checkpoints' / 'step_000004'} at step 4" in proc.stdout
    got = torch.load(run_dir / "final_model.pt", weights_only=True)
    assert got.keys() == want.keys()
    assert got["blocks.0.moe.experts.w_in"].shape[0] == 4  # every expert, stacked
    for k in got:
        assert torch.equal(got[k], want[k]), k
    # consolidate.py (as export_hf.py reads it) gives final_model.pt's stacked layout
    from trainer.checkpoint.recutting import consolidate

    full = consolidate(run_dir / "checkpoints" / "step_000008")
    assert full.keys() == got.keys()
    for k in got:
        assert torch.equal(full[k], got[k]), k
