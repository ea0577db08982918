"""From a text file to a sample and an exported directory, as the commands of docs/own_text.md do:
prepare_text, train.py on data=token_file with model=gpt and model=hf, sample.py,
export_hf.py. Hugging Face directories are written here with save_pretrained from small
configs (random init); nothing is downloaded."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from dist_harness import run_distributed
from tb_events import texts
from test_cli import run_cli, scalars

from trainer.errors import ConfigError

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from export_hf import export  # noqa: E402
from prepare_text import prepare  # noqa: E402
from sample import sample  # noqa: E402

TEXT = "".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(300))
GPT = ["model=gpt", "data=token_file", "model.n_embd=32", "train.batch_size=8"]
TRAIN = ["train.log_every=2", "train.eval_every=4", "train.eval_batches=2", "optim.lr=3e-3"]


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("text")
    half = TEXT.index("def f150")  # two documents: a separator between them
    (root / "code_a.txt").write_text(TEXT[:half])
    (root / "code_b.txt").write_text(TEXT[half:])
    prepare([root / "code_a.txt", root / "code_b.txt"], root / "char", "char", 0.1)
    return root / "char"


def _run(tmp: Path, name: str, *args: str, nproc: int | None = None) -> Path:
    run_dir = tmp / name
    proc = run_cli([f"hydra.run.dir={run_dir}", *TRAIN, *args], nproc=nproc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


def test_gpt_on_own_text_resumes_bitwise_samples_and_exports(tmp_path, text_dir):
    data = f"data.dir={text_dir}"
    whole = _run(tmp_path, "whole", *GPT, data, "train.steps=8")
    halves = _run(tmp_path, "halves", *GPT, data, "train.steps=4")

    # Other text of the same length and characters (the same token count and vocabulary):
    # refused in one line, the checkpoint left as it was ([Note: what the data is]).
    checkpoints = halves / "checkpoints"
    before = {p: p.read_bytes() for p in checkpoints.rglob("*") if p.is_file()}
    (tmp_path / "other.txt").write_text(TEXT.translate(str.maketrans("12", "21")))
    prepare([tmp_path / "other.txt"], tmp_path / "other", "char", 0.1)
    args = [f"hydra.run.dir={halves}", *TRAIN, *GPT, f"data.dir={tmp_path / 'other'}"]
    proc = run_cli([*args, "train.steps=8", "resume=auto"], None)
    assert proc.returncode == 2, proc.stderr[-2000:]
    [line] = [ln for ln in proc.stderr.replace("\r", "\n").splitlines() if "error" in ln]
    assert (
        f"error: {checkpoints / 'step_000004' / 'meta.pt'}: the token data "
        f"{(tmp_path / 'other' / 'train.bin').resolve()} (" in line
    ), line
    assert f"trained on, {(text_dir / 'train.bin').resolve()} (" in line, line
    assert {p: p.read_bytes() for p in checkpoints.rglob("*") if p.is_file()} == before

    # The same tokens at another path resume: moved data is the same data.
    moved = tmp_path / "moved"
    shutil.copytree(text_dir, moved)
    halves = _run(tmp_path, "halves", *GPT, f"data.dir={moved}", "train.steps=8", "resume=auto")
    a = torch.load(whole / "final_model.pt", weights_only=True)
    b = torch.load(halves / "final_model.pt", weights_only=True)
    assert all(torch.equal(a[k], b[k]) for k in a)  # the data position resumed exactly

    meta = json.loads((whole / "model" / "meta.json").read_text())  # the data's, kept
    assert meta["separator"] == "\n" and meta["separator_ids"] == [0]
    final = json.loads((whole / "final_metrics.json").read_text())
    assert final["eval/perplexity"] == pytest.approx(np.exp(final["eval/loss"]))
    values = scalars(whole)
    assert values["train/tokens_seen"][-1] == 8 * 8 * 32  # steps x batch x block_size
    assert "perf/tokens_per_s" in values and "eval/perplexity" in values
    # a sample of the model at each evaluation, decoded with the run's tokenizer
    written = texts(whole, "sample")
    assert [step for step, _ in written] == [4, 8]
    md = written[-1][1]
    body = md[md.index("```\n") + 4 : md.rindex("\n```")]
    assert len(body) == 64 and set(body) <= set(TEXT), body

    one, two = sample(whole, "def ", 40, seed=1), sample(whole, "def ", 40, seed=1)
    assert one == two and one.startswith("def ") and len(one) == 44
    assert sample(whole, "def ", 40, seed=2) != one

    from trainer.models.lm import load_exported

    export(whole, tmp_path / "exported")
    model = load_exported(tmp_path / "exported")
    assert all(torch.equal(model.state_dict()[k], a[k]) for k in a)  # bitwise
    assert {p.name for p in (tmp_path / "exported").iterdir()} >= {"model.safetensors", "meta.json"}


def _hf_dirs(root: Path) -> dict[str, Path]:
    """GPT-2 with weights, Llama (tied embeddings) with config.json only."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig

    torch.manual_seed(0)
    gpt2 = GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0,
        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    GPT2LMHeadModel(gpt2).save_pretrained(root / "gpt2")
    LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
        tie_word_embeddings=True, bos_token_id=0, eos_token_id=0,
    ).save_pretrained(root / "llama")  # fmt: skip
    return {"gpt2": root / "gpt2", "llama": root / "llama"}


