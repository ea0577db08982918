"""nanoGPT's CPU shakespeare_char recipe through nanoGPT's own train.py and through ours,
at one process and at P ranks, in rounds, side by side (docs/bench.md, "Against nanoGPT").

    python scripts/benchmarks/bench_nanogpt.py --nanogpt ~/src/nanoGPT --input input.txt --md out.md
    python scripts/benchmarks/bench_nanogpt.py --nanogpt DIR --rounds 1 --steps 200   # a quick look

`--nanogpt DIR` is a checkout of github.com/karpathy/nanoGPT that the user brings; none of
its code is copied here. Its data/shakespeare_char/prepare.py downloads the text unless
input.txt is already beside it: `--input FILE` copies a local copy there first (the
prepare script is then run with a stand-in for `requests`, which it imports but does not
call). Both tools train on the files that script writes (train.bin, val.bin, meta.pkl:
ours reads them with `data=token_file`); `--data prepare_text` has ours read the text
through `scripts/prepare_text.py --tokenizer char` instead (same characters, a split at a
line end near 90%).

The recipe: [Note: the recipe] beside our_recipe.

Runs, each a fresh process timed from start to exit (start-up included):
    nanogpt        nanoGPT's train.py, one process, `--threads` torch threads
    ours_p1        `python train.py`, one process, `--threads` threads
    ours_p<N>_<mode>   `torchrun --nproc-per-node=N train.py mode=<mode>`, each rank
                   (`<mode>+int8`: with mode.reduce_dtype and mode.gather_dtype int8)
                   `--threads / N` threads (torchrun's own default is 1)
Rounds and columns: [Note: rounds and columns] beside rows.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from scripts.benchmarks.bench import report  # noqa: E402

STEPS = 2000
NANOGPT_ARGS = [  # the README's CPU command line, after config/train_shakespeare_char.py
    "--device=cpu", "--compile=False", "--eval_iters=20", "--log_interval=1",
    "--block_size=64", "--batch_size=12", "--n_layer=4", "--n_head=4", "--n_embd=128",
    "--dropout=0.0",
]  # fmt: skip


# [Note: the recipe]
# The recipe is the one nanoGPT's README gives for a CPU: 4 layers x 4 heads x 128, block
# 64, batch 12, 2000 iterations, lr 1e-3 with 100 warm-up steps and a cosine to 1e-4,
# betas (0.9, 0.99), weight decay 0.1 on matrices only, gradient clipping at 1.0, dropout
# 0, evaluation every 250 steps over 20 batches. Ours runs it as `model=nanogpt` (nanoGPT's
# bias-free, tied architecture) with each option spelled in our config (`our_recipe`).
# Evaluation costs both tools the same forwards: nanoGPT evaluates 20 batches of the
# training split and 20 of the validation split, ours 40 batches of the validation split
# (it evaluates held-out data only).
def our_recipe(data_dir: Path, steps: int) -> list[str]:
    """The same recipe as overrides of our config (nanoGPT's values in its train.py and
    config/train_shakespeare_char.py)."""
    return [
        "model=nanogpt", "model.block_size=64", "model.n_layer=4", "model.n_head=4",
        "model.n_embd=128", "data=token_file", f"data.dir={data_dir}",
        "train.batch_size=12", f"train.steps={steps}", f"train.eval_every={eval_every(steps)}",
        "train.eval_batches=40", "optim.lr=1e-3", "optim.betas=[0.9,0.99]",
        "optim.weight_decay=0.1", "optim.no_decay_bias_norm=true", "optim.clip_grad_norm=1.0",
        "optim.schedule=cosine", "optim.warmup_steps=100", "optim.min_lr_ratio=0.1",
    ]  # fmt: skip


def eval_every(steps: int) -> int:
    """250 as in the recipe; a shorter run evaluates at its end."""
    return min(250, steps)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nanogpt", type=Path, required=True, help="a nanoGPT checkout")
    ap.add_argument("--input", type=Path, help="the tiny-shakespeare text, if not in place")
    ap.add_argument("--data", choices=("nanogpt", "prepare_text"), default="nanogpt")
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2, help="torch threads per run")
    ap.add_argument("--nproc", type=int, default=2, help="ranks of the torchrun contenders")
    ap.add_argument(
        "--modes", default="ddp,zero", help="modes at --nproc ranks; fsdp+int8: int8 both ways"
    )
    ap.add_argument("--contenders", help="a subset, e.g. nanogpt,ours_p1")
    ap.add_argument(
        "--seeds", default="0", help="seeds, one per round in turn (e.g. 0,1,2,3 with --rounds 4)"
    )
    ap.add_argument("--work", type=Path, default=Path("bench_nanogpt"), help="runs go here")
    ap.add_argument("--out", type=Path, help="JSON results")
    ap.add_argument("--md", type=Path, help="markdown table")
    args = ap.parse_args(argv)
    if not (args.nanogpt / "train.py").is_file():
        ap.error(f"--nanogpt {args.nanogpt} has no train.py: give a nanoGPT checkout")
    args.modes = [m for m in args.modes.split(",") if m]
    args.seeds = [int(s) for s in args.seeds.split(",") if s]
    return args


def contenders(args: argparse.Namespace) -> list[str]:
    names = ["nanogpt", "ours_p1", *(f"ours_p{args.nproc}_{m}" for m in args.modes)]
    if args.contenders:
        wanted = args.contenders.split(",")
        unknown = set(wanted) - set(names)
        if unknown:
            raise SystemExit(f"unknown contenders {sorted(unknown)}; choose from {names}")
        names = [n for n in names if n in wanted]
    return names


# ---------------------------------------------------------------------------------------
# Data, both ways


def nanogpt_data(args: argparse.Namespace) -> Path:
    """nanoGPT's data/shakespeare_char, prepared by its own script if not yet."""
    data = args.nanogpt / "data" / "shakespeare_char"
    if all((data / f).is_file() for f in ("train.bin", "val.bin", "meta.pkl")):
        return data
    text = data / "input.txt"
    if not text.is_file():
        if args.input is None:
            raise SystemExit(
                f"{text} is missing and prepare.py would download it: give --input FILE "
                "(the tiny-shakespeare text)"
            )
        shutil.copyfile(args.input, text)
    # prepare.py imports requests at the top and calls it only when input.txt is missing
    stub = (
        "import runpy, sys, types\n"
        "try:\n    import requests\n"
        "except ImportError:\n    sys.modules['requests'] = types.ModuleType('requests')\n"
        "runpy.run_path('prepare.py', run_name='__main__')\n"
    )
    subprocess.run([sys.executable, "-c", stub], cwd=data, check=True)
    return data


