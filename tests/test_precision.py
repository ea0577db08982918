"""Mixed precision in every mode: bf16 against a bf16 single-process reference and torch
FSDP2's mixed-precision policy, loss still falling, low-precision AllGathers, and fp16
loss scaling that skips a step with an injected inf on one rank: decided on the device
(bitwise as torch.amp.GradScaler with the same fused optimizer), and by the host for an
optimizer that cannot skip by itself.

All distributed cases run in one 2-rank process group (the `ranks` fixture).
"""

from __future__ import annotations

import copy
import functools
import io
import math

import pytest
import torch
from dist_harness import run_distributed
from reference import OPTIMIZERS, any_loss, batches, local_checkpoint_data, make_model, rank_slice
from torch import nn

from trainer.errors import ConfigError
from trainer.parallel.precision import Precision
from trainer.parallel.scaling import LossScaler

MODES = ("ddp", "zero", "fsdp")
STEPS, BATCH = 4, 12
# Several buckets / units per mode, so that every flat buffer path is exercised.
OPTIONS = {"ddp": {"bucket_mb": 0.002}, "zero": {"bucket_mb": 0.002}, "fsdp": {}}


def _engine(mode: str, model: nn.Module, optim: str = "sgd", **extra):
    from trainer.parallel import build_engine

    return build_engine(model, mode, OPTIMIZERS[optim], **{**OPTIONS[mode], **extra})


def _slice(env, t: torch.Tensor) -> torch.Tensor:
    return rank_slice(t, env.rank, env.world_size)


# ---------------------------------------------------------------------------------------
# What each rank runs


def _bf16(env, mode: str) -> dict:
    """STEPS of SGD in bf16; what forward computes in, and what each step sends."""
    from trainer import comm

    engine = _engine(mode, make_model("gpt", seed=env.rank), precision="bf16")
    seen = set()
    engine.module.blocks[0].attn.register_forward_pre_hook(
        lambda m, args: seen.add((args[0].dtype, next(m.parameters()).dtype))
    )
    sent = []
    for x, y in batches("gpt", STEPS, BATCH):
        comm.stats.reset()
        engine.backward(any_loss(engine(_slice(env, x)), _slice(env, y)))
        assert engine.step()
        sent.append(dict(comm.stats.bytes_sent))
    return {"state": engine.full_state_dict(), "seen": seen, "sent": sent[-1]}


def _bf16_accumulated(env, mode: str) -> dict:
    """As _bf16, each rank's slice run as 2 micro-batches under no_sync."""
    from trainer.run.loop import forward_backward

    engine = _engine(mode, make_model("gpt", seed=env.rank), precision="bf16")
    for x, y in batches("gpt", STEPS, BATCH):
        forward_backward(engine, _slice(env, x), _slice(env, y), 2)
        assert engine.step()
    return engine.full_state_dict()


def _fp32_traffic(env, mode: str) -> dict:
    from trainer import comm

    engine = _engine(mode, make_model("gpt", seed=env.rank))
    (x, y), *_ = batches("gpt", 1, BATCH)
    comm.stats.reset()
    engine.backward(any_loss(engine(_slice(env, x)), _slice(env, y)))
    engine.step()
    return dict(comm.stats.bytes_sent)


def _losses(env, mode: str, precision: str) -> list[float]:
    """AdamW on one fixed batch: the loss must keep falling in low precision too."""
    engine = _engine(mode, make_model("gpt", seed=env.rank), "adamw", precision=precision)
    (x, y), *_ = batches("gpt", 1, BATCH)
    losses = []
    for _ in range(12):
        loss = any_loss(engine(_slice(env, x)), _slice(env, y))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _poison(engine, env, inject: dict) -> None:
    """An inf in one gradient element on rank 1 alone while `inject["now"]`: in zero and
    fsdp it lands in one rank's shard only."""
    target = engine.module.blocks[0].mlp.c_fc.weight  # a Linear weight inside a unit

    def poison(grad: torch.Tensor) -> torch.Tensor:
        if inject["now"] and env.rank == 1:
            grad = grad.clone()
            grad.view(-1)[0] = math.inf
        return grad

    target.register_hook(poison)


