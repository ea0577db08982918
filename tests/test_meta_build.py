"""Models built on the meta device ([Note: building on meta] in trainer/parallel/__init__.py):
each mode allocates only what it keeps, the initial model does not depend on the mode or
the world size, and pretrained weights are read slice by slice into it."""

from __future__ import annotations

import functools

import pytest
import torch
from dist_harness import run_distributed
from torch import nn

from trainer.errors import ConfigError

WORLD_SIZES = (1, 2, 3, 4)  # 3: shards of uneven parameters
FSDP = {"min_unit_params": 1000}  # every block its own unit, on these small models
LLAMA = dict(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    tie_word_embeddings=True,
)  # fmt: skip


class Frozen(nn.Module):
    """A GPT with a frozen, whole-kept part and a BatchNorm (real buffers) on top."""

    def __init__(self) -> None:
        super().__init__()
        from trainer.models.builtin import GPT

        self.gpt = GPT(
            vocab_size=37, block_size=8, n_layer=3, n_head=2, n_embd=16, tie_weights=True
        )
        self.frozen = nn.Linear(37, 5)
        self.frozen.requires_grad_(False)
        self.norm = nn.BatchNorm1d(5)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.norm(self.frozen(self.gpt(idx)).flatten(0, 1))


def _sgd():
    return functools.partial(torch.optim.SGD, lr=0.1)


def _engine(model, mode: str, source=None, **options):
    from trainer.parallel import build_engine

    extra = FSDP if mode == "fsdp" else {}
    return build_engine(model, mode, _sgd(), source=source, device="cpu", **extra, **options)


def _initial_states(env) -> dict:
    """full_state_dict() right after a meta build with SeededInit, per mode; and one step
    of the meta-built engine next to an eager engine given the same initial values."""
    from trainer.models.materialize import SeededInit, empty_weights

    out = {}
    cases = [("ddp", {}), ("zero", {}), ("fsdp", {}), ("fsdp_bf16", {"precision": "bf16"})]
    if env.world_size == 4:
        cases.append(("fsdp_hybrid", {"shard_group_size": 2}))
    for name, options in cases:
        mode = name.split("_")[0]
        with empty_weights():
            model = Frozen()
        engine = _engine(model, mode, SeededInit(3), **options)
        out[name] = engine.full_state_dict()
    # The meta-built engine trains as the eager one from the same values (exactly: the
    # same code runs after construction).
    x = torch.randint(0, 37, (4, 8), generator=torch.Generator().manual_seed(env.rank))
    for mode in ("zero", "fsdp"):
        with empty_weights():
            meta_model = Frozen()
        eager_model = Frozen()
        eager_model.load_state_dict(out["ddp"])
        engines = [_engine(meta_model, mode, SeededInit(3)), _engine(eager_model, mode)]
        for e in engines:
            e(x).square().mean().backward()
            e.step()
        out[f"{mode}_step"] = [e.full_state_dict() for e in engines]
    return out


@pytest.mark.slow
def test_initial_model_is_bitwise_the_same_in_every_mode_and_world_size():
    reference = None
    for p in WORLD_SIZES:
        results = run_distributed(_initial_states, p)
        for rank, got in enumerate(results):
            if reference is None:
                reference = got["ddp"]
                # tied head and embedding saved as one parameter's values under both keys
                assert torch.equal(reference["gpt.lm_head.weight"], reference["gpt.wte.weight"])
                assert reference["gpt.wte.weight"].std() > 0  # initialised, not zeros
            for name in [k for k in got if not k.endswith("_step")]:
                state = got[name]
                assert state.keys() == reference.keys()
                for k in reference:
                    assert torch.equal(state[k], reference[k]), (p, rank, name, k)
            for mode in ("zero", "fsdp"):
                meta_built, eager = got[f"{mode}_step"]
                for k in eager:
                    assert torch.equal(meta_built[k], eager[k]), (p, rank, mode, k)


