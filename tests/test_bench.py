"""scripts/benchmarks/bench.py end to end on a tiny model: every contender yields a row of
positive figures, in the JSON and the markdown table; the hybrid ones with shard groups of
one rank (two replicas at P = 2)."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import warm_cli

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "scripts" / "benchmarks"


def test_bench_smoke(tmp_path: Path) -> None:
    out, md = tmp_path / "bench.json", tmp_path / "bench.md"
    cmd = [sys.executable, str(BENCHMARKS / "bench.py"), "--nproc", "2"]
    cmd += ["--width", "64", "--depth", "2", "--batch-per-rank", "8", "--steps", "2"]
    cmd += ["--warmup", "1", "--rounds", "1", "--out", str(out), "--md", str(md)]
    cmd += ["--shard-group-size", "1"]
    proc = warm_cli.command(cmd, {"OMP_NUM_THREADS": "1"}, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]

    result = json.loads(out.read_text())
    rows = {r["contender"]: r for r in result["rows"]}
    assert set(rows) == {
        *("floor", "ddp", "torch_ddp", "zero", "fsdp2_keep", "fsdp", "fsdp2"),
        *("zero_hybrid", "fsdp2_hsdp_keep", "fsdp_hybrid", "fsdp2_hsdp"),
    }
    for name, r in rows.items():
        assert r["median_step_ms"] > 0, name
        assert r["ratio_to_floor"] > 0, name
        assert r["state_16psi"] > 0 and r["peak_16psi"] > 0, name
        if name != "floor":
            assert r["bytes_per_step"] > 0, name
    for ours, theirs in {"ddp": "torch_ddp", "zero": "fsdp2_keep", "fsdp": "fsdp2"}.items():
        assert rows[ours]["vs"] == theirs and rows[ours]["ratio_to_torch"] > 0
    # Traffic: ours counted by trainer.comm equals the ring formula used for PyTorch's
    # (sharded modes pad to a multiple of P: a few bytes over; ddp's last bucket carries
    # one 4-byte used-flag per parameter tensor, 6 here: used.py [Note: used flags]).
    flags = 2 * (2 - 1) / 2 * 6 * 4
    assert rows["ddp"]["bytes_per_step"] == rows["torch_ddp"]["bytes_per_step"] + flags
    assert abs(rows["zero"]["bytes_per_step"] / rows["fsdp2_keep"]["bytes_per_step"] - 1) < 0.01
    assert "| `zero` | `fsdp2_keep` |" in md.read_text()
    # S = 1: everything crosses groups, one full gradient AllReduce as ddp's (ours
    # counted, FSDP2-HSDP's by formula; ours carry the used-flags too)
    for ours, theirs in {"zero_hybrid": "fsdp2_hsdp_keep", "fsdp_hybrid": "fsdp2_hsdp"}.items():
        assert rows[ours]["vs"] == theirs
        assert rows[theirs]["bytes_across_per_step"] == rows["torch_ddp"]["bytes_per_step"]
        assert rows[ours]["bytes_across_per_step"] == rows["ddp"]["bytes_per_step"]
    assert "- bytes across groups `fsdp_hybrid`" in md.read_text()


def test_bench_tokens_smoke(tmp_path: Path) -> None:
    """scripts/benchmarks/bench_tokens.py at 1 and 2 ranks: the floor, an engine and their
    compiled twins (aot_eager: tracing only, quick) each give positive tokens/s in one table."""
    out, md = tmp_path / "tokens.json", tmp_path / "tokens.md"
    cmd = [sys.executable, str(BENCHMARKS / "bench_tokens.py"), "--nproc", "1,2"]
    cmd += ["--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--block-size", "16"]
    cmd += ["--batch-per-rank", "2", "--steps", "1", "--warmup", "1", "--rounds", "1"]
    cmd += ["--modes", "fsdp", "--compile", "--backend", "aot_eager"]
    cmd += ["--out", str(out), "--md", str(md)]
    proc = warm_cli.command(cmd, {"OMP_NUM_THREADS": "1"}, timeout=180, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]

    result = json.loads(out.read_text())
    assert [la["world_size"] for la in result["launches"]] == [1, 2]
    for la in result["launches"]:
        rows = {r["contender"]: r for r in la["rows"]}
        assert set(rows) == {"floor", "fsdp", "floor_compiled", "fsdp_compiled"}
        assert la["tokens_per_step"] == 2 * 16 * la["world_size"]
        for name, r in rows.items():
            assert r["tokens_per_s"] > 0 and r["ratio_to_floor"] > 0, name
        assert rows["floor"]["ratio_to_floor"] == 1.0
        assert rows["fsdp_compiled"]["ratio_to_eager"] > 0
    assert "| 2 | `fsdp_compiled` |" in md.read_text()


def test_build_memory_smoke(tmp_path: Path) -> None:
    """scripts/benchmarks/build_memory.py on one rank (the launches are most of its time) on a
    tiny GPT and the HF GPT-2 directory it writes: fsdp built on meta, one step each; the
    rank reports a build peak, times and the formula, and the loss."""
    out, md, hf = tmp_path / "build.json", tmp_path / "build.md", tmp_path / "gpt2"
    cmd = [sys.executable, str(BENCHMARKS / "build_memory.py"), "--nproc", "1"]
    cmd += ["--modes", "fsdp", "--builds", "meta", "--steps", "1", "--pretrained", str(hf)]
    cmd += ["--margin-gib", "0", "--out", str(out), "--md", str(md)]
    proc = warm_cli.command(cmd, {"OMP_NUM_THREADS": "1"}, timeout=180, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]

    result = json.loads(out.read_text())
    assert (hf / "config.json").is_file() and result["pretrained_bytes"] > 0
    rows = {r["model"]: r for r in result["rows"]}
    assert set(rows) == {"gpt", "hf pretrained"}
    for name, r in rows.items():
        assert r["mode"] == "fsdp" and r["build"] == "meta", name
        assert len(r["peak_bytes"]) == len(r["anon_peak_bytes"]) == 1, name
        assert all(v > 0 for v in r["peak_bytes"]), name
        assert r["formula_bytes"] > 0 and r["build_run_s"] > 0, name
        assert r["build_engine_s"] <= r["build_run_s"] <= r["to_first_step_s"], name
        assert list(r["loss"]) == ["1"] and r["loss"]["1"] > 0, name
        assert f"train.py model={'gpt' if name == 'gpt' else 'hf'}" in r["command"], name
    assert "| hf pretrained | fsdp | meta |" in md.read_text()


def test_bench_nanogpt_reads_nanogpts_output_and_spells_the_recipe(tmp_path: Path) -> None:
    """scripts/benchmarks/bench_nanogpt.py without nanoGPT: the lines its train.py prints are
    read (the last evaluation's val loss, the median iteration time after the first), and
    our recipe composes with our config."""
    sys.path.insert(0, str(BENCHMARKS))
    import bench_nanogpt

    printed = "\n".join(
        [
            "step 0: train loss 4.1676, val loss 4.1649",
            "iter 0: loss 4.1877, time 900.00ms, mfu -100.00%",
            "iter 1: loss 3.9000, time 40.00ms, mfu 0.01%",
            "iter 2: loss 3.8000, time 50.00ms, mfu 0.01%",
            "iter 3: loss 3.7000, time 44.00ms, mfu 0.01%",
            "step 250: train loss 2.4293, val loss 2.4447",
        ]
    )
    assert bench_nanogpt.nanogpt_figures(printed) == {"val_loss": 2.4447, "step_ms": 44.0}

    from hydra import compose, initialize_config_dir

    from trainer.config import schema  # noqa: F401  (registers the config's types)

    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=bench_nanogpt.our_recipe(tmp_path, 500))
    assert cfg.model.bias is False and cfg.model.tie_weights is True
    assert list(cfg.optim.betas) == [0.9, 0.99] and cfg.optim.fused is True
    assert (cfg.train.steps, cfg.train.eval_every, cfg.train.eval_batches) == (500, 250, 40)


def test_bench_nanogpt_seeds_nanogpt_without_changing_it(tmp_path: Path) -> None:
    """`--seeds`: seed s runs nanoGPT's own train.py with its torch.manual_seed(1337) moved
    to 1337 + s and its command line as given; seed 0 is its plain command."""
    sys.path.insert(0, str(BENCHMARKS))
    import argparse

    import bench_nanogpt

    (tmp_path / "train.py").write_text(
        "import sys, torch\ntorch.manual_seed(1337)\nprint(torch.initial_seed(), sys.argv)\n"
    )
    args = argparse.Namespace(nanogpt=tmp_path, steps=10, threads=1)
    for seed, want in ((0, 1337), (2, 1339)):
        argv, cwd, env = bench_nanogpt.command("nanogpt", args, tmp_path, tmp_path / "out", seed)
        assert (argv[1] == "train.py") == (seed == 0)
        out = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, check=True)
        initial, rest = out.stdout.split(" ", 1)
        assert int(initial) == want
        assert rest.startswith("['train.py', 'config/train_shakespeare_char.py', '--device=cpu'")


def test_bench_prepare_harness(tmp_path: Path, monkeypatch) -> None:
    """scripts/benchmarks/bench_prepare.py without nanoGPT or llm.c: the corpus is the same for
    the same seed, its stand-in tiktoken gives the ids and end-of-text token of the tokenizer
    it trains (pickled by name, as tiktoken's), the anchors' lines are changed only where
    found once, tokens are counted through llm.c's header, and memory is summed over a
    process tree (a parent and its child each holding 64 MiB)."""
    import importlib.util
    import pickle

    import numpy as np
    from tokenizers import Tokenizer

    sys.path.insert(0, str(BENCHMARKS))
    import bench_prepare as bp

    docs = bp.documents(30, words=20, seed=3)
    assert docs == bp.documents(30, words=20, seed=3) and docs != bp.documents(30, 20, 4)
    tok_dir = bp.train_tokenizer(docs, tmp_path / "tok", vocab=400)
    monkeypatch.setenv("BENCH_PREPARE_TOKENIZER", str(tok_dir))
    spec = importlib.util.spec_from_file_location(
        "tiktoken_standin", bp.standins(tmp_path / "pins") / "tiktoken.py"
    )
    standin = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(standin)
    monkeypatch.setitem(sys.modules, "tiktoken_standin", standin)  # pickle finds it by name
    enc, hf = standin.get_encoding("gpt2"), Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    for doc in docs:
        assert enc.encode_ordinary(doc) == hf.encode(doc, add_special_tokens=False).ids
    eot = hf.token_to_id("<|endoftext|>")
    assert enc.eot_token == enc._special_tokens["<|endoftext|>"] == eot
    assert enc.n_vocab == hf.get_vocab_size() == 400
    assert pickle.loads(pickle.dumps(enc)) is enc

    source = "num_proc = 8\nx = 1\nif 1:\n    total_batches = 1024\n"
    want = "num_proc = 2\nx = 1\nif 1:\n    total_batches = min(1024, len(dset))\n"
    assert bp.adapted(source, "nanogpt", 2, "p.py") == want
    with pytest.raises(SystemExit, match="0 lines match"):
        bp.adapted("nprocs = 4\n", "llmc", 2, "fineweb.py")

    header = np.zeros(256, np.int32)
    header[:3] = (20240520, 1, 5)
    with open(tmp_path / "shard.bin", "wb") as f:
        f.write(header.tobytes() + np.arange(5, dtype=np.uint16).tobytes())
    np.arange(7, dtype=np.uint16).tofile(tmp_path / "plain.bin")
    assert bp.tokens_in(tmp_path) == 12

    hold = "import time; b = bytearray(64 << 20); b[::4096] = b'x' * (16 << 10); "
    child = hold + "time.sleep(1.0)"
    parent = f"import subprocess, sys; {hold}subprocess.run([sys.executable, '-c', {child!r}])"
    got = bp.measured([sys.executable, "-c", parent], tmp_path, dict(os.environ), tmp_path / "l")
    assert got["peak_pss"] >= 2 * 64 << 20  # both processes' buffers, summed
    assert 64 << 20 <= got["largest_hwm"] < 2 * 64 << 20  # the largest single process
    assert got["wall_s"] >= 1.0


def test_diloco_quality_harness(tmp_path: Path) -> None:
    """scripts/benchmarks/diloco_quality.py without its processes: the options it refuses,
    the runs a sweep picks up where it stopped (a finished one is read back, not run), and
    the table (each cell the loss and its ratio to per-step sync)."""
    sys.path.insert(0, str(BENCHMARKS))
    import diloco_quality as dq

    text = tmp_path / "input.txt"
    text.write_text("to be or not to be\n" * 50)
    with pytest.raises(SystemExit):
        dq.parse_args(["--input", str(text), "--groups", "5"])  # 5 does not divide 12
    with pytest.raises(SystemExit):
        dq.parse_args(["--input", str(tmp_path / "missing.txt")])
    a = dq.parse_args(["--input", str(text), "--work", str(tmp_path / "w"),
                       "--sync-steps", "10,50", "--outer-lrs", "0.5,1.0"])  # fmt: skip
    assert a.sync_steps == [10, 50] and a.outer_lrs == [0.5, 1.0]
    done = tmp_path / "w" / "h10_lr0.5"
    (done / "g0").mkdir(parents=True)
    (done / "g0" / "final_metrics.json").write_text("{}")
    (done / "result.json").write_text(json.dumps({"val_loss": 2.0, "codes": [0] * 4}))
    assert dq.one_run(a, tmp_path, "h10_lr0.5", [])["val_loss"] == 2.0  # not run again
    results = {"per step": {"val_loss": 2.0}}
    for h, lr, v in [(10, 0.5, 2.0), (10, 1.0, 1.9), (50, 0.5, 2.2), (50, 1.0, None)]:
        results[f"H={h} lr={lr:g}"] = {"val_loss": v}
    table = dq.table(a, results)
    assert "| 0.5 | 2.0000 (1.000) | 2.2000 (1.100) |" in table
    assert "| 1 | 1.9000 (0.950) | failed |" in table


def test_no_user_tool_imports_a_benchmark() -> None:
    """The tools of scripts/ stand alone; the benchmarks of scripts/benchmarks/ may use them,
    not the other way round (read from the sources: nothing is imported or run)."""
    benchmarks = {p.stem for p in BENCHMARKS.glob("*.py")}
    wrong = []
    for tool in sorted((ROOT / "scripts").glob("*.py")):
        for node in ast.walk(ast.parse(tool.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            else:
                continue
            for name in names:
                if name.startswith("scripts.benchmarks") or name.split(".")[-1] in benchmarks:
                    wrong.append(f"{tool.relative_to(ROOT)}:{node.lineno}: {name}")
    assert not wrong, "user tools importing benchmarks:\n" + "\n".join(wrong)
