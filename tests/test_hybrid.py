"""Hybrid sharding (`mode.shard_group_size`): at 4 ranks with S = 2, zero and fsdp shard
within {0, 1} and {2, 3} and replicate across them. They must train like ddp and like
torch's own HSDP (FSDP2 over a 2-D DeviceMesh), keep AllGathers and ReduceScatters inside
the shard groups, send 1/S of the gradient across groups, hold 1/S of the state, and
write checkpoints that resume under another S, mode or world size."""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
from dist_harness import run_distributed
from reference import OPTIMIZERS, any_loss, batches, make_model, rank_slice

P, S, STEPS, BATCH, ACCUM, CLIP = 4, 2, 3, 16, 2, 0.05
SHARDED = ("zero", "fsdp")
GROUPS = [(0, 1), (2, 3)]
# Small buckets and units: several buffers per mode, each padded to a multiple of S.
OPTIONS = {"ddp": {"bucket_mb": 0.002}, "zero": {"bucket_mb": 0.002}, "fsdp": {}}


def _slice(env, t: torch.Tensor) -> torch.Tensor:
    return rank_slice(t, env.rank, env.world_size)


def _loop(env, forward, backward, no_sync, clip, step, accum: int = ACCUM) -> None:
    """Each step: `accum` micro-batches of this rank's slice, the first ones without
    gradient sync; clipping to CLIP (far below the gradients' norm: it always scales)."""
    for x, y in batches("gpt", STEPS, BATCH):
        micro = list(zip(_slice(env, x).chunk(accum), _slice(env, y).chunk(accum), strict=True))
        for i, (xs, ys) in enumerate(micro):
            with no_sync(i < accum - 1):
                backward(any_loss(forward(xs), ys) / accum)
        clip()
        step()


def _engine(mode: str, seed: int, **options):
    from trainer.parallel import build_engine

    return build_engine(
        make_model("gpt", seed=seed), mode, OPTIMIZERS["adamw"], **OPTIONS[mode], **options
    )


def _ours(env, mode: str, precision: str = "fp32", **options) -> dict:
    engine = _engine(mode, env.rank, precision=precision, **options)
    norms = []
    _loop(
        env,
        engine,
        engine.backward,
        lambda off: engine.no_sync() if off else nullcontext(),
        lambda: norms.append(engine.clip_grad_norm_(CLIP).item()),
        engine.step,
    )
    return {"state": engine.full_state_dict(), "norms": norms}