def _save_llama(directory, shard_size: str | None = None) -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**LLAMA), dtype=torch.float32)
    if shard_size:
        model.save_pretrained(str(directory), max_shard_size=shard_size)
    else:
        model.save_pretrained(str(directory))


def _llama_logits(env, directory: str) -> dict:
    """Logits of a Llama (rotary, tied embeddings) built on meta and loaded slice by slice,
    in each mode; and one built entirely under torch.device("meta") from SeededInit."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from trainer.models.lm import CausalLM
    from trainer.models.materialize import SeededInit, empty_weights
    from trainer.models.weights import Pretrained

    config = AutoConfig.from_pretrained(directory, local_files_only=True)
    ids = torch.arange(12).reshape(2, 6) % LLAMA["vocab_size"]
    out = {}
    for mode in ("ddp", "zero", "fsdp"):
        with empty_weights():
            model = CausalLM(AutoModelForCausalLM.from_config(config, dtype=torch.float32))
        engine = _engine(model, mode, Pretrained(directory)).eval()
        with torch.no_grad():
            out[mode] = engine(ids)
        hf = engine.module.hf
        out[f"{mode}_tied"] = hf.lm_head.weight is hf.model.embed_tokens.weight
    with torch.device("meta"):  # buffers too: the modules' own init restores inv_freq
        model = CausalLM(AutoModelForCausalLM.from_config(config, dtype=torch.float32))
    engine = _engine(model, "fsdp", SeededInit(1))
    out["rotary"] = engine.module.hf.model.rotary_emb.inv_freq.clone()
    out["seeded"] = engine.full_state_dict()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["single", "sharded"])
def test_llama_loaded_slice_by_slice_equals_from_pretrained(tmp_path, layout):
    from transformers import AutoModelForCausalLM

    _save_llama(tmp_path, "20KB" if layout == "sharded" else None)
    if layout == "sharded":
        assert (tmp_path / "model.safetensors.index.json").is_file()
    want_model = AutoModelForCausalLM.from_pretrained(str(tmp_path), local_files_only=True)
    ids = torch.arange(12).reshape(2, 6) % LLAMA["vocab_size"]
    with torch.no_grad():
        want = want_model(input_ids=ids, use_cache=False).logits
    inv_freq = want_model.model.rotary_emb.inv_freq
    seeded = None
    for p in (1, 2, 4):
        for got in run_distributed(_llama_logits, p, str(tmp_path)):
            for mode in ("ddp", "zero", "fsdp"):
                # the same weights and the same arithmetic as from_pretrained's model
                assert torch.equal(got[mode], want), (p, mode)
                assert got[f"{mode}_tied"], (p, mode)
            assert torch.equal(got["rotary"], inv_freq)
            seeded = seeded or got["seeded"]
            assert all(torch.equal(got["seeded"][k], seeded[k]) for k in seeded)


def _refusals(env) -> list[str]:
    from trainer.models.materialize import SeededInit, empty_weights
    from trainer.parallel import build_engine

    messages = []
    with empty_weights():
        meta = Frozen()
    partly = Frozen()
    partly.gpt.wte.weight = nn.Parameter(torch.empty(partly.gpt.wte.weight.shape, device="meta"))
    for model, mode, source in [
        (meta, "fsdp", None),  # no source of values
        (Frozen(), "ddp", SeededInit(0)),  # values already there
        (partly, "zero", SeededInit(0)),
    ]:
        try:
            build_engine(model, mode, _sgd(), source=source)
            messages.append("built")
        except ConfigError as e:
            messages.append(str(e))
    return messages


def test_a_meta_model_without_a_source_is_refused_in_one_line():
    no_source, has_values, partly = run_distributed(_refusals, 1)[0]
    assert "meta device: give build_engine a source=SeededInit(seed)" in no_source
    assert "already have values" in has_values
    assert "(gpt.wte.weight)" in partly and "others that are not" in partly
    assert all("\n" not in m for m in (no_source, has_values, partly))


def _build_peak(env, meta: bool) -> dict:
    """Growth of this process's C heap while the model is built and the fsdp engine made
    ([Note: the CPU step peak] in trainer/observe/heap.py): live tensors, measured."""
    from trainer.models.builtin import GPT
    from trainer.models.materialize import SeededInit, empty_weights
    from trainer.observe import heap

    sizes = dict(vocab_size=256, block_size=16, n_layer=16, n_head=4, n_embd=128)
    with heap.HeapPeak() as peak:
        if meta:
            with empty_weights():
                model = GPT(**sizes)
            engine = _engine(model, "fsdp", SeededInit(0))
        else:
            engine = _engine(GPT(**sizes), "fsdp")
    units = [sum(b.layout.padded_numel for b in u.flat_buffers) for u in engine.units]
    return {
        "growth": peak.growth,
        "psi": sum(b.layout.numel for u in engine.units for b in u.flat_buffers),
        "largest_unit": max(units),
    }


@pytest.mark.slow
def test_fsdp_built_on_meta_allocates_its_slices_not_the_model():
    from trainer.observe import heap

    if not heap.available():
        pytest.skip("the C heap size needs glibc's mallinfo2()")
    p = 4
    meta = run_distributed(_build_peak, p, True)
    eager = run_distributed(_build_peak, p, False)
    for m, e in zip(meta, eager, strict=True):
        model_bytes = 4 * m["psi"]
        # Eager: the whole model exists on every rank before it is sharded.
        assert e["growth"] >= model_bytes
        # Meta: this rank's fp32 slices (4Ψ/P) plus, one at a time, one unit's buffer
        # and its module's parameters while they are initialised (each at most the
        # largest unit), and 3 MiB for what else the process allocates meanwhile (Python
        # objects, Gloo's buffers: the C heap counts them too; about 1 MiB seen here).
        bound = model_bytes / p + 2 * 4 * m["largest_unit"] + 3 * 2**20
        assert m["growth"] <= bound, (m, bound)
        assert m["growth"] < model_bytes / 2  # never the whole model


def _hooks(env) -> dict:
    """A gradient hook registered on a meta parameter before the build (refused), after a
    meta build, and before an ordinary build (both must run), in each mode."""
    from trainer.models.materialize import SeededInit, empty_weights
    from trainer.run.loop import forward_backward

    out = {}
    x = torch.randint(37, (2, 8))
    y = torch.randint(37, (2, 8))
    for mode in ("ddp", "zero", "fsdp"):
        with empty_weights():
            model = Frozen().gpt
        model.wte.weight.register_post_accumulate_grad_hook(lambda p: None)
        try:
            _engine(model, mode, SeededInit(0))
            out[f"{mode} before meta"] = "built"
        except ConfigError as e:
            out[f"{mode} before meta"] = str(e)
        for when in ("after meta", "before eager"):
            fired = []
            if when == "after meta":
                with empty_weights():
                    model = Frozen().gpt
                engine = _engine(model, mode, SeededInit(0))
                model.lm_head.weight.register_hook(lambda g, fired=fired: fired.append("pre") or g)
            else:
                model = Frozen().gpt
                model.lm_head.weight.register_hook(lambda g, fired=fired: fired.append("pre") or g)
                engine = _engine(model, mode)
            forward_backward(engine, x, y, 1)
            out[f"{mode} {when}"] = fired
    return out


def test_a_hook_on_a_meta_parameter_is_refused_and_hooks_otherwise_run():
    got = run_distributed(_hooks, 1)[0]
    for mode in ("ddp", "zero", "fsdp"):
        assert got[f"{mode} before meta"] == (
            "parameter wte.weight has a gradient hook registered on the meta device; "
            "building gives it a new tensor, which would drop the hook: register hooks "
            "after build_engine"
        ), got
        assert got[f"{mode} after meta"] == ["pre"], got
        assert got[f"{mode} before eager"] == ["pre"], got
