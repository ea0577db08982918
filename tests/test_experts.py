"""Expert parallelism (trainer/parallel/experts.py) against one process without it.

Every case trains GPT-MoE (4 experts, top-2, an MoE MLP in every block) for a few steps
through `build_engine(..., expert_parallel=E)` at P ranks, each rank on its slice of the
global batch, and compares the mean loss of every step and every final weight (the full
state_dict, experts gathered into their stacked layout) with one process training the
same model without EP on the same data. The one process computes the loss the P ranks
define: the mean over the P rank slices of (cross entropy + aux loss) of each slice (the
load-balancing loss is a per-batch statistic; its mean over ranks is what the ranks
train). Models are built from the same seed everywhere.

Speed: all cases of one world size run in one process group (`_results`), the ranks
starting once; a case that raises is recorded and the next one starts.

Tolerances: fp32, SGD (momentum 0.9, lr 0.05) or AdamW with eps=1e-3. Runs differ only
in summation order: each expert's matmul covers another set of rows (tokens of the E
ranks of an EP group, not of one slice), gradients are summed over ranks in another
order, the 1/E and 1/(P/E) factors are powers of two (exact). Relative differences of
about 1e-7 per operation; 3 steps of SGD (or AdamW, whose step is at most lr/eps = 10
times a gradient change) keep parameter differences far below atol=1e-5/rtol=1e-4
(what test_peer_patterns bounds the same way). Top-k routing is discontinuous, but the
router's margins in this model are far above 1e-6: no token changes expert between runs
(a change would show as an error of order 1e-2, not a near-miss).
bf16 runs are a smoke test: loss within 5e-2 of fp32's one process.
"""

from __future__ import annotations

import functools
import traceback
from typing import Any

import pytest
import torch
from dist_harness import run_distributed
from reference import assert_state_close

from trainer.errors import ConfigError
from trainer.models.builtin import GPTMoE, loss_fn, update_expert_bias

pytestmark = pytest.mark.slow  # starting ranks is most of it

VOCAB, SEQ, STEPS, BATCH = 32, 8, 3, 8
SIZES = dict(
    vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=2, n_embd=16, n_experts=4, top_k=2,
    moe_every=1, aux_loss_coef=0.01,
)  # fmt: skip
OPTIMIZERS = {
    "sgd": functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9),
    "adamw": functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1, eps=1e-3),
}
FSDP = {"min_unit_params": 1}


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(STEPS):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def _model(skew: bool = False, checkpointing: bool = False, bias: float = 0.0) -> GPTMoE:
    torch.manual_seed(0)
    model = GPTMoE(**SIZES, activation_checkpointing=checkpointing, bias_update_speed=bias)
    if skew:  # every token to experts 0 and 1: those of EP position 0 (E=2), 0 and 1 (E=4)
        with torch.no_grad():
            for b in model.blocks:
                b.ln_2.weight.fill_(1e-3)  # ln_2(x) is about its bias: the same for every token
                b.ln_2.bias.fill_(1.0)
                w = b.moe.router.weight  # (n_experts, C)
                w.fill_(-1.0)
                w[:2] = 1.0
    return model


@functools.cache
def _reference(
    skew: bool, optim: str, world: int, accum: int, clip: float, bias: float = 0.0
) -> dict:
    """One process, no EP, the loss the P ranks define (module docstring)."""
    model = _model(skew, bias=bias)
    opt = OPTIMIZERS[optim](model.parameters())
    losses = []
    for x, y in _batches():
        total = 0.0
        for xr, yr in zip(x.chunk(world), y.chunk(world), strict=True):
            for xm, ym in zip(xr.chunk(accum), yr.chunk(accum), strict=True):
                loss = (loss_fn(model(xm), ym) + model.aux_loss) / accum
                (loss / world).backward()
                total += loss.item() / world
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        update_expert_bias(model)  # the whole batch's counts, as the P ranks sum theirs
        opt.zero_grad()
        losses.append(total)
    return {"losses": losses, "state": {k: v.clone() for k, v in model.state_dict().items()}}