def _fp16_injected_inf(env, mode: str) -> dict:
    """Three fp16 steps; in the second, rank 1 alone gets an inf in one gradient. SGD with
    foreach=True cannot skip a step by itself: the host decides, reading the flag."""
    engine = build_engine_with(
        mode,
        make_model("gpt", seed=env.rank),
        functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9, foreach=True),
        precision="fp16",
        loss_scale={"init_scale": 1024.0},
    )
    inject = {"now": False}
    _poison(engine, env, inject)
    stepped, scales, local_bad, states = [], [], [], [engine.full_state_dict()]
    norms = []
    for i, (x, y) in enumerate(batches("gpt", 3, BATCH)):
        inject["now"] = i == 1
        engine.backward(any_loss(engine(_slice(env, x)), _slice(env, y)))
        grads, _ = engine.grad_tensors()
        local_bad.append(any(not torch.isfinite(g).all() for g in grads))
        norms.append(engine.clip_grad_norm_(1e9).item())  # unscales first: the true norm
        stepped.append(engine.step())
        scales.append(engine.scaler.scale.item())
        states.append(engine.full_state_dict())
    fp32 = _engine(mode, make_model("gpt", seed=env.rank))
    (x, y), *_ = batches("gpt", 1, BATCH)
    fp32.backward(any_loss(fp32(_slice(env, x)), _slice(env, y)))
    return {
        "skips_on_device": engine.skips_on_device,
        "stepped": stepped,
        "scales": scales,
        "local_bad": local_bad,
        "states": states,
        "norms": norms,
        "fp32_norm": fp32.clip_grad_norm_(1e9).item(),
    }


def build_engine_with(mode: str, model: nn.Module, optimizer, **extra):
    from trainer.parallel import build_engine

    return build_engine(model, mode, optimizer, **{**OPTIONS[mode], **extra})


def _spans(env, group) -> list[tuple[int, int, bool]]:
    """Every rank's pieces of a shard group as (start, end) in the whole flat buffer, and
    whether this rank holds it: what the optimizers of all ranks together step."""
    from trainer.parallel.pieces import cut

    if not group.sharded:  # ddp: one piece, every parameter whole on every rank
        return [(0, group.layout.numel, True)]
    s = group.layout.padded_numel // env.world_size
    rows = torch.empty(env.world_size, s)
    return [
        (r * s + p.start, r * s + p.end, r == env.rank)
        for r in range(env.world_size)
        for p in cut(group.names, range(len(group.names)), group.layout, rows[r], r)
    ]


def _whole(env, group, local: torch.Tensor) -> torch.Tensor:
    """The whole flat buffer of a group from each rank's (S,) slice of it."""
    from trainer import comm

    if not group.sharded:
        return local.reshape(-1).clone()
    out = local.new_empty(group.layout.padded_numel)
    comm.all_gather(out, local.reshape(-1).contiguous(), tag="test").wait()
    return out