def _hf_every_mode(env, dirs: dict[str, Path], text_dir: Path) -> dict:
    from trainer.data.datasets import make_loader
    from trainer.data.tokens import TokenData
    from trainer.models.builtin import loss_fn
    from trainer.models.lm import hf_causal_lm
    from trainer.parallel import build_engine

    data = TokenData(dir=str(text_dir), block_size=16)
    out = {}
    for kind, path in dirs.items():
        for mode in ("ddp", "zero", "fsdp"):
            torch.manual_seed(0)
            engine = build_engine(
                hf_causal_lm(str(path)), mode, lambda p: torch.optim.SGD(p, lr=0.1)
            )
            batches = iter(make_loader(data, 4, env.rank, env.world_size, seed=0))
            for _ in range(3):
                x, y = next(batches)
                loss_fn(engine(x), y).backward()
                engine.step()
            out[kind, mode] = engine.full_state_dict()
    return out


def test_hf_dirs_train_in_every_mode_as_one_process(tmp_path, text_dir):
    from trainer.data.datasets import make_loader
    from trainer.data.tokens import TokenData
    from trainer.models.builtin import loss_fn
    from trainer.models.lm import hf_causal_lm

    dirs = _hf_dirs(tmp_path)
    from safetensors.torch import load_file

    stored = load_file(dirs["gpt2"] / "model.safetensors")
    start = hf_causal_lm(str(dirs["gpt2"])).state_dict()  # fine-tuning starts from the file
    assert all(torch.equal(start[f"hf.{k}"], v) for k, v in stored.items())

    got = run_distributed(_hf_every_mode, 2, dirs, text_dir)[0]
    data = TokenData(dir=str(text_dir), block_size=16)
    for kind, path in dirs.items():
        torch.manual_seed(0)
        model = hf_causal_lm(str(path))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        batches = iter(make_loader(data, 4, 0, 1, seed=0))
        for _ in range(3):
            x, y = next(batches)
            loss_fn(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        want = model.state_dict()
        for mode in ("ddp", "zero", "fsdp"):
            diff = max((got[kind, mode][k] - want[k]).abs().max().item() for k in want)
            assert diff < 1e-5, (kind, mode, diff)


def test_hf_run_exports_a_directory_from_pretrained_loads(tmp_path, text_dir):
    from transformers import AutoModelForCausalLM

    from trainer import checkpoint
    from trainer.models.lm import hf_causal_lm, run_model

    dirs = _hf_dirs(tmp_path)
    args = ["model=hf", f"model.path={dirs['llama']}", "data=token_file", f"data.dir={text_dir}"]
    run = _run(
        tmp_path, "llama", *args, "mode=fsdp", "train.steps=4", "train.batch_size=8", nproc=2
    )
    # The run's final model is written once, as final_model/, which from_pretrained loads
    # as it is: bitwise the last step's checkpoint, consolidated from the ranks' shards
    assert not (run / "final_model.pt").exists()
    final = checkpoint.consolidate(run / "checkpoints" / "step_000004")
    own = AutoModelForCausalLM.from_pretrained(run / "final_model")
    assert own.state_dict().keys() == {k.removeprefix("hf.") for k in final}
    assert all(torch.equal(v, final[f"hf.{k}"]) for k, v in own.state_dict().items())
    assert (run / "final_model" / "meta.json").is_file()  # the tokenizer, for sample.py

    out = tmp_path / "llama_hf"
    export(run, out, max_shard_size="20KB")
    assert (out / "model.safetensors.index.json").is_file()  # split above --max-shard-size
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert "lm_head.weight" not in index  # tied: stored once
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert all(torch.equal(v, final[f"hf.{k}"]) for k, v in loaded.state_dict().items())
    ours = hf_causal_lm(str(dirs["llama"]))
    ours.load_state_dict(final)  # the trained engine's full state
    x = torch.randint(0, 60, (2, 16))
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=x).logits, ours.eval()(x))
    again = hf_causal_lm(str(out)).state_dict()  # a valid model.path for the next run
    assert all(torch.equal(again[k], final[k]) for k in final)

    # Fine-tuning the exported directory: read slice by slice on meta (the default) or
    # loaded whole on every rank, the same weights train to the same model, bitwise.
    tuned = {}
    for meta in ("true", "false"):
        args = ["model=hf", f"model.path={out}", "data=token_file", f"data.dir={text_dir}"]
        again_run = _run(
            tmp_path, f"tuned_{meta}", *args, "mode=fsdp", "train.steps=2",
            "train.batch_size=8", f"train.meta_build={meta}", nproc=2,
        )  # fmt: skip
        tuned[meta] = hf_causal_lm(str(again_run / "final_model")).state_dict()
    assert all(torch.equal(tuned["true"][k], tuned["false"][k]) for k in final)
    assert any(not torch.equal(tuned["true"][k], final[k]) for k in final)  # it trained

    # A run with its final model only: sample.py and export_hf.py read final_model/
    shutil.rmtree(run / "checkpoints")
    model, _, source = run_model(run)
    assert source == str(run / "final_model")
    assert all(torch.equal(v, final[k]) for k, v in model.state_dict().items())
    text = sample(run, "def ", 6, seed=1)
    assert text.startswith("def ") and len(text) == 10 and text == sample(run, "def ", 6, seed=1)
    export(run, tmp_path / "from_final")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "from_final")
    assert all(torch.equal(v, final[f"hf.{k}"]) for k, v in loaded.state_dict().items())