def _train(env, mode: str, e: int, optim: str = "sgd", accum: int = 1, clip: float = 0.0,
           skew: bool = False, checkpointing: bool = False, precision: str = "fp32",
           options: dict | None = None, delay_s: float = 0.0,
           bias: float = 0.0) -> dict:  # fmt: skip
    from trainer import comm
    from trainer.parallel import build_engine
    from trainer.run.loop import forward_backward

    model = _model(skew, checkpointing, bias)
    opts = dict(options or (FSDP if mode == "fsdp" else {"bucket_mb": 0.0005}))
    engine = build_engine(
        model, mode, OPTIMIZERS[optim], precision=precision, expert_parallel=e, **opts
    )
    p, r = env.world_size, env.rank
    # what this rank holds of the experts, as live tensors: parameters (ddp, zero keep
    # theirs whole; storages counted once) and the values the optimizer steps
    is_expert = {id(q) for n, q in model.named_parameters() if ".experts." in n}
    storages = {
        q.untyped_storage().data_ptr(): q.untyped_storage().nbytes()
        for q in model.parameters()
        if id(q) in is_expert
    }
    held = {
        "params": sum(storages.values()) // 4,
        "stepped": sum(g.local.numel() for g in engine.shard_groups() if ".experts." in g.names[0]),
    }
    from trainer.observe.memory import MemoryMonitor

    monitor = MemoryMonitor(engine, sum(q.numel() for q in _model().parameters()))
    losses = []
    for x, y in _batches():
        with comm.delayed(delay_s):  # a sleep before every collective (0: none)
            loss, _ = forward_backward(engine, x.chunk(p)[r], y.chunk(p)[r], accum)
            if clip:
                engine.clip_grad_norm_(clip)
            engine.step()
            update_expert_bias(model)  # as the loop does after each step
        total = loss.detach().reshape(1).clone()
        comm.all_reduce(total, average=True).wait()
        losses.append(total.item())
    monitor.update()
    memory = monitor.gather()  # rank 0: measured (max over ranks) and the formula
    state = engine.full_state_dict()
    loads = [b.moe.load.tolist() for b in model.blocks]  # the last forward's, this rank
    biases = [b.moe.expert_bias.clone() for b in model.blocks if bias]  # this rank's
    return {
        "losses": losses, "state": state if r == 0 else None, "held": held, "loads": loads,
        "memory": memory, "biases": biases,
    }  # fmt: skip


# name: (P, keyword arguments of _train)
CASES: dict[str, tuple[int, dict[str, Any]]] = {}
for _p in (2, 4):
    for _e in sorted({2, _p}):
        for _mode in ("ddp", "zero", "fsdp"):
            CASES[f"{_mode}-p{_p}-e{_e}"] = (_p, {"mode": _mode, "e": _e})
CASES.update({
    "ddp-p4-e2-adamw": (4, {"mode": "ddp", "e": 2, "optim": "adamw"}),
    "fsdp-p4-e2-adamw": (4, {"mode": "fsdp", "e": 2, "optim": "adamw"}),
    "ddp-p2-e2-accum": (2, {"mode": "ddp", "e": 2, "accum": 2}),
    "zero-p4-e2-accum": (4, {"mode": "zero", "e": 2, "accum": 2}),
    "fsdp-p4-e2-accum": (4, {"mode": "fsdp", "e": 2, "accum": 2}),
    "ddp-p4-e2-clip": (4, {"mode": "ddp", "e": 2, "clip": 0.05}),
    "zero-p4-e4-clip": (4, {"mode": "zero", "e": 4, "clip": 0.05}),
    "fsdp-p4-e2-clip": (4, {"mode": "fsdp", "e": 2, "clip": 0.05}),
    "ddp-p2-e2-ckpt": (2, {"mode": "ddp", "e": 2, "checkpointing": True}),
    "fsdp-p4-e2-ckpt": (4, {"mode": "fsdp", "e": 2, "checkpointing": True}),
    "ddp-p2-e2-skew": (2, {"mode": "ddp", "e": 2, "skew": True}),
    "fsdp-p4-e4-skew": (4, {"mode": "fsdp", "e": 4, "skew": True}),
    "zero-p4-e2-skew": (4, {"mode": "zero", "e": 2, "skew": True}),
    # comm.delayed: a sleep before every collective, AllToAlls included (test_overlap.py)
    "ddp-p2-e2-delayed": (2, {"mode": "ddp", "e": 2, "delay_s": 0.01}),
    "zero-p4-e2-delayed": (4, {"mode": "zero", "e": 2, "delay_s": 0.01}),
    "fsdp-p4-e2-delayed": (4, {"mode": "fsdp", "e": 2, "delay_s": 0.01}),
    # DeepSeek-V3's routing bias ([Note: aux-loss-free load balancing] in builtin.py);
    # 0.01 per step moves the choice of this small model's near-uniform router at once
    "ddp-p2-e2-bias": (2, {"mode": "ddp", "e": 2, "bias": 0.01}),
    "fsdp-p4-e2-bias": (4, {"mode": "fsdp", "e": 2, "bias": 0.01, "accum": 2}),
})  # fmt: skip