def _fp16_against_grad_scaler(env, mode: str, optim: str) -> dict:
    """Four fp16 steps of `optim`, built fused by build_engine, with an inf in rank 1's
    gradient at the second. Beside it, on this process alone, torch.amp.GradScaler steps
    the same fused optimizer over every rank's pieces, fed the same loss-scaled gradients
    (gathered): per-tensor kernels on identical inputs, so it must agree bitwise."""
    engine = build_engine_with(
        mode,
        make_model("gpt", seed=env.rank),
        OPTIMIZERS[optim],
        precision="fp16",
        loss_scale={"init_scale": 1024.0, "growth_interval": 2},
    )
    inject = {"now": False}
    _poison(engine, env, inject)
    groups = engine.shard_groups()
    spans = [_spans(env, g) for g in groups]
    values = [_whole(env, g, g.local.detach()) for g in groups]
    ref = [
        nn.Parameter(v[a:b].clone()) for v, sp in zip(values, spans, strict=True) for a, b, _ in sp
    ]
    held = [h for sp in spans for _, _, h in sp]  # this rank's, in the order of `ref`
    ref_opt = OPTIMIZERS[optim](ref, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=2)
    scaler.scale(torch.ones(()))  # makes its scale tensor; the gradients come from ours

    def snapshot(tensors, opt) -> list:  # flat: ddp's pieces are shaped, the reference's not
        return [
            (
                t.detach().reshape(-1).clone(),
                {k: v.reshape(-1).clone() for k, v in opt.state[t].items()},
            )
            for t in tensors
        ]

    steps, local_bad = [], []
    for i, (x, y) in enumerate(batches("gpt", 4, BATCH)):
        inject["now"] = i == 1
        engine.backward(any_loss(engine(_slice(env, x)), _slice(env, y)))
        grads = [_whole(env, g, _local_grad(g)) for g in groups]
        local_bad.append(
            any(not torch.isfinite(p.tensor.grad).all() for g in groups for p in g.pieces)
        )
        k = 0
        for grad, sp in zip(grads, spans, strict=True):
            for a, b, _ in sp:
                ref[k].grad = grad[a:b].clone()
                k += 1
        stepped = engine.step()
        scaler.step(ref_opt)
        scaler.update()
        ours = [p.tensor for g in groups for p in g.pieces]
        theirs = [t for t, h in zip(ref, held, strict=True) if h]
        steps.append(
            {
                "stepped": bool(stepped),
                "scale": engine.scaler.scale.item(),
                "ref_scale": scaler.get_scale(),
                "mine": snapshot(ours, engine.optimizer),
                "ref": snapshot(theirs, ref_opt),
                # what forward computes with (zero: AllGathered after the step), and the
                # fp32 masters it comes from
                "module": {k: v.detach().clone() for k, v in engine.module.named_parameters()},
                "full": engine.full_state_dict(),
            }
        )
    return {"skips_on_device": engine.skips_on_device, "steps": steps, "local_bad": local_bad}


def _fp16_sgd_first_step_skipped(env, mode: str) -> dict:
    """fp16 SGD with momentum whose first step overflows (rank 1's inf), then two good
    steps. torch's fused SGD, handed that first skip, would keep uninitialised momentum
    buffers; ours must behave as if the step never happened: next to it, the same fused
    SGD over every rank's pieces, stepped only on the good steps with the same gradients
    unscaled the same way."""
    engine = build_engine_with(
        mode,
        make_model("gpt", seed=env.rank),
        OPTIMIZERS["sgd"],
        precision="fp16",
        loss_scale={"init_scale": 1024.0},
    )
    inject = {"now": False}
    _poison(engine, env, inject)
    groups = engine.shard_groups()
    spans = [_spans(env, g) for g in groups]
    values = [_whole(env, g, g.local.detach()) for g in groups]
    ref = [
        nn.Parameter(v[a:b].clone()) for v, sp in zip(values, spans, strict=True) for a, b, _ in sp
    ]
    held = [h for sp in spans for _, _, h in sp]
    ref_opt = OPTIMIZERS["sgd"](ref, fused=True)
    steps = []
    for i, (x, y) in enumerate(batches("gpt", 3, BATCH)):
        inject["now"] = i == 0
        engine.backward(any_loss(engine(_slice(env, x)), _slice(env, y)))
        grads = [_whole(env, g, _local_grad(g)) for g in groups]
        inv = engine.scaler.scale.double().reciprocal().float()
        found = torch.zeros(1)
        k = 0
        for grad, sp in zip(grads, spans, strict=True):
            for a, b, _ in sp:
                ref[k].grad = grad[a:b].clone()
                k += 1
        torch._amp_foreach_non_finite_check_and_unscale_([t.grad for t in ref], found, inv)
        stepped = engine.step()
        if found.item() == 0:
            ref_opt.step()
        ours = [p.tensor for g in groups for p in g.pieces]
        theirs = [t for t, h in zip(ref, held, strict=True) if h]
        steps.append(
            {
                "stepped": bool(stepped),
                "values": [t.detach().reshape(-1).clone() for t in ours],
                "ref_values": [t.detach().reshape(-1).clone() for t in theirs],
                "momentum": [
                    engine.optimizer.state[t]["momentum_buffer"].reshape(-1).clone() for t in ours
                ],
                "ref_momentum": [
                    ref_opt.state[t]["momentum_buffer"].clone() if ref_opt.state.get(t) else None
                    for t in theirs
                ],
            }
        )
    return {"steps": steps}