def our_data(args: argparse.Namespace, nanogpt_dir: Path) -> Path:
    if args.data == "nanogpt":
        return nanogpt_dir  # train.bin, val.bin and meta.pkl, read by data=token_file
    out = args.work / "data_prepare_text"
    if not (out / "meta.json").is_file():
        cmd = [sys.executable, str(ROOT / "scripts" / "prepare_text.py")]
        cmd += [str(nanogpt_dir / "input.txt"), "--out", str(out), "--tokenizer", "char"]
        subprocess.run(cmd + ["--val-fraction", "0.1"], check=True)
    return out


# ---------------------------------------------------------------------------------------
# One run of a contender


# nanoGPT seeds torch with 1337 and has no option for it: seed s runs its unchanged
# train.py with torch.manual_seed shifted by s (seed 0: exactly its own command).
NANOGPT_SEEDED = (
    "import runpy, sys, torch\n"
    "seed, own = int(sys.argv.pop(1)), torch.manual_seed\n"
    "torch.manual_seed = lambda s: own(s + seed)\n"
    "sys.argv = sys.argv[1:]\n"
    "runpy.run_path('train.py', run_name='__main__')\n"
)


def command(name: str, args: argparse.Namespace, data: Path, run_dir: Path, seed: int = 0) -> tuple:
    """(argv, cwd, environment) of one run."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    if name == "nanogpt":
        argv = [sys.executable, "train.py", "config/train_shakespeare_char.py", *NANOGPT_ARGS]
        if seed:
            argv[1:1] = ["-c", NANOGPT_SEEDED, str(seed)]
        argv += [f"--max_iters={args.steps}", f"--lr_decay_iters={args.steps}"]
        argv += [f"--eval_interval={eval_every(args.steps)}"]
        argv += [f"--out_dir={run_dir.absolute()}"]
        return argv, args.nanogpt, {**env, "OMP_NUM_THREADS": str(args.threads)}
    recipe = [*our_recipe(data.absolute(), args.steps), f"hydra.run.dir={run_dir.absolute()}"]
    recipe.append(f"seed={seed}")
    if name == "ours_p1":
        argv = [sys.executable, str(ROOT / "train.py"), *recipe]
        return argv, ROOT, {**env, "OMP_NUM_THREADS": str(args.threads)}
    mode, _, wire = name.split("_", 2)[2].partition("+")  # fsdp+int8: int8 on the wire
    if wire:
        recipe += [f"mode.reduce_dtype={wire}"] + ([f"mode.gather_dtype={wire}"] * (mode != "ddp"))
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    argv += [f"--nproc-per-node={args.nproc}", str(ROOT / "train.py"), f"mode={mode}", *recipe]
    threads = max(1, args.threads // args.nproc)
    return argv, ROOT, {**env, "OMP_NUM_THREADS": str(threads)}


def run_one(name: str, args: argparse.Namespace, data: Path, run_dir: Path, seed: int) -> dict:
    argv, cwd, env = command(name, args, data, run_dir, seed)
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    (run_dir / "stdout.txt").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(
            f"{name} failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}"
        )
    figures = nanogpt_figures(proc.stdout) if name == "nanogpt" else our_figures(run_dir)
    full = full_val_loss(name, args, data, run_dir)
    return {"wall_s": wall, "load_1min": load, "seed": seed, **figures, **full}


def full_val_loss(name: str, args: argparse.Namespace, data: Path, run_dir: Path) -> dict:
    """The final model's mean loss over every window of val.bin (block + 1 tokens, side by
    side), after the run and outside its wall time. nanoGPT's model is its `ckpt.pt` (the
    best evaluation's, so `full_val_iter` says which), built by the checkout's model.py."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    val = np.memmap(data / "val.bin", dtype=np.uint16, mode="r")
    window = 65  # block 64 + the last target
    n = len(val) // window
    seqs = torch.from_numpy(np.asarray(val[: n * window]).astype(np.int64)).view(n, window)
    if name == "nanogpt":
        sys.path.insert(0, str(args.nanogpt.absolute()))
        from model import GPT as NanoGPT  # the checkout's own, imported where it lies
        from model import GPTConfig

        saved = torch.load(run_dir / "ckpt.pt", map_location="cpu", weights_only=False)
        model = NanoGPT(GPTConfig(**saved["model_args"]))
        model.load_state_dict(saved["model"])
        at = int(saved["iter_num"])

        def logits(x: torch.Tensor) -> torch.Tensor:
            return model(x, x)[0]  # with targets it returns every position's logits
    else:
        from trainer.models.lm import run_model

        model, _, _ = run_model(run_dir)
        at = args.steps
        logits = model
    model.eval()
    total = 0.0
    with torch.no_grad():
        for batch in seqs.split(256):  # (b, 65)
            out = logits(batch[:, :-1].contiguous())  # (b, 64, vocab)
            targets = batch[:, 1:].reshape(-1)
            total += F.cross_entropy(out.flatten(0, 1), targets, reduction="sum").item()
    return {"full_val_loss": total / (n * (window - 1)), "full_val_iter": at}