def _first_grads(env, mode: str, e: int) -> dict[str, torch.Tensor]:
    """The expert gradients after one backward, gathered into the stacked layout (ddp
    keeps them whole; E ranks hold one slice each)."""
    from trainer import comm
    from trainer.parallel import build_engine
    from trainer.run.loop import forward_backward

    model = _model()
    engine = build_engine(model, mode, OPTIMIZERS["sgd"], expert_parallel=e)
    x, y = _batches()[0]
    p, r = env.world_size, env.rank
    forward_backward(engine, x.chunk(p)[r], y.chunk(p)[r], 1)
    out = {}
    for name, q in model.named_parameters():
        if ".experts." in name:
            g = q.grad.contiguous()
            whole = g.new_empty((e * g.numel(),))
            ep = engine.experts.groups.ep if engine.experts is not None else None
            if e > 1:
                comm.all_gather(whole, g.view(-1), group=ep).wait()
            else:
                whole = g.reshape(-1)
            out[name] = whole.view(e * g.shape[0], *g.shape[1:])
    return out


def _traces(env, mode: str, e: int) -> dict[str, Any]:
    """Collectives of one forward and one backward: (op, tag, ranks of its group)."""
    from trainer import comm
    from trainer.parallel import build_engine
    from trainer.run.loop import forward_backward

    model = _model()
    opts = FSDP if mode == "fsdp" else {}
    engine = build_engine(model, mode, OPTIMIZERS["sgd"], expert_parallel=e, **opts)
    x, y = _batches()[0]
    p, r = env.world_size, env.rank
    with comm.tracing() as trace, comm.membership() as members:
        forward_backward(engine, x.chunk(p)[r], y.chunk(p)[r], 1)
    launches = [(ev[len("launch:") :], tag) for ev, tag in trace if ev.startswith("launch:")]
    assert len(launches) == len(members)
    return {
        "calls": [
            (op, tag, ranks) for (op, tag), (_, ranks) in zip(launches, members, strict=True)
        ],
        "forward_a2a": _forward_a2a(engine, x.chunk(p)[r]),
    }


def _forward_a2a(engine, x: torch.Tensor) -> int:
    from trainer import comm

    with comm.tracing() as trace, torch.no_grad():
        engine(x)
    return sum(ev == "launch:all_to_all" for ev, _ in trace)


def _host_reads(env) -> int:
    """Host reads of one forward/backward at E=2: one per MoE layer."""
    from trainer.observe import host
    from trainer.parallel import build_engine
    from trainer.run.loop import forward_backward

    engine = build_engine(_model(), "ddp", OPTIMIZERS["sgd"], expert_parallel=2)
    x, y = _batches()[0]
    p, r = env.world_size, env.rank
    with host.counting() as reads:
        forward_backward(engine, x.chunk(p)[r], y.chunk(p)[r], 1)
    return reads.where


def _refusals(env) -> list[str]:
    """What build_engine says to bad values, each a one-line ConfigError."""
    from trainer.models.builtin import GPT
    from trainer.parallel import build_engine

    said = []
    for build, mode, kw in [
        (_model, "ddp", {"expert_parallel": 3}),  # divides neither P=4 nor 4 experts
        (lambda: GPTMoE(**{**SIZES, "n_experts": 2}), "ddp", {"expert_parallel": 4}),
        (lambda: GPT(vocab_size=VOCAB, block_size=SEQ, n_embd=16), "ddp", {"expert_parallel": 2}),
        (_model, "zero", {"expert_parallel": 2, "shard_group_size": 2}),
    ]:
        try:
            build_engine(build(), mode, OPTIMIZERS["sgd"], **kw)
            said.append("accepted")
        except ConfigError as err:
            said.append(str(err))
    return said


