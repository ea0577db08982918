"""Models we did not write: HF transformers' GPT-2 and Llama (tied embeddings) and timm's
ViT, built from small configs with random weights (nothing is downloaded), under fsdp's
default unit policy, and trained in every mode against torch's DistributedDataParallel;
and ALBERT, whose one layer runs three times (weight sharing across depth), with its
attention and feed-forward layers as fsdp units, gathered again for each later call.

All (model, mode) runs share one process group: one `run_distributed` call trains them
all, so the module costs seconds, not a process start per case.
"""

from __future__ import annotations

import os

import pytest
import torch
from dist_harness import run_distributed
from torch import nn

from trainer.parallel.units import plan_units

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # configs only: nothing may reach the hub

WORLD, STEPS, BATCH = 2, 3, 8
VOCAB, SEQ, CLASSES, IMAGE = 64, 8, 5, 32
MODES = ("ddp", "zero", "fsdp")
KINDS = ("gpt2", "llama", "vit")
# The layers FSDP2 users would `fully_shard` by hand, which the default policy must find.
LAYERS = {
    "gpt2": ["transformer.h.0", "transformer.h.1"],
    "llama": ["model.layers.0", "model.layers.1"],
    "vit": ["blocks.0", "blocks.1"],
}


def build(kind: str, seed: int) -> nn.Module:
    """A tiny randomly initialised model; no dropout, so that every run is deterministic."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.manual_seed(seed)
    if kind == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(
            n_layer=2,
            n_embd=32,
            n_head=2,
            vocab_size=VOCAB,
            n_positions=16,
            bos_token_id=0,
            eos_token_id=0,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            use_cache=False,
            tie_word_embeddings=True,
        )
        return GPT2LMHeadModel(cfg)
    if kind == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=16,
            use_cache=False,
            tie_word_embeddings=True,
        )
        return LlamaForCausalLM(cfg)
    if kind == "albert":
        from transformers import AlbertConfig, AlbertForMaskedLM

        cfg = AlbertConfig(
            vocab_size=VOCAB,
            embedding_size=16,
            hidden_size=32,
            num_hidden_layers=3,  # the one layer group, three times
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=16,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            classifier_dropout_prob=0.0,
        )
        return AlbertForMaskedLM(cfg)
    import timm

    return timm.create_model(
        "vit_tiny_patch16_224",
        pretrained=False,
        img_size=IMAGE,
        patch_size=8,
        num_classes=CLASSES,
        depth=2,
        embed_dim=32,
        num_heads=2,
    )


def data(kind: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """STEPS global batches: next-token targets for the LMs, labelled images for ViT."""
    g = torch.Generator().manual_seed(1234)
    if kind == "vit":
        return [
            (
                torch.randn(BATCH, 3, IMAGE, IMAGE, generator=g),
                torch.randint(0, CLASSES, (BATCH,), generator=g),
            )
            for _ in range(STEPS)
        ]
    return [
        tuple(torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(2))
        for _ in range(STEPS)
    ]


def loss_of(out, y: torch.Tensor) -> torch.Tensor:
    logits = getattr(out, "logits", out)  # HF models return an output object
    return nn.functional.cross_entropy(logits.flatten(0, -2), y.flatten())


def sgd(params) -> torch.optim.Optimizer:
    # SGD, not AdamW: AdamW's default eps turns rounding noise of zero-gradient parameters
    # into lr-sized steps; the optimizer is not what is tested here.
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _slices(env, kind: str):
    b = BATCH // env.world_size
    for x, y in data(kind):
        yield x[env.rank * b : (env.rank + 1) * b], y[env.rank * b : (env.rank + 1) * b]


def _frozen_first_layer(model: nn.Module) -> nn.Module:
    """Fine-tuning that freezes a whole layer: under the default policy an fsdp unit with
    no parameter to shard (frozen ones stay whole on every rank)."""
    for p in model.transformer.h[0].parameters():
        p.requires_grad_(False)
    return model


# ALBERT's layer split into units (attention, each feed-forward Linear, the LayerNorms):
# each is called again after the others in every one of the layer's three runs
ALBERT_UNITS = {"unit_classes": ["AlbertAttention"], "min_unit_params": 1}


def _ours(env, kind: str, mode: str, frozen: bool = False, **options) -> tuple[dict, list[str]]:
    from trainer.parallel import build_engine

    # A fresh model per engine (fsdp empties the module's parameters), built with a
    # rank-dependent seed: rank 0's values must reach every rank at construction.
    model = build(kind, seed=env.rank)
    model = _frozen_first_layer(model) if frozen else model
    engine = build_engine(model, mode, sgd, **options)
    for x, y in _slices(env, kind):
        out = engine(x)
        engine.backward(loss_of(out, y))
        engine.step()
    units = [u.name for u in engine.units] if mode == "fsdp" else []
    if kind == "albert" and mode == "fsdp":  # the units it gathered again, with their calls
        units = [u.name for u in engine._record.again.values()]
    return engine.full_state_dict(), units


def _torch_ddp(env, kind: str, frozen: bool = False) -> dict:
    model = build(kind, seed=env.rank)
    ddp = nn.parallel.DistributedDataParallel(_frozen_first_layer(model) if frozen else model)
    opt = sgd([p for p in ddp.parameters() if p.requires_grad])
    for x, y in _slices(env, kind):
        loss_of(ddp(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in ddp.module.state_dict().items()}


def _train_all(env) -> dict:
    """Every (model, mode) pair and torch DDP per model, in this one process group."""
    out = {}
    for kind in KINDS:
        out[kind, "torch"] = _torch_ddp(env, kind)
        for mode in MODES:
            out[kind, mode] = _ours(env, kind, mode)
    out["gpt2 frozen", "torch"] = _torch_ddp(env, "gpt2", frozen=True)
    out["gpt2 frozen", "fsdp"] = _ours(env, "gpt2", "fsdp", frozen=True)
    out["albert", "torch"] = _torch_ddp(env, "albert")
    for mode in MODES:
        out["albert", mode] = _ours(env, "albert", mode, **(ALBERT_UNITS if mode == "fsdp" else {}))
    out["albert", "fsdp_keep"] = _ours(
        env, "albert", "fsdp", reshard_after_forward=False, **ALBERT_UNITS
    )
    return out


@pytest.fixture(scope="module")
def trained() -> list[dict]:
    return run_distributed(_train_all, WORLD)


# -- unit policy (no processes) -----------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_default_policy_makes_each_layer_a_unit(kind):
    model = build(kind, seed=0)
    plan = plan_units(model)
    assert [u.name for u in plan] == ["", *LAYERS[kind]]
    assert sum(len(u.params) for u in plan) == len(list(model.parameters()))
    if kind != "vit":  # the tied embedding serves the first and the last op: the root's
        tied = model.get_output_embeddings().weight
        assert tied is model.get_input_embeddings().weight
        assert any(p is tied for _, p in plan[0].params)


def test_layers_of_a_small_gpt2_were_no_units_by_size_alone():
    # Each GPT-2 layer has 12.7k parameters: the size rule alone (the policy before the
    # repetition rule) leaves the whole model in the root.
    assert [u.name for u in plan_units(build("gpt2", 0), repeated_children=False)] == [""]


# -- parity with torch DDP ----------------------------------------------------------------


def _max_diff(got: dict, want: dict) -> float:
    assert got.keys() == want.keys()  # tied names included, as in module.state_dict()
    return max((got[k].float() - want[k].float()).abs().max().item() for k in want)


@pytest.mark.slow  # ~50 s on two shared cores, most of it importing transformers and timm
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", KINDS)
def test_trains_as_torch_ddp(trained, kind, mode):
    init = build(kind, seed=0).state_dict()
    for rank, res in enumerate(trained):
        got, units = res[kind, mode]
        want = res[kind, "torch"]
        if mode == "fsdp":
            assert units == ["<root>", *LAYERS[kind]], rank
        # Both sides average the same two per-rank gradients ((a+b)/2 and a/2+b/2 are the
        # same float: halving is exact) and run the same kernels in one thread. What may
        # differ is a kernel's summation order on another memory layout (fsdp's flat
        # views): a few fp32 ulps (~1e-7 relative) of gradients of size <= 1, moved by
        # lr 0.1 with momentum (at most 1 + 1.9 + 2.71 gradients over 3 steps): < 1e-7,
        # and 1e-6 leaves room for that to pass through the next steps' forward.
        diff = _max_diff(got, want)
        assert diff <= 1e-6, (kind, mode, rank, diff)
        moved = _max_diff(want, init)
        assert moved > 1e-3, (kind, moved)  # training did change the weights
        assert _max_diff(got, trained[0][kind, mode][0]) == 0.0  # every rank: one model


@pytest.mark.slow
def test_a_frozen_layer_is_an_empty_unit_and_stays_put(trained):
    init = build("gpt2", seed=0).state_dict()
    for res in trained:
        got, units = res["gpt2 frozen", "fsdp"]
        want = res["gpt2 frozen", "torch"]
        assert units == ["<root>", *LAYERS["gpt2"]]
        assert _max_diff(got, want) <= 1e-6  # the same bound as above
        for k in got:
            if k.startswith("transformer.h.0."):
                assert torch.equal(got[k], init[k]), k


@pytest.mark.slow
@pytest.mark.parametrize("mode", [*MODES, "fsdp_keep"])
def test_albert_shares_its_layer_in_every_mode(trained, mode):
    """ALBERT runs its one layer three times; fsdp (reshard_after_forward=true) gathers
    each unit of it again for the second and third runs. Same bound as above."""
    for res in trained:
        got, again = res["albert", mode]
        assert _max_diff(got, res["albert", "torch"]) <= 1e-6, (
            mode,
            _max_diff(got, res["albert", "torch"]),
        )
        if mode == "fsdp":
            layer = "albert.encoder.albert_layer_groups.0.albert_layers.0."
            assert sorted(again) == sorted(
                layer + n for n in ("attention", "ffn", "ffn_output", "full_layer_layer_norm")
            ), again