def _fsdp2_hsdp(env, precision: str = "fp32") -> dict:
    """torch's HSDP: fully_shard over a (replicate, shard) DeviceMesh, the same recipe."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (P // S, S), mesh_dim_names=("replicate", "shard"))
    model = make_model("gpt", seed=0)  # FSDP2 does not broadcast: every rank alike
    mp = {}
    if precision == "bf16":
        mp = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=MixedPrecisionPolicy(**mp))
    root = MixedPrecisionPolicy(**mp, output_dtype=torch.float32 if mp else None)
    fully_shard(model, mesh=mesh, mp_policy=root)
    opt = OPTIMIZERS["adamw"](model.parameters())
    norms = []

    def no_sync(off: bool):
        model.set_requires_gradient_sync(not off)
        return nullcontext()

    def step():
        opt.step()
        opt.zero_grad()

    clip = torch.nn.utils.clip_grad_norm_
    _loop(
        env,
        model,
        lambda loss: loss.backward(),
        no_sync,
        lambda: norms.append(clip(model.parameters(), CLIP).full_tensor().item()),
        step,
    )
    state = {k: v.full_tensor().detach().clone() for k, v in model.state_dict().items()}
    return {"state": state, "norms": norms}


def _one_step_figures(env, mode: str) -> dict:
    """What one step sends, between which ranks, and what a rank holds after it."""
    from trainer import comm
    from trainer.observe import memory

    engine = _engine(mode, env.rank, shard_group_size=S)
    psi = memory.count_params(make_model("gpt", seed=0))
    (x, y), *_ = batches("gpt", 1, BATCH)
    held = {}  # as the trainer measures: when params, grads and optimizer state all exist
    engine.optimizer.register_step_post_hook(lambda *_: held.update(memory.measure(engine)))
    comm.stats.reset()
    with comm.membership() as members:
        engine.backward(any_loss(engine(_slice(env, x)), _slice(env, y)))
        engine.step()
    k = memory.optimizer_bytes_per_param(engine.optimizer)
    flats = [b for b in getattr(engine, "buckets", [])] or [
        f for u in engine.units for f in u.flat_buffers
    ]
    return {
        "members": sorted(set(members)),
        "across": comm.stats.bytes_across,
        "sent": dict(comm.stats.bytes_sent),
        # what the replicas exchange: each buffer's slice and its control columns
        "slice_elems": sum(f.layout.padded_numel // S + f.n_flags for f in flats),
        "held": held,
        "expected": memory.expected(mode, psi, P, 4, 4, k, shard_group_size=S),
        "expected_across": memory.expected_traffic_across(mode, psi, 4, P, S),
    }


def _checkpoint_round_trip(env, root: Path) -> dict:
    """zero with S = 2 saves after 2 steps; fsdp over all ranks, zero with S = 1 and fsdp
    with S = 2 resume it, and each goes one step further, as the saver does."""
    from omegaconf import OmegaConf

    from trainer import checkpoint

    def cfg(resume=None):
        ckpt = {"every": 2, "dir": str(root), "keep": 1}
        return OmegaConf.create({"ckpt": ckpt, "resume": resume, "train": {"steps": 3}})

    def train(engine, steps):
        for x, y in steps:
            engine.backward(any_loss(engine(_slice(env, x)), _slice(env, y)))
            engine.step()

    data = batches("gpt", 3, BATCH)
    saver = _engine("zero", env.rank, shard_group_size=S)
    train(saver, data[:2])
    path = checkpoint.save(root, 2, saver, keep=1)
    saved = saver.full_state_dict()
    train(saver, data[2:])
    out = {"saved": saved, "continued": saver.full_state_dict(), "resumed": {}, "root": root}
    for mode, s in [("fsdp", None), ("zero", 1), ("fsdp", S)]:
        engine = _engine(mode, 7, shard_group_size=s)
        assert checkpoint.load(path, engine) == 2
        loaded = engine.full_state_dict()
        train(engine, data[2:])
        out["resumed"][f"{mode}/{s}"] = (loaded, engine.full_state_dict())
    return out


def _unused(env, mode: str, **options) -> dict:
    """A parameter no rank uses: torch leaves its .grad None, so AdamW neither decays nor
    moves it ([Note: used flags]); the flags now travel through the AllReduce too."""
    from trainer.parallel import build_engine

    engine = build_engine(make_model("unused", seed=env.rank), mode, OPTIMIZERS["adamw"], **options)
    for x, y in batches("unused", 2, BATCH):
        engine.backward(any_loss(engine(_slice(env, x)), _slice(env, y)))
        engine.step()
    return engine.full_state_dict()


def _groups_and_checkpointing(env, mode: str, **options) -> dict:
    """No weight decay on biases and norms (two param groups, so fsdp units get two flat
    buffers) and activation checkpointing (units rerun in backward): a few steps."""
    from reference import SEQ, VOCAB

    from trainer.models.builtin import GPT
    from trainer.parallel import build_engine
    from trainer.run.optim import no_decay_bias_norm

    torch.manual_seed(env.rank)
    model = GPT(VOCAB, SEQ, n_layer=3, n_head=3, n_embd=15, activation_checkpointing=True)
    engine = build_engine(
        model, mode, OPTIMIZERS["adamw"], param_options=no_decay_bias_norm, **options
    )
    for x, y in batches("gpt", 2, BATCH):
        engine.backward(any_loss(engine(_slice(env, x)), _slice(env, y)))
        engine.step()
    return engine.full_state_dict()


def _all(env, root: Path) -> dict:
    out = {"ddp": _ours(env, "ddp"), "hsdp": _fsdp2_hsdp(env)}
    out["hsdp_bf16"] = _fsdp2_hsdp(env, "bf16")
    for mode in SHARDED:
        out[mode] = _ours(env, mode, shard_group_size=S)
        out[f"{mode}_bf16"] = _ours(env, mode, "bf16", shard_group_size=S)
        out[f"{mode}_figures"] = _one_step_figures(env, mode)
    out["zero_s1"] = _ours(env, "zero", shard_group_size=1)
    out["unused"] = {m: _unused(env, m, shard_group_size=S) for m in SHARDED}
    out["unused"]["ddp"] = _unused(env, "ddp")
    out["groups"] = {m: _groups_and_checkpointing(env, m, shard_group_size=S) for m in SHARDED}
    out["groups"]["ddp"] = _groups_and_checkpointing(env, "ddp")
    out["checkpoint"] = _checkpoint_round_trip(env, root)
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_distributed(_all, P, tmp_path_factory.mktemp("hybrid"), timeout=400)


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.mark.parametrize("mode", SHARDED)
def test_trains_like_ddp_and_torch_hsdp(ranks, mode):
    for r in ranks:
        got = r[mode]
        # accumulation, clipping (the norm counts each slice once) and AdamW: the same
        # arithmetic in another summation order
        assert _max_diff(got["state"], r["ddp"]["state"]) < 1e-5
        assert _max_diff(got["state"], r["hsdp"]["state"]) < 1e-5
        torch.testing.assert_close(got["norms"], r["hsdp"]["norms"], rtol=1e-5, atol=0)
        torch.testing.assert_close(got["norms"], r["ddp"]["norms"], rtol=1e-5, atol=0)
        assert _max_diff(got["state"], ranks[0][mode]["state"]) == 0  # replicas agree
    # and training moved the weights: the comparison is not between untouched models
    assert _max_diff(ranks[0][mode]["state"], _untrained()) > 1e-3


def _untrained() -> dict:
    return {k: v.detach() for k, v in make_model("gpt", seed=0).state_dict().items()}


@pytest.mark.parametrize("mode", SHARDED)
def test_bf16_matches_torch_hsdp(ranks, mode):
    for r in ranks:
        got, want = r[f"{mode}_bf16"]["state"], r["hsdp_bf16"]["state"]
        assert _max_diff(got, want) < 1e-6
        # and it is the bf16 run: fp32 differs by bf16 rounding
        assert _max_diff(got, r[mode]["state"]) > 1e-5


def test_shard_group_of_one_is_ddp(ranks):
    for r in ranks:
        assert _max_diff(r["zero_s1"]["state"], r["ddp"]["state"]) < 1e-6


@pytest.mark.parametrize("mode", SHARDED)
def test_gathers_and_scatters_stay_inside_shard_groups(ranks, mode):
    for rank, r in enumerate(ranks):
        fig = r[f"{mode}_figures"]
        mine = GROUPS[rank // S]
        replicas = tuple(range(rank % S, P, S))
        ops = {}
        for op, members in fig["members"]:
            ops.setdefault(op, set()).add(members)
        assert ops["all_gather"] == {mine}
        assert ops["reduce_scatter"] == {mine}
        assert replicas in ops["all_reduce"]  # the gradient slices, across groups
        assert ops["all_reduce"] <= {replicas, tuple(range(P))}  # and control messages


@pytest.mark.parametrize("mode", SHARDED)
def test_bytes_across_groups_are_one_slice(ranks, mode):
    fig = ranks[0][f"{mode}_figures"]
    r = P // S
    # To the byte: every buffer's fp32 slice (and control columns), AllReduced over R.
    assert fig["across"] == 2 * (r - 1) / r * fig["slice_elems"] * 4
    # The formula, 2(R-1)/R · Ψr/S, counts no padding or control columns: a few elements.
    assert fig["expected_across"] <= fig["across"] < fig["expected_across"] * 1.02
    # What crosses is 1/S of a full gradient AllReduce (ddp's traffic).
    psi = sum(v.numel() for v in make_model("gpt", seed=0).parameters())
    assert fig["expected_across"] == pytest.approx(2 * (r - 1) / r * psi * 4 / S)


@pytest.mark.parametrize("mode", SHARDED)
def test_each_rank_holds_its_formula(ranks, mode):
    for r in ranks:
        fig = r[f"{mode}_figures"]
        for kind in ("params", "grads", "optimizer"):
            want = fig["expected"][kind]
            # padding: each buffer rounds up to a multiple of S elements
            assert want <= fig["held"][kind] < want * 1.03 + 1024, kind


def test_parameters_no_rank_used_stay_untouched(ranks):
    init = make_model("unused", seed=0).fc_unused.weight.detach()
    for r in ranks:
        for mode in SHARDED:
            got = r["unused"][mode]
            assert torch.equal(got["fc_unused.weight"], init), mode  # not decayed
            assert _max_diff(got, r["unused"]["ddp"]) < 1e-6, mode


def test_weight_decay_groups_and_activation_checkpointing(ranks):
    for r in ranks:
        for mode in SHARDED:
            assert _max_diff(r["groups"][mode], r["groups"]["ddp"]) < 1e-5, mode


def _resume_at_two(env, path: Path) -> dict:
    from trainer import checkpoint

    engine = _engine("fsdp", 3)
    checkpoint.load(path, engine)
    return engine.full_state_dict()


def test_checkpoint_resumes_at_another_world_size(ranks):
    [path] = [p for p in ranks[0]["checkpoint"]["root"].glob("step_*")]
    for got in run_distributed(_resume_at_two, 2, path):
        assert _max_diff(got, ranks[0]["checkpoint"]["saved"]) == 0


def test_checkpoint_resumes_under_another_group_size_or_mode(ranks):
    for r in ranks:
        ck = r["checkpoint"]
        for name, (loaded, after) in ck["resumed"].items():
            assert _max_diff(loaded, ck["saved"]) == 0, name  # pure data movement
            # optimizer state came along: one more step lands where the saver's did
            assert _max_diff(after, ck["continued"]) < 1e-5, name