# ---------------------------------------------------------------------------------------
# Hugging Face Mixtral by path: a directory written by save_pretrained (one tensor per
# expert), read slice by slice under EP, trained through transformers' experts interface.

MIXTRAL = dict(
    vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
    num_attention_heads=2, num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2,
    max_position_embeddings=16, output_router_logits=True, router_aux_loss_coef=0.01,
)  # fmt: skip


def _mixtral_dir() -> str:
    import tempfile

    from transformers import MixtralConfig, MixtralForCausalLM

    directory = tempfile.mkdtemp(prefix="mixtral_")
    torch.manual_seed(0)
    MixtralForCausalLM(MixtralConfig(**MIXTRAL)).save_pretrained(directory)
    return directory


def _train_hf(env, directory: str, mode: str, e: int) -> dict:
    from trainer import comm
    from trainer.models.lm import hf_causal_lm
    from trainer.models.materialize import empty_weights
    from trainer.models.weights import Pretrained
    from trainer.parallel import build_engine
    from trainer.run.loop import forward_backward

    with empty_weights():
        model = hf_causal_lm(directory)
    source = Pretrained(directory)
    opts = FSDP if mode == "fsdp" else {}
    engine = build_engine(
        model, mode, OPTIMIZERS["sgd"], expert_parallel=e, source=source, device="cpu", **opts
    )
    read = source.files.elements_read
    p, r = env.world_size, env.rank
    losses = []
    for x, y in _batches():
        loss, _ = forward_backward(engine, x.chunk(p)[r], y.chunk(p)[r], 1)
        engine.step()
        total = loss.detach().reshape(1).clone()
        comm.all_reduce(total, average=True).wait()
        losses.append(total.item())
    state = engine.full_state_dict()
    return {"losses": losses, "state": state if r == 0 else None, "read": read}


@functools.cache
def _reference_hf(directory: str, world: int) -> dict:
    from trainer.models.lm import hf_causal_lm

    model = hf_causal_lm(directory)
    opt = OPTIMIZERS["sgd"](model.parameters())
    losses = []
    for x, y in _batches():
        total = 0.0
        for xr, yr in zip(x.chunk(world), y.chunk(world), strict=True):
            loss = loss_fn(model(xr), yr) + model.aux_loss
            (loss / world).backward()
            total += loss.item() / world
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return {"losses": losses, "state": {k: v.clone() for k, v in model.state_dict().items()}}


HF_CASES = {
    "hf-ddp-p2-e2": (2, {"mode": "ddp", "e": 2}),
    "hf-zero-p2-e2": (2, {"mode": "zero", "e": 2}),
    "hf-fsdp-p2-e2": (2, {"mode": "fsdp", "e": 2}),
    "hf-fsdp-p4-e2": (4, {"mode": "fsdp", "e": 2}),
    "hf-ddp-p4-e4": (4, {"mode": "ddp", "e": 4}),
}

PROBES = {
    "grads-ddp-e1": (4, functools.partial(_first_grads, mode="ddp", e=1)),
    "grads-ddp-e2": (4, functools.partial(_first_grads, mode="ddp", e=2)),
    "grads-ddp-e4": (4, functools.partial(_first_grads, mode="ddp", e=4)),
    "traces-ddp": (4, functools.partial(_traces, mode="ddp", e=2)),
    "traces-zero": (4, functools.partial(_traces, mode="zero", e=2)),
    "traces-fsdp": (4, functools.partial(_traces, mode="fsdp", e=2)),
    "host-reads": (2, _host_reads),
    "refusals": (4, _refusals),
    "bf16": (2, functools.partial(_train, mode="fsdp", e=2, precision="bf16")),
}


def _run_cases(env, names: list[str], hf_dir: str) -> dict[str, Any]:
    out = {}
    for name in names:
        try:
            if name in PROBES:
                out[name] = PROBES[name][1](env)
            elif name in HF_CASES:
                out[name] = _train_hf(env, hf_dir, **HF_CASES[name][1])
            else:
                out[name] = _train(env, **CASES[name][1])
        except Exception:
            out[name] = traceback.format_exc()
    return out


@functools.cache
def _hf_dir() -> str:
    return _mixtral_dir()


