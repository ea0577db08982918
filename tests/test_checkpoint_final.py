"""The run's final model (train.save_final): gathered to rank 0 one zero bucket or fsdp
unit at a time ([Note: gathering to rank 0] in trainer/parallel/pieces.py), equal to
the full_state_dict() every rank gathers, in every mode, world size and precision; no
other rank holds the model, as its live tensors show."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
from dist_harness import run_distributed
from reference import any_loss

# Small buckets, so that zero has several; fsdp's units are the GPT's blocks.
CASES = [
    ("ddp", "fp32", {}),
    ("zero", "fp32", {"bucket_mb": 0.004}),
    ("fsdp", "fp32", {}),
    ("ddp", "bf16", {}),
    ("zero", "bf16", {"bucket_mb": 0.004}),
    ("fsdp", "bf16", {}),
]
# Shard groups of 2 of 4 ranks: ranks 0 and 1 hold one whole copy, 2 and 3 a replica
HYBRID = [
    ("zero", "fp32", {"bucket_mb": 0.004, "shard_group_size": 2}),
    ("fsdp", "bf16", {"shard_group_size": 2}),
]


def _engine(mode: str, precision: str, options: dict):
    from trainer.models.builtin import GPT
    from trainer.parallel import build_engine

    torch.manual_seed(0)  # tied embeddings: two state_dict keys, one parameter
    model = GPT(vocab_size=17, block_size=8, n_layer=4, n_head=2, n_embd=16, tie_weights=True)
    sgd = functools.partial(torch.optim.SGD, lr=0.5)
    return build_engine(model, mode, sgd, precision=precision, **options)


def _known(engine) -> list[torch.Tensor]:
    """Every tensor the engine holds: what exists before the final model is written."""
    kinds = engine.state_tensors()
    held = [t for ts in kinds.values() for t in ts if torch.is_tensor(t)]
    held += [g.local for g in engine.shard_groups()]
    return held + list(engine.module.state_dict(keep_vars=True).values())


def _final_models(env, root: Path, cases: list) -> list[dict]:
    from trainer.estimate.activations import LiveBytes
    from trainer.run.final import save_final_model

    out = []
    for mode, precision, options in cases:
        engine = _engine(mode, precision, options)
        g = torch.Generator().manual_seed(1)
        x = torch.randint(0, 17, (env.world_size * 2, 8), generator=g)
        x = x.chunk(env.world_size)[env.rank]
        engine.backward(any_loss(engine(x[:, :-1]), x[:, 1:]))  # one step: masters move
        engine.step()
        want = engine.full_state_dict()  # every rank gathers the whole model
        groups = [gr.layout.padded_numel * gr.local.element_size() for gr in engine.shard_groups()]
        hybrid = "shard_group_size" in options
        path = root / f"{mode}_{precision}_p{env.world_size}_{hybrid}.pt"
        with LiveBytes(_known(engine)) as final:
            save_final_model(engine, path, env.rank == 0)
        with LiveBytes(_known(engine)) as every:  # what the same measure sees of the above
            engine.full_state_dict()
        got = torch.load(path, weights_only=True) if env.rank == 0 else None
        out.append(
            {"case": (mode, precision, hybrid), "want": want, "got": got, "final": final.peak,
             "every": every.peak, "group": max(groups)}
        )  # fmt: skip
    return out


def _check(results: list[list[dict]]) -> None:
    for rank, cases in enumerate(results):
        for r in cases:
            case, want = r["case"], r["want"]
            model = sum(t.nbytes for t in {id(t): t for t in want.values()}.values())
            assert r["group"] < model / 2, case  # several groups: a bound that can fail
            assert r["every"] >= model, (case, r["every"], model)  # the old way, measured
            if rank == 0:
                got = r["got"]
                assert list(got) == list(want), case  # the keys, in state_dict order
                for k in want:
                    assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), (case, k)
                # tied weights stay one tensor
                assert got["lm_head.weight"].data_ptr() == got["wte.weight"].data_ptr()
                # rank 0 holds what it writes, plus the group arriving: never two groups
                assert r["final"] < model + 2 * r["group"], (case, r["final"], model, r["group"])
            else:
                # the slices it already held are sent; at most one group ever lives here
                assert r["final"] <= r["group"], (case, r["final"], r["group"])


@pytest.mark.parametrize("world", [2, 3])
def test_final_model_gathers_to_rank0_one_group_at_a_time(tmp_path, world):
    _check(run_distributed(_final_models, world, tmp_path, CASES))


def test_final_model_with_shard_groups(tmp_path):
    _check(run_distributed(_final_models, 4, tmp_path, HYBRID))


def test_a_hugging_face_final_model_is_a_directory_from_pretrained_loads(tmp_path):
    """What final_model/ holds for model=hf, from a module computing in bf16: fp32 values,
    split above the shard size, tied weights once, loaded as they are; and that it is the
    only copy of the final model the run leaves (a built-in model's is final_model.pt)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from trainer.models.builtin import GPT
    from trainer.models.lm import CausalLM
    from trainer.run.final import final_model_path, save_final_model, write_hf_dir

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True,
    )  # fmt: skip
    model = CausalLM(LlamaForCausalLM(config))
    copies: dict[int, torch.Tensor] = {}  # tied weights: one tensor, as gathered
    want = {
        k: copies.setdefault(id(v), v.detach().clone())
        for k, v in model.state_dict(keep_vars=True).items()
    }
    model.to(torch.bfloat16)  # as an engine casts it for precision=bf16
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "meta.json").write_text('{"vocab_size": 64}')
    write_hf_dir(model, dict(want), tmp_path / "final_model", tmp_path / "model", "20KB")
    out = tmp_path / "final_model"
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) > 1 and "lm_head.weight" not in index
    assert (out / "meta.json").is_file() and not list(tmp_path.glob("final_model.tmp-*"))
    loaded = AutoModelForCausalLM.from_pretrained(out)
    for k, v in loaded.state_dict().items():
        assert v.dtype == torch.float32 and torch.equal(v, want[f"hf.{k}"]), k

    class Engine:  # what save_final_model asks of an engine, on rank 0
        module = model

        def full_state_dict(self, rank0_only: bool = False):
            return dict(want)

    run = tmp_path / "run"
    run.mkdir()
    path = final_model_path(run, model)
    save_final_model(Engine(), path, True, tmp_path / "model")
    assert path == run / "final_model" and [p.name for p in run.iterdir()] == ["final_model"]
    loaded = AutoModelForCausalLM.from_pretrained(path)
    assert all(torch.equal(v, want[f"hf.{k}"]) for k, v in loaded.state_dict().items())
    assert final_model_path(run, GPT()) == run / "final_model.pt"