def _local_grad(group) -> torch.Tensor:
    """This rank's loss-scaled gradient of a shard group, laid out like `group.local`."""
    flat = torch.zeros(group.local.numel())
    for p in group.pieces:
        flat[p.start : p.end] = p.tensor.grad.reshape(-1)
    return flat


def _fsdp2_bf16(env, accum: int = 1) -> dict:
    """torch's fully_shard with param bf16, reduce fp32, fp32 output: the same recipe;
    with `accum` micro-batches per step, all but the last without gradient sync."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = make_model("gpt", seed=0)  # every rank the same: FSDP2 does not broadcast
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mp_policy=policy)
    # fp32 logits from the root only: blocks hand bf16 activations on
    root = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32
    )
    fully_shard(model, mp_policy=root)
    opt = OPTIMIZERS["sgd"](model.parameters())
    for x, y in batches("gpt", STEPS, BATCH):
        pieces = list(zip(_slice(env, x).chunk(accum), _slice(env, y).chunk(accum), strict=True))
        for i, (xs, ys) in enumerate(pieces):
            model.set_requires_gradient_sync(i == accum - 1)
            (any_loss(model(xs), ys) / accum).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.full_tensor().detach().clone() for k, v in model.state_dict().items()}


def _frozen(env, mode: str) -> dict:
    """bf16 with fc1 frozen: its saved values must be the fp32 ones, not bf16-rounded."""
    model = make_model("mlp", seed=0)
    model.fc1.requires_grad_(False)
    want = model.fc1.weight.detach().clone()
    engine = _engine(mode, model, precision="bf16")
    (x, y), *_ = batches("mlp", 1, BATCH)
    engine.backward(any_loss(engine(_slice(env, x)), _slice(env, y)))
    engine.step()
    data, _ = local_checkpoint_data(engine)  # rank 0 writes the replicated entries
    saved = {k.removeprefix("replicated/"): v for k, v in data.items() if "replicated/" in k}
    return {"want": want, "full": engine.full_state_dict(), "saved": saved}


def _all(env) -> dict:
    out = {}
    for mode in MODES:
        out[mode] = {
            "bf16": _bf16(env, mode),
            "bf16_accumulated": _bf16_accumulated(env, mode),
            "fp32_sent": _fp32_traffic(env, mode),
            "losses": {p: _losses(env, mode, p) for p in ("bf16", "fp16")},
            "fp16": _fp16_injected_inf(env, mode),
            "grad_scaler": {o: _fp16_against_grad_scaler(env, mode, o) for o in ("adamw", "sgd")},
            "sgd_first_skipped": _fp16_sgd_first_step_skipped(env, mode),
            "frozen": _frozen(env, mode),
        }
    out["fsdp2"] = _fsdp2_bf16(env)
    out["fsdp2_accumulated"] = _fsdp2_bf16(env, accum=2)
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_distributed(_all, 2, timeout=400)


# ---------------------------------------------------------------------------------------
# References on one process


def train_single_mixed(dtype: torch.dtype) -> dict:
    """The recipe by hand: fp32 master model, a `dtype` copy that computes, gradients
    taken into fp32, SGD on the masters, masters cast back into the copy."""
    master = make_model("gpt", seed=0)
    model = copy.deepcopy(master).to(dtype)
    opt = OPTIMIZERS["sgd"](master.parameters())
    for x, y in batches("gpt", STEPS, BATCH):
        any_loss(model(x).float(), y).backward()
        for m, p in zip(master.parameters(), model.parameters(), strict=True):
            m.grad = p.grad.float()
        opt.step()
        opt.zero_grad()
        model.zero_grad(set_to_none=True)
        with torch.no_grad():
            for m, p in zip(master.parameters(), model.parameters(), strict=True):
                p.copy_(m)
    return {k: v.detach().clone() for k, v in master.state_dict().items()}


@functools.cache
def _reference(dtype: torch.dtype) -> dict:
    return train_single_mixed(dtype)


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


# ---------------------------------------------------------------------------------------
# Tests


@pytest.mark.parametrize("mode", MODES)
def test_bf16_matches_fsdp2_and_a_bf16_single_process(ranks, mode):
    for r in ranks:
        state = r[mode]["bf16"]["state"]
        assert all(v.dtype == torch.float32 for v in state.values())  # from the masters
        # torch's own mixed precision (bf16 params, fp32 reduction) on the same slices
        assert _max_diff(state, r["fsdp2"]) < 1e-6
        # one process rounds differently (bf16 sums over the whole batch): loosely
        assert _max_diff(state, _reference(torch.bfloat16)) < 1e-3
    # forward saw bf16 activations and bf16 weights, not fp32 ones
    assert ranks[0][mode]["bf16"]["seen"] == {(torch.bfloat16, torch.bfloat16)}
    # and the run is not the fp32 one: rounding to bf16 shows in the parameters
    assert _max_diff(ranks[0][mode]["bf16"]["state"], _reference(torch.float32)) > 1e-5


@pytest.mark.parametrize("mode", MODES)
def test_bf16_accumulation_matches_fsdp2_and_the_whole_slice(ranks, mode):
    for r in ranks:
        got = r[mode]["bf16_accumulated"]
        # micro-batches round differently from one batch: loosely
        assert _max_diff(got, r[mode]["bf16"]["state"]) < 1e-3
        # FSDP2 sums the micro-batches' bf16 gradients in fp32 (the reduce dtype): so do we
        # (summed in bf16 instead, zero and fsdp were 1.1e-4 away)
        assert _max_diff(got, r["fsdp2_accumulated"]) < 1e-6


@pytest.mark.parametrize("mode", MODES)
def test_frozen_parameters_keep_their_fp32_values(ranks, mode):
    for r in ranks:
        got = r[mode]["frozen"]
        assert got["want"].dtype == torch.float32
        assert not torch.equal(got["want"], got["want"].bfloat16().float())  # bf16 would show
        assert torch.equal(got["full"]["fc1.weight"], got["want"])
        if got["saved"]:
            assert torch.equal(got["saved"]["fc1.weight"], got["want"])
    assert any(r[mode]["frozen"]["saved"] for r in ranks)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_loss_still_falls_in_low_precision(ranks, mode, precision):
    losses = ranks[0][mode]["losses"][precision]
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < 0.8 * losses[0], losses


@pytest.mark.parametrize("mode", MODES)
def test_allgathers_move_half_the_bytes_in_bf16(ranks, mode):
    bf16, fp32 = ranks[0][mode]["bf16"]["sent"], ranks[0][mode]["fp32_sent"]
    if mode == "ddp":  # nothing gathered; gradients reduced in fp32 either way
        assert bf16 == fp32 and "all_gather" not in bf16
        return
    assert bf16["all_gather"] == pytest.approx(fp32["all_gather"] / 2)
    assert bf16["reduce_scatter"] == fp32["reduce_scatter"]  # mode.reduce_dtype=fp32


@pytest.mark.parametrize("mode", MODES)
def test_fp16_host_decided_skip_with_an_injected_inf(ranks, mode):
    # The fallback for an optimizer that cannot skip by itself (SGD with foreach=True):
    # the host reads the agreed flag and does not step, as GradScaler does for it.
    runs = [r[mode]["fp16"] for r in ranks]
    for run in runs:
        assert not run["skips_on_device"]
        assert run["stepped"] == [True, False, True]  # every rank skipped step 2
        assert run["scales"] == [1024.0, 512.0, 512.0]  # halved once, not yet grown
        before, after = run["states"][1], run["states"][2]
        assert all(torch.equal(before[k], after[k]) for k in before)  # untouched
        assert _max_diff(run["states"][2], run["states"][3]) > 0  # the next step updates
        # clipping sees unscaled gradients: fp16's norm is fp32's, not 1024 times it
        assert run["norms"][0] == pytest.approx(run["fp32_norm"], rel=2e-2)
        assert math.isinf(run["norms"][1]) or math.isnan(run["norms"][1])
    if mode != "ddp":  # sharded gradients: only some ranks saw the inf themselves
        assert [run["local_bad"][1] for run in runs] != [True, True]
    assert all(not run["local_bad"][0] and not run["local_bad"][2] for run in runs)


def _same(a: list, b: list) -> bool:
    """Pieces' values and optimizer state (moments, step counts), bitwise."""
    return len(a) == len(b) and all(
        torch.equal(va, vb)
        and sa.keys() == sb.keys()
        and all(torch.equal(sa[k], sb[k]) for k in sa)
        for (va, sa), (vb, sb) in zip(a, b, strict=True)
    )