@functools.cache
def _results(world: int) -> list[dict[str, Any]]:
    names = [n for n, (p, _) in {**CASES, **PROBES, **HF_CASES}.items() if p == world]
    return run_distributed(_run_cases, world, names, _hf_dir(), timeout=900, pg_timeout_s=60)


def _got(name: str) -> list[Any]:
    world = {**CASES, **PROBES, **HF_CASES}[name][0]
    got = [r[name] for r in _results(world)]
    for g in got:
        assert not isinstance(g, str), g
    return got


@pytest.mark.parametrize("name", list(CASES))
def test_equal_to_one_process(name: str) -> None:
    world, kw = CASES[name]
    got = _got(name)
    want = _reference(
        kw.get("skew", False),
        kw.get("optim", "sgd"),
        world,
        kw.get("accum", 1),
        kw.get("clip", 0.0),
        kw.get("bias", 0.0),
    )
    torch.testing.assert_close(got[0]["losses"], want["losses"], atol=1e-5, rtol=1e-4)
    assert_state_close(got[0]["state"], want["state"])
    if kw.get("skew"):  # the case is what it says: experts 2 and 3 got no token
        for g in got:
            for load in g["loads"]:
                assert load[2:] == [0.0, 0.0] and load[0] > 0 and load[1] > 0


@pytest.mark.parametrize("name", ["ddp-p2-e2", "zero-p4-e2", "fsdp-p4-e2"])
def test_delay_before_each_collective_changes_nothing(name: str) -> None:
    """A sleep before every collective (comm.delayed; the AllToAlls of dispatch, their
    reverses in backward, the EDP reductions) gives the same bits as no delay: a wait
    missing anywhere would let a rank read a buffer before its collective filled it."""
    for plain, delayed in zip(_got(name), _got(f"{name}-delayed"), strict=True):
        assert plain["losses"] == delayed["losses"]
        for k, v in (plain["state"] or {}).items():
            assert torch.equal(v, delayed["state"][k]), k


@pytest.mark.parametrize("name", ["ddp-p2-e2-bias", "fsdp-p4-e2-bias"])
def test_expert_bias_is_rank_identical_and_equal_to_one_process(name: str) -> None:
    """The routing bias of every rank, after every step's update from the global counts,
    is the same on every rank and bitwise the one process's (whole counts summed, the
    same sign steps); it moved, and the choice it makes differs from the probabilities'
    alone (the final weights, equal to one process, are in test_equal_to_one_process)."""
    world, kw = CASES[name]
    want = _reference(False, "sgd", world, kw.get("accum", 1), 0.0, kw["bias"])["state"]
    got = _got(name)
    for i in range(SIZES["n_layer"]):
        key = f"blocks.{i}.moe.expert_bias"
        assert want[key].abs().sum() > 0, key  # not still zeros
        for g in got:
            assert torch.equal(g["biases"][i], want[key]), (key, g["biases"][i], want[key])
    plain = _reference(False, "sgd", world, kw.get("accum", 1), 0.0)["losses"]
    assert got[0]["losses"][-1] != plain[-1]  # the bias changed what the model trained


def _expert_numel() -> int:
    return sum(q.numel() for n, q in _model().named_parameters() if ".experts." in n)


@pytest.mark.parametrize("name", ["ddp-p4-e2", "zero-p4-e2", "fsdp-p4-e2", "zero-p4-e4"])
def test_expert_memory(name: str) -> None:
    """Each rank keeps 1/E of the expert parameters (ddp and zero: as parameters; fsdp
    only as its slice), and steps 1/E (ddp) or 1/P (zero, fsdp: sharded over the P/E
    ranks of the EDP group) of them, measured on the live tensors."""
    world, kw = CASES[name]
    total, e = _expert_numel(), kw["e"]
    for r in _results(world):
        held = r[name]["held"]
        if kw["mode"] != "fsdp":  # fsdp's parameters are freed between steps
            assert held["params"] == total // e
        share = e if kw["mode"] == "ddp" else world
        # zero and fsdp pad each flat buffer to a multiple of P/E: a few elements
        assert total // share <= held["stepped"] <= total // share + 2 * world
    # memory.py's formula with the EP case ([Note: the expected figures]) against the
    # live tensors (padding: a few elements per flat buffer)
    mem = _got(name)[0]["memory"]
    for kind in ("params", "grads", "optimizer"):
        got, want = mem[f"memory/{kind}_MiB/max"], mem[f"memory/expected/{kind}_MiB"]
        assert abs(got - want) <= 0.01 * want + 1e-3, (kind, got, want)


