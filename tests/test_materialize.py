"""trainer/models/materialize.py: models built on the meta device, given values module by module."""

import math

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

from trainer.errors import ConfigError
from trainer.models.builtin import GPT, MLP, SmallCNN
from trainer.models.lm import CausalLM
from trainer.models.materialize import Request, SeededInit, empty_weights, has_meta, materialize

LLAMA = dict(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    tie_word_embeddings=True,
)  # fmt: skip
GPT2 = dict(
    vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0
)


def gpt() -> GPT:
    return GPT(vocab_size=48, block_size=16, n_layer=2, n_head=2, n_embd=32, tie_weights=True)


def llama() -> CausalLM:
    return CausalLM(AutoModelForCausalLM.from_config(LlamaConfig(**LLAMA), dtype=torch.float32))


def gpt2() -> CausalLM:
    return CausalLM(AutoModelForCausalLM.from_config(GPT2Config(**GPT2), dtype=torch.float32))


def mlp() -> MLP:  # torch's own reset_parameters (kaiming-uniform)
    return MLP(in_dim=32, hidden=64, depth=2)


BUILDERS = {"gpt": gpt, "llama": llama, "gpt2": gpt2, "mlp": mlp}


def empty(build):
    with empty_weights():
        return build()


def units(model: nn.Module) -> list[list[tuple[str, nn.Module]]]:
    """The model's modules cut into units as fsdp would: one per transformer block (or
    layer), the rest in a last one."""
    blocks = [
        n for n, m in model.named_modules() if n.rsplit(".", 1)[-1].isdigit() and "." in n
    ] or [n for n, _ in model.named_children()]
    groups = {b: [] for b in blocks}
    rest = []
    for name, m in model.named_modules():
        home = next((b for b in blocks if name == b or name.startswith(b + ".")), None)
        (groups[home] if home else rest).append((name, m))
    return [*groups.values(), rest]