def nanogpt_figures(stdout: str) -> dict:
    """nanoGPT prints `step N: train loss A, val loss B` at each evaluation and
    `iter N: loss L, time T ms, ...` for each iteration (the time of an evaluating
    iteration includes the evaluation)."""
    evals = re.findall(r"step (\d+): train loss ([\d.]+), val loss ([\d.]+)", stdout)
    iters = [float(t) for t in re.findall(r"iter \d+: loss [\d.]+, time ([\d.]+)ms", stdout)]
    if not evals or not iters:
        raise SystemExit(f"no evaluation or iteration lines in nanoGPT's output:\n{stdout[-2000:]}")
    return {
        "val_loss": float(evals[-1][2]),
        "step_ms": statistics.median(iters[1:] or iters),  # the first includes warm-up
    }


def our_figures(run_dir: Path) -> dict:
    final = json.loads((run_dir / "final_metrics.json").read_text())
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    times = [e.value for e in acc.Scalars("perf/step_time_s")]
    return {"val_loss": final["eval/loss"], "step_ms": 1e3 * statistics.median(times)}


# ---------------------------------------------------------------------------------------
# Rounds and the table


def run(args: argparse.Namespace) -> dict:
    names = contenders(args)
    nanogpt_dir = nanogpt_data(args)
    data = our_data(args, nanogpt_dir)
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        seed = args.seeds[r % len(args.seeds)]
        for n in order:
            result = run_one(n, args, data, args.work / f"round{r}_{n}", seed)
            runs[n].append(result)
            print(
                f"round {r} seed {seed} {n:14s} {result['wall_s']:7.1f} s"
                f"  {result['step_ms']:6.1f} ms/step"
                f"  val loss {result['val_loss']:.4f}  full val {result['full_val_loss']:.4f}"
                f" (at {result['full_val_iter']})  load {result['load_1min']:.2f}",
                flush=True,
            )
    return {
        "steps": args.steps,
        "threads": args.threads,
        "nproc": args.nproc,
        "data": args.data,
        "seeds": [args.seeds[r % len(args.seeds)] for r in range(args.rounds)],
        "cpus": os.cpu_count(),
        "runs": runs,
        "rows": rows(names, runs),
    }