def test_expert_gradients_do_not_depend_on_e() -> None:
    """[Note: expert gradient scale]: divided by P, not by the EDP group size: E = 1, 2,
    4 give the same expert gradients, equal to one process's."""
    model = _model()
    x, y = _batches()[0]
    for xr, yr in zip(x.chunk(4), y.chunk(4), strict=True):
        ((loss_fn(model(xr), yr) + model.aux_loss) / 4).backward()
    want = {n: q.grad for n, q in model.named_parameters() if ".experts." in n}
    for e in (1, 2, 4):
        for grads in _got(f"grads-ddp-e{e}"):
            assert_state_close(grads, want)


@pytest.mark.parametrize("mode", ["ddp", "zero", "fsdp"])
def test_collective_traces(mode: str) -> None:
    """Three AllToAlls per MoE layer in forward, two in backward, each over the rank's
    EP group; expert gradients reduced (and, sharded, gathered) over the EDP group only,
    dense ones over all ranks."""
    n_moe = SIZES["n_layer"]
    for rank, got in enumerate(_got(f"traces-{mode}")):
        ep = tuple(range(rank // 2 * 2, rank // 2 * 2 + 2))
        edp = (rank % 2, rank % 2 + 2)
        a2a = [(tag, ranks) for op, tag, ranks in got["calls"] if op == "all_to_all"]
        assert got["forward_a2a"] == 3 * n_moe
        assert len(a2a) == 5 * n_moe
        assert sorted({t for t, _ in a2a}) == [
            "moe.back", "moe.back.grad", "moe.counts", "moe.tokens", "moe.tokens.grad"
        ]  # fmt: skip
        assert {r for _, r in a2a} == {ep}
        grads = [
            (op, tag, r) for op, tag, r in got["calls"] if op in ("all_reduce", "reduce_scatter")
        ]
        assert grads
        for op, tag, ranks in grads:
            assert ranks in (edp, (0, 1, 2, 3)), (op, tag, ranks)
        expert_reductions = {r for op, tag, r in grads if r == edp}
        assert expert_reductions, "no reduction over the EDP group"


def test_one_host_read_per_moe_layer() -> None:
    for got in _got("host-reads"):
        assert got == ["expert split sizes"] * SIZES["n_layer"]


def test_refusals_are_one_line() -> None:
    said = _got("refusals")[0]
    assert (
        "mode.expert_parallel=3 must divide the world size 4 and the number of experts 4" in said[0]
    )
    assert "use one of 1, 2, 4" in said[0]
    assert "number of experts 2: use one of 1, 2" in said[1]
    assert "no experts module" in said[2]
    assert "hybrid sharding with expert parallelism" in said[3]
    assert all("\n" not in s for s in said)


def test_bf16_smoke() -> None:
    """bf16 compute with fp32 masters: trains, loss close to fp32's one process."""
    want = _reference(False, "sgd", 2, 1, 0.0)["losses"]
    got = _got("bf16")[0]["losses"]
    torch.testing.assert_close(got, want, atol=5e-2, rtol=0)


def test_config_refuses_bad_expert_parallel() -> None:
    from trainer.comm.groups import check_expert_parallel

    with pytest.raises(ConfigError, match="must divide the world size 4: use one of 1, 2, 4"):
        check_expert_parallel(3, 4)
    with pytest.raises(ConfigError, match="expert_parallel=True"):
        check_expert_parallel(True, 4, 8)
    check_expert_parallel(2, 4, 8)


def test_expert_bias_refusals_are_one_line() -> None:
    """model.bias_update_speed: a negative speed, and a precision that would cast its
    fp32 bias buffer ([Note: aux-loss-free load balancing])."""
    from trainer.estimate import compose_modes

    with pytest.raises(ConfigError, match=r"bias_update_speed=-0.1 must be >= 0"):
        GPTMoE(**SIZES, bias_update_speed=-0.1)
    base = ["model=gpt_moe", "data=tokens", "model.bias_update_speed=0.001"]
    with pytest.raises(ConfigError, match="use precision=fp32 or model.bias_update_speed=0"):
        compose_modes([*base, "precision=bf16"], 2)
    compose_modes(base, 2)  # fp32: accepted


@pytest.mark.parametrize("name", list(HF_CASES))
def test_mixtral_by_path_equal_to_one_process(name: str) -> None:
    """A directory from MixtralForCausalLM(cfg).save_pretrained (one tensor per expert)
    trains with EP in every mode, equal to one process loading it with from_pretrained;
    each rank read only its experts' tensors (and, in fsdp, only its slices)."""
    world, kw = HF_CASES[name]
    got = _got(name)
    want = _reference_hf(_hf_dir(), world)
    torch.testing.assert_close(got[0]["losses"], want["losses"], atol=1e-5, rtol=1e-4)
    assert_state_close(got[0]["state"], want["state"])
    total = sum(v.numel() for v in want["state"].values())
    experts = sum(v.numel() for k, v in want["state"].items() if ".experts." in k)
    for g in got:
        if kw["mode"] == "fsdp":
            assert g["read"] < total - experts + experts // kw["e"]
        else:
            assert g["read"] == total - experts + experts // kw["e"]


def test_command_line_gpt_moe(tmp_path) -> None:
    """model=gpt_moe with mode.expert_parallel=2 from the command line: TensorBoard has
    the aux loss, the expert load and the AllToAll bytes; final_model.pt holds every
    expert in the model's stacked layout; the last step's checkpoint is written
    (tests/test_checkpoint_experts.py resumes them). With DeepSeek-V3's routing bias on:
    the loop updates it after every step, and the saved model holds it."""
    import sys
    from pathlib import Path

    import warm_cli
    from tb_events import scalars

    root = Path(__file__).resolve().parents[1]
    proc = warm_cli.command(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         str(root / "train.py"), "model=gpt_moe", "data=tokens", "mode=zero",
         "mode.expert_parallel=2", "model.n_experts=4", "train.steps=6", "train.log_every=3",
         "train.batch_size=8", "model.bias_update_speed=0.001", f"run.root={tmp_path}"],
        timeout=240, cwd=root,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    tags = scalars(run_dir)
    assert 1.0 <= tags["moe/load_max_over_mean"][-1][1] <= 4.0
    assert tags["moe/aux_loss"][-1][1] > 0
    assert tags["comm/bytes_per_step/all_to_all"][-1][1] > 0
    state = torch.load(run_dir / "final_model.pt", weights_only=True)
    assert state["blocks.0.moe.experts.w_in"].shape == (4, 64, 256)
    bias = state["blocks.0.moe.expert_bias"]  # 6 steps of +-0.001 each
    assert bias.abs().max() > 0 and bias.abs().max() <= 6 * 0.001 + 1e-6
    assert [p.name for p in run_dir.glob("checkpoints/step*")] == ["step_000006"]


def test_estimate_knows_experts() -> None:
    """scripts/estimate.py's figures for a GPT-MoE at E=2 on 4 ranks: expert parameters
    per rank and the AllToAll bytes of the formula, worked out here by hand."""
    from trainer.estimate import Cluster, compose_modes, estimate

    overrides = ["model=gpt_moe", "data=tokens", "mode.expert_parallel=2", "model.n_experts=4"]
    result = estimate(compose_modes(overrides, 4), Cluster(4, 4, 450e9, 50e9, 989e12, 0.4), 80e9)
    n_embd, layers, experts_total = 64, 2, 2 * 4 * 2 * 64 * 256  # w_in and w_out per layer
    tokens = 128 // 4 * 32  # train.batch_size / P x block_size, per rank and step
    # per layer, forward and backward: rows out and back, (E-1)/E of them to the other rank
    a2a = 2 * layers * 2 * (1 / 2) * tokens * 2 * n_embd * 4
    for mode, held, stepped in [("ddp", 2, 2), ("zero", 2, 4), ("fsdp", 4, 4)]:
        x = result[mode]["experts"]
        assert x["expert_params"] == experts_total
        assert x["expert_params_held_per_rank"] == experts_total // held
        assert x["expert_params_stepped_per_rank"] == experts_total // stepped
        assert x["all_to_all_bytes_per_step"] == a2a
