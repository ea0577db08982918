"""trainer/models/weights.py: safetensors checkpoints read slice by slice into models on meta."""

import json
import random

import pytest
import torch
from safetensors.torch import load_file, save_file, save_model
from transformers import AutoModelForCausalLM, LlamaConfig

from trainer.errors import ConfigError
from trainer.models.builtin import GPT, SmallCNN
from trainer.models.lm import CausalLM
from trainer.models.materialize import Request, SeededInit, empty_weights, materialize
from trainer.models.weights import Pretrained, WeightFiles

LLAMA = dict(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    tie_word_embeddings=True,
)  # fmt: skip


def empty_llama(**changes) -> CausalLM:
    with empty_weights():
        config = LlamaConfig(**{**LLAMA, **changes})
        return CausalLM(AutoModelForCausalLM.from_config(config, dtype=torch.float32))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny Llama saved by save_pretrained: one file, and sharded (with an index)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**LLAMA), dtype=torch.float32)
    single, sharded = tmp_path_factory.mktemp("single"), tmp_path_factory.mktemp("sharded")
    model.save_pretrained(str(single))
    model.save_pretrained(str(sharded), max_shard_size="20KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    return {"single": single, "sharded": sharded}


def saved_tensors(directory) -> dict[str, torch.Tensor]:
    out = {}
    for f in directory.glob("*.safetensors"):
        out.update(load_file(str(f)))
    return out


@pytest.mark.parametrize("layout", ["single", "sharded"])
def test_slices_are_the_saved_tensors_flattened_slices(saved, layout):
    files = WeightFiles(saved[layout])
    tensors = saved_tensors(saved[layout])
    assert sorted(files.keys()) == sorted(tensors)
    assert "lm_head.weight" not in tensors  # save_pretrained keeps one of a tied pair
    rng = random.Random(0)
    for key, t in tensors.items():
        assert files.shape(key) == tuple(t.shape)
        assert torch.equal(files.read(key), t.reshape(-1))
        for _ in range(5):
            a = rng.randrange(t.numel() + 1)
            b = rng.randrange(a, t.numel() + 1)
            assert torch.equal(files.read(key, a, b), t.reshape(-1)[a:b]), (key, a, b)


def test_a_slice_reads_only_the_rows_covering_it(tmp_path):
    big = torch.randn(2000, 50)  # 100,000 elements
    cube = torch.randn(10, 3, 7)
    save_file(
        {"big": big, "cube": cube, "scalar": torch.tensor(3.0)}, tmp_path / "model.safetensors"
    )
    files = WeightFiles(tmp_path)

    def read(key, start, stop):  # the values, and how many elements the file gave
        before = files.elements_read
        return files.read(key, start, stop), files.elements_read - before

    got, n = read("big", 12345, 12399)
    assert torch.equal(got, big.reshape(-1)[12345:12399]) and n == 2 * 50  # 2 rows, not 2000
    got, n = read("big", 100, 150)
    assert torch.equal(got, big[2]) and n == 50
    got, n = read("cube", 20, 50)
    assert torch.equal(got, cube.reshape(-1)[20:50]) and n == 3 * 21  # rows of 21 elements
    assert read("big", 7, 7)[0].numel() == 0
    assert torch.equal(files.read("scalar"), torch.tensor([3.0]))
    with pytest.raises(ValueError, match=r"big: range \[5, 100001\)"):
        files.read("big", 5, 100_001)


@pytest.mark.parametrize("layout", ["single", "sharded"])
def test_pretrained_gives_the_logits_of_from_pretrained(saved, layout):
    reference = AutoModelForCausalLM.from_pretrained(str(saved[layout]), dtype=torch.float32)
    model = materialize(empty_llama(), Pretrained(saved[layout]), "cpu")
    assert model.hf.lm_head.weight is model.hf.model.embed_tokens.weight
    idx = torch.randint(64, (2, 12))
    with torch.no_grad():
        assert torch.equal(model(idx), reference(input_ids=idx).logits)


def test_pretrained_fills_slices_unit_by_unit(saved):
    source, model = Pretrained(saved["sharded"]), empty_llama()
    tensors = saved_tensors(saved["single"])
    for i, (name, p) in enumerate(model.named_parameters()):
        k = 1 + i % 4
        bounds = [p.numel() * j // k for j in range(k + 1)]
        ranges = list(zip(bounds[:-1], bounds[1:], strict=True))
        outs = [torch.empty(b - a, dtype=torch.float64) for a, b in ranges]
        requests = [Request(name, p, a, b, o) for (a, b), o in zip(ranges, outs, strict=True)]
        owner = name.rsplit(".", 1)[0]
        source.fill(model, [(owner, model.get_submodule(owner))], requests, "cpu")
        assert torch.equal(torch.cat(outs).float(), tensors[name[len("hf.") :]].reshape(-1))
    assert all(p.is_meta for p in model.parameters())


def test_our_gpt_and_persistent_buffers_load_with_their_module_keys(tmp_path):
    """What scripts/export_hf.py writes for model=gpt: the module's keys, ties once."""
    torch.manual_seed(0)
    gpt = GPT(vocab_size=48, block_size=16, n_layer=2, n_head=2, n_embd=32, tie_weights=True)
    save_model(gpt, str(tmp_path / "model.safetensors"))
    with empty_weights():
        loaded = GPT(vocab_size=48, block_size=16, n_layer=2, n_head=2, n_embd=32, tie_weights=True)
    materialize(loaded, Pretrained(tmp_path), "cpu")
    assert loaded.lm_head.weight is loaded.wte.weight
    for (n, a), b in zip(gpt.state_dict().items(), loaded.state_dict().values(), strict=True):
        assert torch.equal(a, b), n
    cnn = SmallCNN(width=4)
    cnn.blocks[0].bn.running_mean.uniform_()  # a value no init would give
    (tmp_path / "cnn").mkdir()
    save_model(cnn, str(tmp_path / "cnn" / "model.safetensors"))
    with empty_weights():
        loaded = SmallCNN(width=4)
    materialize(loaded, Pretrained(tmp_path / "cnn"), "cpu")
    for (n, a), b in zip(cnn.state_dict().items(), loaded.state_dict().values(), strict=True):
        assert torch.equal(a, b), n


# --------------------------------------------------------------------------------------
# Refusals


def rewrite(saved, tmp_path, change) -> str:
    tensors = saved_tensors(saved["single"])
    change(tensors)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    return tmp_path


def test_missing_and_unexpected_keys_are_named(saved, tmp_path):
    def change(t):
        del t["model.norm.weight"]
        t["model.extra.weight"] = torch.zeros(2)

    with pytest.raises(ConfigError) as e:
        materialize(empty_llama(), Pretrained(rewrite(saved, tmp_path, change)), "cpu")
    line = str(e.value)
    assert "\n" not in line
    assert "missing 1 key: model.norm.weight" in line
    assert "unexpected (not in the model) 1 key: model.extra.weight" in line


def test_many_missing_keys_are_counted(saved, tmp_path):
    directory = rewrite(saved, tmp_path, lambda t: [t.pop(k) for k in list(t) if "layers" in k])
    with pytest.raises(
        ConfigError, match=r"missing 18 keys: model\.layers\.0\..*and 13 more \(file keys"
    ):
        Pretrained(directory).check(empty_llama())


def test_keys_transformers_ignores_are_not_unexpected(saved, tmp_path):
    # Older Llama checkpoints saved each layer's rotary inv_freq; transformers 5 skips it.
    def change(t):
        t["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)

    model = materialize(empty_llama(), Pretrained(rewrite(saved, tmp_path, change)), "cpu")
    assert not any(p.is_meta for p in model.parameters())


def test_other_shapes_are_named_with_both(saved):
    with pytest.raises(
        ConfigError, match=r"gate_proj\.weight \(file \(64, 32\), model \(96, 32\)\)"
    ):
        Pretrained(saved["single"]).check(empty_llama(intermediate_size=96))


def test_a_meta_buffer_that_is_not_saved_is_refused(saved):
    with torch.device("meta"):
        config = LlamaConfig(**LLAMA)
        model = CausalLM(AutoModelForCausalLM.from_config(config, dtype=torch.float32))
    with pytest.raises(
        ConfigError, match=r"buffer hf\.model\.rotary_emb\.inv_freq .*empty_weights"
    ):
        materialize(model, Pretrained(saved["single"]), "cpu")


@pytest.mark.parametrize(
    "name,advice",
    [
        ("pytorch_model.bin", r"save_pretrained\(OUT\) writes safetensors"),
        ("pytorch_model.bin.index.json", r"save_pretrained\(OUT\) writes safetensors"),
        ("final_model.pt", r"scripts/export_hf\.py"),
    ],
)
def test_pickled_weights_are_refused_with_how_to_convert(tmp_path, name, advice):
    # transformers 5 writes safetensors whatever safe_serialization says: torch.save it.
    if name.endswith(".json"):
        (tmp_path / name).write_text(json.dumps({"weight_map": {}}))
    else:
        torch.save(SmallCNN(width=4).state_dict(), tmp_path / name)
    with pytest.raises(ConfigError, match=rf"{name} is a pickle .*{advice}"):
        WeightFiles(tmp_path)


def test_no_weights_names_the_directory_and_the_files(tmp_path):
    with pytest.raises(ConfigError, match=rf"no weights in {tmp_path}: looked for model"):
        WeightFiles(tmp_path)
    with pytest.raises(ConfigError, match="is not a directory"):
        WeightFiles(tmp_path / "nowhere")


def test_keys_allowed_missing_take_init_values(saved, tmp_path):
    directory = rewrite(saved, tmp_path, lambda t: t.pop("model.norm.weight"))
    model = empty_llama()
    model.hf._keys_to_ignore_on_load_missing = {r"model\.norm\.weight"}
    with pytest.raises(ConfigError, match="missing 1 key: model.norm.weight; .* init=SeededInit"):
        Pretrained(directory).check(model)  # no init to give it values
    materialize(model, Pretrained(directory, init=SeededInit(0)), "cpu")
    assert torch.equal(model.hf.model.norm.weight, torch.ones(32))  # RMSNorm's init