@pytest.mark.parametrize("optim", ["adamw", "sgd"])
@pytest.mark.parametrize("mode", MODES)
def test_fp16_overflow_on_one_rank_skips_on_the_device_as_grad_scaler_does(ranks, mode, optim):
    runs = [r[mode]["grad_scaler"][optim] for r in ranks]
    for run in runs:
        assert run["skips_on_device"]  # fused: the device decides, no host read
        steps = run["steps"]
        assert [s["stepped"] for s in steps] == [True, False, True, True]  # all skip step 2
        # halved at the overflow, doubled after growth_interval=2 good steps
        assert [s["scale"] for s in steps] == [1024.0, 512.0, 512.0, 1024.0]
        assert [s["ref_scale"] for s in steps] == [1024.0, 512.0, 512.0, 1024.0]
        for s in steps:  # torch.amp.GradScaler with the same fused optimizer
            assert _same(s["mine"], s["ref"])
        # the skipped step left values, moments and step counts exactly as they were
        assert _same(steps[0]["mine"], steps[1]["mine"])
        if mode != "fsdp":  # fsdp frees its full parameters between steps
            for s in steps:  # the fp16 parameters are the masters rounded, skipped or not
                assert all(torch.equal(v, s["full"][k].half()) for k, v in s["module"].items())
        assert not _same(steps[1]["mine"], steps[2]["mine"])  # and the next one updates
        if optim == "adamw":
            counts = [{st["step"].item() for _, st in s["mine"]} for s in steps]
            assert counts == [{1.0}, {1.0}, {2.0}, {3.0}]
    # zero and fsdp: the inf lay in one rank's shard, and still every rank skipped
    want = [[False, True, False, False]] * 2 if mode == "ddp" else None
    local = [run["local_bad"] for run in runs]
    assert (
        local == want
        if want
        else sorted(map(tuple, local))
        == [
            (False, False, False, False),
            (False, True, False, False),
        ]
    )