# [Note: rounds and columns]
# Each round runs every contender once, the order rotated from round to round, so that a
# machine's drift hits all alike; ratios are taken within a round. Columns: wall s (median
# over rounds), per step ms (nanoGPT: median of its printed iteration times; ours: median
# of perf/step_time_s over the log intervals), the last val loss each printed (nanoGPT's
# at iteration 2000, on 20 random batches; ours at step 2000, on the first 40 batches of
# the held-out set), the loss of each final model on every window of val.bin (`full val`,
# the same 1,716 windows of 64 predictions for both: a 20-batch figure moves by about 0.01
# from one draw of batches to the next; nanoGPT's model from the `ckpt.pt` it keeps, read
# with the checkout's own model.py), and the ratio of wall times to nanoGPT's of the same
# round. `--seeds 0,1,2,3` gives round r the r-th seed for every contender (ours `seed=`,
# nanoGPT's own train.py with its 1337 shifted by it): the loss columns are then the mean
# over seeds, as a 0.01 margin needs (one seed's full-val loss moves by about 0.01).
def rows(names: list[str], runs: dict[str, list[dict]]) -> list[dict]:
    out = []
    for n in names:
        rs = runs[n]
        row = {
            "contender": n,
            "wall_s": statistics.median(r["wall_s"] for r in rs),
            "step_ms": statistics.median(r["step_ms"] for r in rs),
            # means: over the rounds' seeds, a loss is a sample of the seed's spread
            "val_loss": statistics.mean(r["val_loss"] for r in rs),
            "full_val_loss": statistics.mean(r["full_val_loss"] for r in rs),
            "seeds": [r["seed"] for r in rs],
            "load_1min": [r["load_1min"] for r in rs],
        }
        if "nanogpt" in runs and n != "nanogpt":
            ratios = [r["wall_s"] / b["wall_s"] for r, b in zip(rs, runs["nanogpt"], strict=True)]
            row["ratio_to_nanogpt"] = statistics.median(ratios)
            row["ratio_per_round"] = ratios
        out.append(row)
    return out


def markdown(result: dict) -> str:
    lines = [
        f"{result['steps']} steps, {result['threads']} threads per process (ranks: "
        f"{max(1, result['threads'] // result['nproc'])} each), {result['cpus']} CPUs, "
        f"our data from {result['data']}; seeds by round {result['seeds']}, losses their mean",
        "",
        "| run | wall s | / nanoGPT (per round) | per step ms | val loss | full val "
        "| load (1 min) |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in result["rows"]:
        ratio = "–"
        if "ratio_to_nanogpt" in r:
            per = ", ".join(f"{x:.2f}" for x in r["ratio_per_round"])
            ratio = f"{r['ratio_to_nanogpt']:.2f} ({per})"
        load = ", ".join(f"{x:.1f}" for x in r["load_1min"])
        lines.append(
            f"| {r['contender']} | {r['wall_s']:.1f} | {ratio} | {r['step_ms']:.1f} | "
            f"{r['val_loss']:.4f} | {r['full_val_loss']:.4f} | {load} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    result = run(args)
    report(result, markdown(result), args.out, args.md)


if __name__ == "__main__":
    main()