@pytest.mark.parametrize(
    "args, needle",
    [
        (["model.vocab_size=10"], "is at or above the model's vocabulary size 10"),
        (["data.block_size=64"], "data.block_size=64 is beyond the model's 32 positions"),
        (["model=hf", "model.path=gpt2"], "model.path=gpt2 is not a local directory"),
        (["data.path=/nonexistent/*.bin"], "data.path=/nonexistent/*.bin matches no file"),
    ],
    ids=["vocab", "block_size", "hub_name", "glob"],
)
def test_bad_input_on_own_text_is_one_line(tmp_path, text_dir, args, needle):
    model = [] if "model=hf" in args else GPT
    data = [] if any(a.startswith("data.path") for a in args) else [f"data.dir={text_dir}"]
    proc = run_cli(
        [f"hydra.run.dir={tmp_path / 'r'}", "data=token_file", *model, *data, *args], None
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and needle in lines[0], proc.stderr[-2000:]
    assert not (tmp_path / "r" / "checkpoints").exists()


def test_bad_model_dirs_and_runs(tmp_path):
    from trainer.models.lm import hf_causal_lm, run_model

    (tmp_path / "no_config").mkdir()
    with pytest.raises(ConfigError, match="no_config has no config.json"):
        hf_causal_lm(str(tmp_path / "no_config"))
    with pytest.raises(ConfigError, match="needs model.path=DIR .* or model.config.model_type"):
        hf_causal_lm()
    (tmp_path / "run").mkdir()
    with pytest.raises(ConfigError, match="has no checkpoint .* and no final model"):
        run_model(tmp_path / "run")
    # a model=hf run directory as model.path: the message names its final model
    (tmp_path / "run" / "final_model").mkdir()
    (tmp_path / "run" / "final_model" / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="whose final model is model.path=.*/run/final_model$"):
        hf_causal_lm(str(tmp_path / "run"))
