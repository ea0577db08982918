"""DiLoCo's quality against per-step sync: nanoGPT's CPU shakespeare_char recipe (the one
bench_nanogpt.py runs) trained by N replica groups at equal tokens, per-step sync beside
`ft.semi_sync=diloco` at each H (`ft.sync_steps`) and outer learning rate, the held-out
loss of each run's final (global) model (docs/fault_tolerance.md, "Quality").

    python scripts/benchmarks/diloco_quality.py --input input.txt --md quality.md
    python scripts/benchmarks/diloco_quality.py --input input.txt --steps 200 \\
        --sync-steps 10 --outer-lrs 0.7          # a quick look

`--input` is the tiny-shakespeare text the user brings (nothing is downloaded); it is
prepared once with `scripts/prepare_text.py --tokenizer char` (a held-out tenth). Each run
is a Lighthouse of its own (torchft's, on the loopback address) and `--groups` processes of
`train.py`, one rank each with `--threads` torch threads: `ft.replica_groups=N`, so the
recipe's global batch of 12 is cut into N groups' slots and every run sees the same tokens
in the same order. The rows:

    per step        ft.semi_sync=null: the groups' gradients averaged every step (what
                    one process on the whole batch computes, tests/test_ft.py)
    H=h, lr=l       ft.semi_sync=diloco ft.sync_steps=h ft.outer_lr=l, outer momentum 0.9
                    (Nesterov), one fragment, fp32 on the wire, the inner AdamW of the recipe

The figure is `eval/loss` of final_metrics.json (rank 0 of group 0, the held-out split
evaluated once, at the last step, after the last sync: the global copy every group ends
with); its ratio to the per-step row says how much the longer rounds cost.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from scripts.benchmarks.bench import report  # noqa: E402
from scripts.benchmarks.bench_nanogpt import our_recipe  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--input", type=Path, required=True, help="the tiny-shakespeare text")
    ap.add_argument("--groups", type=int, default=4, help="replica groups (N)")
    ap.add_argument("--steps", type=int, default=2000, help="the recipe's iterations")
    ap.add_argument("--sync-steps", default="1,10,50,100", help="the H values")
    ap.add_argument("--outer-lrs", default="0.3,0.5,0.7,1.0", help="the outer learning rates")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per group")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work", type=Path, default=Path("diloco_quality"), help="runs go here")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds a run may take")
    ap.add_argument("--out", type=Path, help="JSON results")
    ap.add_argument("--md", type=Path, help="markdown table")
    a = ap.parse_args(argv)
    if not a.input.is_file():
        ap.error(f"--input {a.input} is not a file: give the tiny-shakespeare text")
    if a.groups < 1 or a.steps < 1:
        ap.error(f"--groups {a.groups} and --steps {a.steps} must be >= 1")
    if 12 % a.groups:
        ap.error(f"--groups {a.groups} must divide the recipe's batch of 12")
    a.sync_steps = [int(h) for h in a.sync_steps.split(",") if h]
    a.outer_lrs = [float(x) for x in a.outer_lrs.split(",") if x]
    return a


def prepared(a: argparse.Namespace) -> Path:
    """The text as char tokens, once (the held-out tenth, as bench_nanogpt's option)."""
    out = a.work / "data"
    if not (out / "meta.json").is_file():
        cmd = [sys.executable, str(ROOT / "scripts" / "prepare_text.py"), str(a.input)]
        cmd += ["--out", str(out), "--tokenizer", "char", "--val-fraction", "0.1"]
        subprocess.run(cmd, check=True)
    return out


def one_run(a: argparse.Namespace, data: Path, name: str, ft_args: list[str]) -> dict:
    """The recipe over a.groups replica groups with `ft_args`; the held-out loss of group
    0's final model, every group's exit code and the run's wall time."""
    out = a.work / name
    final = out / "g0" / "final_metrics.json"
    if final.is_file():  # a sweep stopped half-way goes on where it was
        return json.loads((out / "result.json").read_text())
    out.mkdir(parents=True, exist_ok=True)
    from torchft.coordination import LighthouseServer  # in this process: it ends with it

    lh = LighthouseServer(bind="127.0.0.1:0", min_replicas=a.groups, join_timeout_ms=60_000)
    address = "http://127.0.0.1:" + lh.address().rsplit(":", 1)[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SHARDTRAIN_FAULT", "RANK"))}
    threads = str(a.threads)
    env.update(OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads, RUST_LOG="warn")
    started = time.monotonic()
    recipe = our_recipe(data, a.steps)
    # one evaluation, at the end: the figure compared (the recipe's evaluations between
    # syncs would be of the global copy too, and cost every group the same)
    recipe = [x for x in recipe if not x.startswith("train.eval_every=")]
    groups = []
    for g in range(a.groups):
        argv = [sys.executable, "train.py", *recipe, f"train.eval_every={a.steps}",
                f"train.log_every={min(100, a.steps)}", f"seed={a.seed}", "ckpt.every=0",
                "ft.enabled=true", f"ft.replica_groups={a.groups}", f"ft.replica_group={g}",
                f"ft.lighthouse={address}", *ft_args,
                f"hydra.run.dir={out / f'g{g}'}"]  # fmt: skip
        with open(out / f"g{g}.log", "w") as log:
            groups.append(
                subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
            )
    codes: list[int | str | None] = [None] * a.groups
    deadline = time.monotonic() + a.timeout
    while any(c is None for c in codes):
        codes = [p.poll() for p in groups]
        if time.monotonic() > deadline:
            for g, p in enumerate(groups):
                if codes[g] is None:
                    p.kill()
                    codes[g] = f"killed after {a.timeout:g} s"
        time.sleep(0.5)
    lh.shutdown()
    result = {"codes": codes, "wall_s": time.monotonic() - started, "val_loss": None}
    if final.is_file():
        result["val_loss"] = json.loads(final.read_text())["eval/loss"]
        metrics = [out / f"g{g}" / "final_metrics.json" for g in range(a.groups)]
        finals = [json.loads(m.read_text()) for m in metrics if m.is_file()]
        # every group ends with the same (global) model: the same held-out loss
        result["groups_agree"] = len({f["eval/loss"] for f in finals}) == 1
    (out / "result.json").write_text(json.dumps(result))
    print(f"{name}: {result}", flush=True)
    return result


def table(a: argparse.Namespace, results: dict) -> str:
    base = results["per step"]["val_loss"]
    lines = [
        f"{a.groups} replica groups, nanoGPT's shakespeare_char recipe, {a.steps} steps "
        "(equal tokens); held-out loss of the final model, and its ratio to per-step sync",
        "",
        "| outer lr | " + " | ".join(f"H = {h}" for h in a.sync_steps) + " |",
        "|---|" + "---:|" * len(a.sync_steps),
    ]
    for lr in a.outer_lrs:
        cells = []
        for h in a.sync_steps:
            r = results[f"H={h} lr={lr:g}"]
            v = r["val_loss"]
            cells.append("failed" if v is None else f"{v:.4f} ({v / base:.3f})")
        lines.append(f"| {lr:g} | " + " | ".join(cells) + " |")
    lines += ["", f"per-step sync: {base:.4f}", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    a.work.mkdir(parents=True, exist_ok=True)
    data = prepared(a)
    results = {"per step": one_run(a, data, "per_step", [])}
    if results["per step"]["val_loss"] is None:
        print(f"per-step sync failed: {results['per step']['codes']}", file=sys.stderr)
        return 1
    for h in sorted(a.sync_steps, reverse=True):  # the fewest syncs, the quickest, first
        for lr in a.outer_lrs:
            ft_args = ["ft.semi_sync=diloco", f"ft.sync_steps={h}", f"ft.outer_lr={lr}"]
            results[f"H={h} lr={lr:g}"] = one_run(a, data, f"h{h}_lr{lr:g}", ft_args)
    report(results, table(a, results), a.out, a.md)
    return 0 if all(r["val_loss"] is not None for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