@pytest.mark.parametrize("mode", MODES)
def test_fp16_sgd_whose_first_step_overflows_starts_its_momentum_afresh(ranks, mode):
    for r in ranks:
        steps = r[mode]["sgd_first_skipped"]["steps"]
        assert [s["stepped"] for s in steps] == [False, True, True]
        first = steps[0]
        assert _equal(first["values"], first["ref_values"])
        assert all(m.count_nonzero() == 0 for m in first["momentum"])  # nothing kept
        assert first["ref_momentum"] == [None] * len(first["values"])  # never stepped
        for s in steps[1:]:  # then exactly the fused SGD whose first step this is
            assert _equal(s["values"], s["ref_values"])
            assert _equal(s["momentum"], s["ref_momentum"])


def _equal(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_loss_scaler_grows_after_a_run_of_good_steps():
    s = LossScaler(enabled=True, init_scale=8.0, growth_interval=3)
    for found_inf, want in [(0.0, 8), (0.0, 8), (0.0, 16), (1.0, 8), (0.0, 8)]:
        s.update(torch.tensor(found_inf))
        assert s.scale.item() == want
    restored = LossScaler(enabled=True)
    restored.load_state_dict(s.state_dict())
    assert s.state_dict() == {"enabled": True, "scale": 8.0, "good_steps": 1, "skipped": 1}
    assert restored.state_dict() == s.state_dict()
    assert torch.load(_saved(s.state_dict()), weights_only=True) == s.state_dict()
    off = LossScaler(enabled=False)
    loss = torch.tensor(3.0)
    assert off.scale_loss(loss) is loss and off.scale.item() == 1.0


def _saved(obj) -> io.BytesIO:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf


def test_precision_casts_floating_inputs_only():
    p = Precision.of("bf16")
    x, ids = torch.randn(2), torch.arange(3)
    cast = p.cast_in({"x": x, "ids": ids, "pair": (x, 1)})
    assert cast["x"].dtype == torch.bfloat16 and cast["ids"].dtype == torch.int64
    assert cast["pair"][0].dtype == torch.bfloat16 and cast["pair"][1] == 1
    assert p.cast_out(cast["x"]).dtype == torch.float32
    assert Precision.of("fp32").cast_in(x) is x


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"precision": "fp8"}, "precision='fp8' is not one of fp32, bf16, fp16"),
        ({"reduce_dtype": "int4"}, "mode.reduce_dtype='int4' is not one of"),
        ({"gather_dtype": "int8"}, "mode.gather_dtype=int8 applies to zero and fsdp"),
        ({"precision": "fp16", "loss_scale": {"init_scale": 0}}, "loss_scale.init_scale=0"),
    ],
)
def test_bad_precision_options_name_the_value(kwargs, needle):
    from trainer.parallel import build_engine

    with pytest.raises(ConfigError, match=needle.replace("(", r"\(")):
        build_engine(make_model("mlp", seed=0), "ddp", OPTIMIZERS["sgd"], **kwargs)


def test_cli_fp16_backs_off_from_a_too_large_scale(tmp_path):
    from test_cli import run_cli, scalars

    proc = run_cli(
        [
            f"run.root={tmp_path}",
            "mode=zero",
            "precision=fp16",
            "loss_scale.init_scale=16777216",  # 2^24: fp16 grads overflow; it backs off
            "train.steps=40",
            "train.log_every=5",
            "ckpt.every=40",
        ],
        nproc=2,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    [run_dir] = [p for p in tmp_path.iterdir() if p.is_dir()]
    values = scalars(run_dir)
    overflows, scale = values["train/overflow_steps"], values["train/loss_scale"]
    assert 0 < overflows[-1] < 20 and scale[-1] < 2**24
    assert values["train/loss"][-1] < 0.7 * values["train/loss"][0], values["train/loss"]
    final = torch.load(run_dir / "final_model.pt", weights_only=True)
    assert all(v.dtype == torch.float32 for v in final.values())  # the fp32 masters
    meta = torch.load(run_dir / "checkpoints/step_000040/meta.pt", weights_only=True)
    assert meta["state"]["loss_scaler"]["scale"] == pytest.approx(scale[-1])