def fill_by_units(model, seed: int, pieces_of) -> dict[str, torch.Tensor]:
    """Every parameter's values gathered from fills unit by unit, each parameter cut into
    `pieces_of(name)` ranges (one request each, as ranks of an fsdp shard group ask). A
    tied parameter is asked for by the last unit that holds one of its modules, not by
    its owner's unit."""
    params = dict(model.named_parameters())
    holder = {}
    for i, unit in enumerate(units(model)):
        for _, m in unit:
            for p in m.parameters(recurse=False):
                holder[id(p)] = i
    got = {n: torch.empty(p.numel()) for n, p in params.items()}
    for i, unit in enumerate(units(model)):
        requests = []
        for name, p in params.items():
            if holder[id(p)] != i:
                continue
            k = pieces_of(name)
            bounds = [p.numel() * j // k for j in range(k + 1)]
            for a, b in zip(bounds[:-1], bounds[1:], strict=True):
                requests.append(Request(name, p, a, b, got[name][a:b]))
        SeededInit(seed).fill(model, unit, requests, "cpu")
    return got


# --------------------------------------------------------------------------------------
# Building empty


def test_empty_weights_puts_parameters_on_meta_and_keeps_buffers():
    model = empty(lambda: SmallCNN(width=4))
    assert all(p.is_meta for p in model.parameters())
    assert all(not b.is_meta for b in model.buffers())  # BatchNorm's statistics
    assert has_meta(model)
    tied = empty(gpt)
    assert tied.lm_head.weight is tied.wte.weight
    assert not has_meta(SmallCNN(width=4))  # the patch is gone after the block


def test_has_meta_refuses_a_model_partly_on_meta():
    model = MLP(in_dim=4, hidden=4, depth=2)
    model.head = nn.Linear(4, 10, device="meta")
    with pytest.raises(ConfigError, match=r"on the meta device \(head.weight\).*not \(layers"):
        has_meta(model)


# --------------------------------------------------------------------------------------
# SeededInit: the same values however the work is cut


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_seeded_init_is_the_same_in_every_grouping_and_slicing(name):
    build = BUILDERS[name]
    whole = materialize(empty(build), SeededInit(7), "cpu")
    expected = {n: p.detach().reshape(-1) for n, p in whole.named_parameters()}
    model = empty(build)
    rng = torch.get_rng_state()
    for k in (1, 2, 3, 4):  # the same cut for every parameter, as k ranks
        got = fill_by_units(model, 7, lambda _, k=k: k)
        assert got.keys() == expected.keys()
        for n in expected:
            assert torch.equal(got[n], expected[n]), (k, n)
    # A different number of pieces per parameter, all modules in one call.
    sizes = {n: 1 + i % 4 for i, n in enumerate(expected)}
    got = fill_by_units_all_at_once(model, 7, sizes)
    for n in expected:
        assert torch.equal(got[n], expected[n]), n
    assert torch.equal(torch.get_rng_state(), rng)  # the caller's RNG stream is untouched
    assert all(p.is_meta for p in model.parameters())  # nothing left allocated
    other = materialize(empty(build), SeededInit(8), "cpu")
    assert not torch.equal(next(other.parameters()), next(whole.parameters()))


def fill_by_units_all_at_once(model, seed, sizes):
    got = {}
    requests = []
    for name, p in model.named_parameters():
        got[name] = torch.empty(p.numel(), dtype=torch.float64)  # out's dtype is the caller's
        k = sizes[name]
        bounds = [p.numel() * j // k for j in range(k + 1)]
        for a, b in zip(bounds[:-1], bounds[1:], strict=True):
            requests.append(Request(name, p, a, b, got[name][a:b]))
    SeededInit(seed).fill(model, list(model.named_modules()), requests, "cpu")
    return {n: t.float() for n, t in got.items()}


@pytest.mark.parametrize("name", ["gpt", "llama", "gpt2", "mlp"])
def test_seeded_init_has_the_ordinary_build_statistics(name):
    build = BUILDERS[name]
    torch.manual_seed(0)
    ordinary = dict(build().named_parameters())
    seeded = dict(materialize(empty(build), SeededInit(0), "cpu").named_parameters())
    assert seeded.keys() == ordinary.keys()
    for n, a in ordinary.items():
        a, b = a.detach().double().reshape(-1), seeded[n].detach().double().reshape(-1)
        if a.std() == 0:  # a constant (ones, zeros): no randomness, equal exactly
            assert torch.equal(a, b), n
            continue
        # Two independent samples of N elements of one distribution with std s: each
        # sample mean has std s/sqrt(N), so their difference s*sqrt(2/N); each sample std
        # has std about s/sqrt(2N) (normal; less for the uniform of reset_parameters), so
        # their difference s/sqrt(N). Six of those: a false failure in ~1e-9 per tensor,
        # while GPT-2's rescaled c_proj (std halved) would miss by far more.
        s, N = float(a.std()), a.numel()
        assert abs(float(a.mean() - b.mean())) < 6 * s * math.sqrt(2 / N), n
        assert abs(float(a.std() - b.std())) < 6 * s / math.sqrt(N), n


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_ties_stay_one_parameter(name):
    model = materialize(empty(BUILDERS[name]), SeededInit(0), "cpu")
    head, emb = (
        (model.lm_head, model.wte)
        if name == "gpt"
        else (model.hf.lm_head, model.hf.model.embed_tokens)
    )
    assert head.weight is emb.weight
    assert len(list(model.parameters())) == len(list(model.named_parameters()))
    assert model(torch.randint(48, (1, 8))).shape[-1] in (48, 64)


def test_llama_built_on_the_meta_device_gets_its_rotary_buffers_back():
    with torch.device("meta"):
        model = llama()
    assert model.hf.model.rotary_emb.inv_freq.is_meta
    materialize(model, SeededInit(0), "cpu")
    ordinary = llama().hf.model.rotary_emb
    rotary = model.hf.model.rotary_emb
    assert torch.equal(rotary.inv_freq, ordinary.inv_freq)
    assert torch.equal(rotary.original_inv_freq, ordinary.original_inv_freq)
    assert not has_meta(model) and not any(b.is_meta for b in model.buffers())
    logits = model(torch.randint(64, (1, 8)))
    assert torch.isfinite(logits).all()


# --------------------------------------------------------------------------------------
# Refusals


class _Scaled(nn.Module):
    """A Linear and a buffer that reset_parameters does not compute."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.register_buffer("scale", torch.full((4,), 2.0))

    def reset_parameters(self) -> None:
        pass


class _Bare(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(4))


def test_a_meta_buffer_its_init_does_not_restore_is_refused():
    with torch.device("meta"):
        model = nn.Sequential(_Scaled())
    with pytest.raises(
        ConfigError, match=r"buffer 0\.scale of module 0 \(_Scaled\).*empty_weights"
    ):
        materialize(model, SeededInit(0), "cpu")
    with empty_weights():  # built so, the buffer stays real and needs no init
        model = nn.Sequential(_Scaled())
    materialize(model, SeededInit(0), "cpu")
    assert torch.equal(model[0].scale, torch.full((4,), 2.0))


def test_a_module_with_parameters_and_no_init_is_refused():
    with empty_weights():
        model = nn.Sequential(nn.Linear(4, 4), _Bare())
    with pytest.raises(ConfigError, match=r"module 1 \(_Bare\) has parameter gain and no init"):
        materialize(model, SeededInit(0), "cpu")


def test_a_tied_weight_asked_for_by_another_unit_gets_its_owners_values():
    expected = materialize(empty(gpt), SeededInit(3), "cpu").wte.weight.detach().reshape(-1)
    model = empty(gpt)
    out = torch.empty(model.wte.weight.numel())
    # The head's unit asks for the tied weight, named as its owner (the embedding) has it.
    request = Request("wte.weight", model.lm_head.weight, 0, out.numel(), out)
    SeededInit(3).fill(model, [("lm_head", model.lm_head)], [request], "cpu")
    assert torch.equal(out, expected)


def test_fill_leaves_real_parameters_alone():
    model = gpt()
    request = Request("ln_f.weight", model.ln_f.weight, 0, 1, torch.empty(1))
    with pytest.raises(ValueError, match="ln_f.weight: the parameter is not on the meta"):
        SeededInit(0).fill(model, [("ln_f", model.ln_f)], [request], "cpu")
    with pytest.raises(ValueError, match="module ln_f's parameters on the meta device"):
        SeededInit(0).fill(model, [("ln_f", model.ln_f)], [], "cpu")
