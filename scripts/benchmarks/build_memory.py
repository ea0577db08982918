"""Memory and time from process start to the first training step, per rank: the ordinary
build next to the meta build (train.meta_build), per mode, for model=gpt, and for a
pretrained model=hf directory of the same size that the script writes once: the tables of
docs/bench.md, "Building big models".

    python scripts/benchmarks/build_memory.py --nproc 4 --n-layer 12 --n-embd 1024 --n-head 16 \\
        --pretrained /tmp/gpt2_150m --out build.json --md build.md
    python scripts/benchmarks/build_memory.py --nproc 4 --modes fsdp --builds meta --n-layer 36 \\
        --n-embd 1536 --n-head 12 --steps 3 --pretrained /tmp/gpt2_1b   # train 3 steps

Each case is one `train.py` run under torchrun (as scripts/benchmarks/bench.py starts its ranks),
with the overrides the table lists: data=tokens (synthetic), `--batch-per-rank` windows
of `--block-size` tokens per rank, AdamW, no evaluation, no checkpoint. Nothing of the
trainer is changed: each rank runs this file, which imports what train.py imports, reads
its memory, wraps four functions of trainer.run.loop (build_run, build_engine, train_step,
log_metrics) to note times, memory and losses, and runs train.py as `python train.py`
would. With `--steps 0` every rank stops at the first step (after a barrier); otherwise
it trains that many steps. Checkpoints are not written (`trainer.checkpoint.maybe_save`
is replaced by a no-op: a 1B model's would be 16 GB of disk), nor the final model.

The two peaks: [Note: what the build peak is] beside proc_status. The formula column is
`trainer.estimate`'s build peak for the case (scripts/estimate.py prints it: `build` and
`meta build`), computed on the meta model. Cases too large for the machine's free memory
are skipped ([Note: cases that do not fit]).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

MODES = ("ddp", "zero", "fsdp")
BUILDS = ("ordinary", "meta")
GiB = 2**30
MiB = 2**20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nproc", type=int, default=4, help="ranks P")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--builds", default=",".join(BUILDS), help="ordinary, meta")
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--n-head", type=int, default=2)
    ap.add_argument("--n-embd", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=64, help="tokens per window")
    ap.add_argument("--vocab-size", type=int, default=256)
    ap.add_argument("--batch-per-rank", type=int, default=1, help="windows per rank and step")
    ap.add_argument("--steps", type=int, default=0, help="0: stop at the first step")
    ap.add_argument(
        "--pretrained",
        type=Path,
        help="an HF GPT-2 directory of the same sizes, written here unless it exists; "
        "adds the cases model=hf model.path=DIR",
    )
    ap.add_argument("--no-gpt", action="store_true", help="only the --pretrained cases")
    ap.add_argument("--margin-gib", type=float, default=6.0, help="memory left to others")
    ap.add_argument("--libs-gib", type=float, default=0.5, help="per rank, for the check")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--out", type=Path, help="JSON results")
    ap.add_argument("--md", type=Path, help="markdown table")
    ap.add_argument("--worker", type=Path, help=argparse.SUPPRESS)  # a rank: its JSON dir
    ap.add_argument("--write-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*", help=argparse.SUPPRESS)  # the worker's train.py's
    args = ap.parse_intermixed_args(argv)
    args.modes = [m for m in args.modes.split(",") if m]
    args.builds = [b for b in args.builds.split(",") if b]
    if set(args.modes) - set(MODES) or set(args.builds) - set(BUILDS):
        ap.error(f"modes from {', '.join(MODES)}; builds from {', '.join(BUILDS)}")
    return args


# ---------------------------------------------------------------------------------------
# Memory of this process


# [Note: what the build peak is]
# Per rank, `build peak` = the resident set's high-water mark when the first step starts
# (`getrusage(RUSAGE_SELF).ru_maxrss`, kept by the kernel, so no spike is missed) minus
# the resident set right after the imports (torch's and the other libraries' pages,
# about the same in every mode and case). It covers Hydra, the process group, the data,
# building the model, the engine (broadcast, sharding, values from the source) and
# `check_fit`'s forward. A checkpoint read through safetensors' mmap also counts the pages
# of the file a rank touched: page cache, shared between the ranks and given back under
# pressure, not memory the process holds. So a second figure, `anon peak`, is the
# anonymous resident set (RssAnon of /proc/self/status, the process's own memory: every
# tensor) sampled every 5 ms over the same window, minus its value after the imports.
# Without a mapped checkpoint the two agree to a few MB; with one, `anon peak` is the
# figure to read. Libraries loaded later (transformers' model code) count in both; they
# are imported before the baseline where the case needs them.
def proc_status() -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon, RssFile of this process, in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) * 1024  # "VmRSS:   123456 kB"
    return out


def max_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux


class AnonPeak(threading.Thread):
    """The highest RssAnon, read every `every` seconds, per stretch of the run ([Note:
    what the build peak is]): `mark(name)` ends the current stretch under `name`."""

    def __init__(self, every: float = 0.005) -> None:
        super().__init__(daemon=True)
        self.every, self.peak = every, proc_status()["RssAnon"]
        self.stretches: dict[str, int] = {}
        self._lock = threading.Lock()

    def run(self) -> None:
        while True:
            now = proc_status()["RssAnon"]
            with self._lock:
                self.peak = max(self.peak, now)
            time.sleep(self.every)

    def mark(self, name: str) -> int:
        """The peak of the stretch that ends now, kept as `stretches[name]`."""
        now = proc_status()["RssAnon"]
        with self._lock:
            peak, self.peak = max(self.peak, now), now
        self.stretches[name] = peak
        return peak


# ---------------------------------------------------------------------------------------
# One rank: train.py with four functions of trainer.run.loop wrapped


def worker(args: argparse.Namespace) -> None:
    """Runs train.py with `args.overrides` as this rank; writes rank<r>.json under
    `args.worker` at the first step and, when it trains, again at the end."""
    import runpy

    import torch

    import trainer.checkpoint
    from trainer.run import loop

    if any(o == "model=hf" for o in args.overrides):  # its code, before the baseline
        import transformers.models.gpt2.modeling_gpt2  # noqa: F401

    torch.set_num_threads(args.threads)
    base = proc_status()
    sampler = AnonPeak()
    sampler.start()
    rank = int(os.environ["RANK"])
    rec: dict = {
        "rank": rank,
        "rss_after_imports": base["VmRSS"],
        "anon_after_imports": base["RssAnon"],
    }
    out = args.worker / f"rank{rank}.json"
    started = time.perf_counter()

    def timed(name: str, fn, before: str, after: str | None = None):
        """`fn` timed; the anonymous peak before it (`before`) and in it (`name`) apart."""

        def wrapper(*a, **kw):
            sampler.mark(before)
            t = time.perf_counter()
            result = fn(*a, **kw)
            rec[f"{name}_s"] = time.perf_counter() - t
            sampler.mark(after or name)
            return result

        return wrapper

    # stretches: set-up (process group, run directory), model (and data), engine (values
    # from the source, sharding), after_engine (check_fit, writers), resume (to step 1)
    loop.build_run = timed("build_run", loop.build_run, "setup", "after_engine")
    loop.build_engine = timed("build_engine", loop.build_engine, "model", "engine")
    trainer.checkpoint.maybe_save = lambda *a, **kw: None  # see the module's docstring
    train_step, log_metrics, finish = loop.train_step, loop.log_metrics, loop.finish
    first: list[int] = []

    def step_hook(run, step: int) -> int:
        if not first:
            first.append(step)
            status = proc_status()
            rec.update(
                to_first_step_s=time.perf_counter() - started,
                max_rss_at_first_step=max_rss(),
                anon_peak_at_first_step=max(sampler.mark("resume"), *sampler.stretches.values()),
                anon_peaks=sampler.stretches.copy(),
                rss_at_first_step=status["VmRSS"],
                rss_file_at_first_step=status["RssFile"],
                anon_at_first_step=status["RssAnon"],
            )
            out.write_text(json.dumps(rec))
            if args.steps == 0:  # every rank is here: stop all at once
                torch.distributed.barrier()
                os._exit(0)
        t = time.perf_counter()
        step = train_step(run, step)
        rec.setdefault("step_s", []).append(time.perf_counter() - t)
        return step

    def log_hook(run, step: int) -> None:
        log_metrics(run, step)
        if "train/loss" in run.last:  # rank 0
            rec.setdefault("loss", {})[step] = run.last["train/loss"]
            rec["last_metrics"] = {
                k: v for k, v in run.last.items() if "memory" in k or "peak" in k
            }

    def finish_hook(run):
        rec.update(max_rss_at_end=max_rss(), anon_peak_after_first_step=sampler.mark("steps"))
        summary = finish(run)
        out.write_text(json.dumps(rec))
        return summary

    loop.train_step, loop.log_metrics, loop.finish = step_hook, log_hook, finish_hook
    sys.argv = [str(ROOT / "train.py"), *args.overrides]
    runpy.run_path(str(ROOT / "train.py"), run_name="__main__")


# ---------------------------------------------------------------------------------------
# The cases, launched one by one


def gpt_overrides(args: argparse.Namespace) -> list[str]:
    return [
        "model=gpt",
        f"model.n_layer={args.n_layer}",
        f"model.n_head={args.n_head}",
        f"model.n_embd={args.n_embd}",
        f"model.block_size={args.block_size}",
        f"model.vocab_size={args.vocab_size}",
    ]


def common_overrides(args: argparse.Namespace) -> list[str]:
    return [
        "data=tokens",
        f"data.dataset.block_size={args.block_size}",
        f"data.dataset.vocab_size={args.vocab_size}",
        f"data.dataset.n={max(64, 4 * args.batch_per_rank * args.nproc)}",
        f"train.batch_size={args.batch_per_rank * args.nproc}",
        f"train.steps={max(1, args.steps)}",
        "train.log_every=1",
        "train.eval_every=0",
        "train.save_final=false",
    ]


def write_pretrained(args: argparse.Namespace) -> float | None:
    """An HF GPT-2 of the GPT's sizes (tied embeddings, as GPT-2's) written by
    save_pretrained in shards of 1 GB; None if the directory holds one already, else the
    seconds it took."""
    if (args.pretrained / "config.json").is_file():
        return None
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    t = time.perf_counter()
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=args.vocab_size,
        n_positions=args.block_size,
        n_embd=args.n_embd,
        n_layer=args.n_layer,
        n_head=args.n_head,
        bos_token_id=args.vocab_size - 1,
        eos_token_id=args.vocab_size - 1,
    )
    model = GPT2LMHeadModel(config)
    model.save_pretrained(str(args.pretrained), max_shard_size="1GB")
    del model
    return time.perf_counter() - t


def cases(args: argparse.Namespace) -> list[dict]:
    out = []
    models = [] if args.no_gpt else [("gpt", gpt_overrides(args))]
    if args.pretrained:
        models.append(("hf pretrained", ["model=hf", f"model.path={args.pretrained}"]))
    for model, overrides in models:
        for mode in args.modes:
            for build in args.builds:
                meta = f"train.meta_build={'true' if build == 'meta' else 'false'}"
                out.append(
                    {
                        "model": model,
                        "mode": mode,
                        "build": build,
                        "overrides": [*overrides, f"mode={mode}", meta, *common_overrides(args)],
                    }
                )
    return out


def formulas(args: argparse.Namespace, mode: str) -> dict:
    """trainer.estimate's figures for the GPT of these sizes in `mode` at P ranks."""
    from trainer.estimate import Cluster, compose_modes, estimate

    overrides = [*gpt_overrides(args), f"mode={mode}", *common_overrides(args)]
    cfgs = compose_modes(overrides, args.nproc)
    c = Cluster(args.nproc, args.nproc, 1e9, 1e9, 1e12, 0.4)
    return estimate(cfgs, c, 1e15, alternative=False)[mode]


# [Note: cases that do not fit]
# Before each case the script checks /proc/meminfo's MemAvailable: a case whose estimate
# (formula per rank plus `--libs-gib` of each rank's own library memory, times the ranks;
# with --steps, the training figures of trainer.estimate too) is above MemAvailable minus
# `--margin-gib` is skipped and listed as such (other jobs share the machine).
def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def needed(args: argparse.Namespace, fig: dict, build: str) -> float:
    """Bytes the case could take on the machine, all ranks ([the module's docstring])."""
    per_rank = fig["build_peak_bytes"][build]
    if args.steps:
        per_rank = max(per_rank, fig["total_bytes"])
    return args.nproc * (per_rank + args.libs_gib * GiB)


def run_case(args: argparse.Namespace, case: dict, fig: dict, tmp: Path) -> dict:
    from scripts.benchmarks.bench import launch

    row = {k: case[k] for k in ("model", "mode", "build")}
    row["command"] = "torchrun --standalone --nproc-per-node={} train.py {}".format(
        args.nproc, " ".join(case["overrides"])
    )
    row["formula_bytes"] = fig["build_peak_bytes"][case["build"]]
    need, free = needed(args, fig, case["build"]), mem_available()
    row["needed_bytes"], row["available_bytes"] = need, free
    if need > free - args.margin_gib * GiB:
        row["skipped"] = (
            f"needs about {need / GiB:.1f} GiB, {free / GiB:.1f} GiB available, "
            f"{args.margin_gib:g} GiB left to others"
        )
        print(f"skip {row['model']} {row['mode']} {row['build']}: {row['skipped']}", flush=True)
        return row
    d = tmp / f"{len(list(tmp.iterdir()))}"
    d.mkdir()
    hydra_dir = f"hydra.run.dir={d / 'run'}"
    own = ["--worker", str(d), "--threads", str(args.threads), "--steps", str(args.steps)]
    row["load_before"] = os.getloadavg()[0]
    t = time.perf_counter()
    rc = launch(__file__, args.nproc, [*own, "--", *case["overrides"], hydra_dir])
    row["wall_s"] = time.perf_counter() - t
    row["load_after"] = os.getloadavg()[0]
    if rc:
        row["failed"] = f"exit code {rc}"
        return row
    ranks = [json.loads((d / f"rank{r}.json").read_text()) for r in range(args.nproc)]
    row["ranks"] = ranks
    row["peak_bytes"] = [r["max_rss_at_first_step"] - r["rss_after_imports"] for r in ranks]
    row["anon_peak_bytes"] = [r["anon_peak_at_first_step"] - r["anon_after_imports"] for r in ranks]
    row["build_run_s"] = max(r["build_run_s"] for r in ranks)
    row["build_engine_s"] = max(r["build_engine_s"] for r in ranks)
    row["to_first_step_s"] = max(r["to_first_step_s"] for r in ranks)
    if args.steps:
        row["loss"] = ranks[0].get("loss", {})
        row["step_s"] = [max(s) for s in zip(*(r["step_s"] for r in ranks), strict=True)]
        row["run_peak_bytes"] = [r["max_rss_at_end"] - r["rss_after_imports"] for r in ranks]
        row["run_anon_peak_bytes"] = [
            max(r["anon_peak_at_first_step"], r["anon_peak_after_first_step"])
            - r["anon_after_imports"]
            for r in ranks
        ]
        row["metrics"] = ranks[0].get("last_metrics", {})
    print(
        f"{row['model']} {row['mode']} {row['build']}: peak {max(row['peak_bytes']) / MiB:.0f}"
        f" MiB (anon {max(row['anon_peak_bytes']) / MiB:.0f}), formula "
        f"{row['formula_bytes'] / MiB:.0f} MiB, build {row['build_run_s']:.1f} s",
        flush=True,
    )
    return row


def run(args: argparse.Namespace) -> dict:
    import torch

    from scripts.benchmarks.bench import without_nproc

    result: dict = {
        "config": {
            **{k: getattr(args, k) for k in ("nproc", "n_layer", "n_head", "n_embd")},
            **{k: getattr(args, k) for k in ("block_size", "vocab_size", "batch_per_rank")},
            "steps": args.steps,
            "threads": args.threads,
            "torch": torch.__version__,
        },
        "rows": [],
    }
    figs = {m: formulas(args, m) for m in args.modes}
    written_needs = 4 * figs[args.modes[0]]["params"] + 1.5 * GiB  # the model, libraries
    if args.pretrained and not (args.pretrained / "config.json").is_file():
        if written_needs > mem_available() - args.margin_gib * GiB:
            raise SystemExit(f"writing {args.pretrained} needs about {written_needs / GiB:.1f} GiB")
    if args.pretrained:  # in a process of its own: its freed heap is not given back
        cmd = [sys.executable, __file__, "--write-only", *without_nproc(None)]
        written = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        result["pretrained_written_s"] = json.loads(written.strip().splitlines()[-1])
        result["pretrained_bytes"] = sum(
            f.stat().st_size for f in args.pretrained.glob("*.safetensors")
        )
    result["config"]["psi"] = figs[args.modes[0]]["params"]
    result["formulas"] = {m: f["build_peak_bytes"] for m, f in figs.items()}
    with tempfile.TemporaryDirectory() as tmp:
        for case in cases(args):
            result["rows"].append(run_case(args, case, figs[case["mode"]], Path(tmp)))
    return result


# ---------------------------------------------------------------------------------------
# Output


def _mib(values: list[int]) -> str:
    return " / ".join(f"{v / MiB:.0f}" for v in values)


def markdown(result: dict) -> str:
    c = result["config"]
    lines = [
        f"{c['nproc']} ranks, GPT {c['n_layer']} layers x {c['n_embd']} wide, {c['n_head']} "
        f"heads, block {c['block_size']}, vocab {c['vocab_size']} (Ψ = {c['psi']:,}, "
        f"4Ψ = {4 * c['psi'] / MiB:,.0f} MiB), {c['batch_per_rank']} window(s) per rank, "
        f"AdamW, torch {c['torch']}, {c['threads']} thread(s) per rank.",
        "",
        "| model | mode | build | peak MiB, ranks 0-{} | anon peak MiB | formula MiB | "
        "build_run s | of which build_engine s | to first step s | load before / after |".format(
            c["nproc"] - 1
        ),
        "|---|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in result["rows"]:
        head = f"| {r['model']} | {r['mode']} | {r['build']} |"
        if "peak_bytes" not in r:
            why = r.get("skipped") or r.get("failed")
            lines.append(f"{head} {why} | | {r['formula_bytes'] / MiB:,.0f} | | | | |")
            continue
        lines.append(
            f"{head} {_mib(r['peak_bytes'])} | {_mib(r['anon_peak_bytes'])} "
            f"| {r['formula_bytes'] / MiB:,.0f} | {r['build_run_s']:.1f} "
            f"| {r['build_engine_s']:.1f} | {r['to_first_step_s']:.1f} "
            f"| {r['load_before']:.1f} / {r['load_after']:.1f} |"
        )
    trained = [r for r in result["rows"] if "loss" in r]
    if trained:
        lines += [
            "",
            "| model | mode | build | losses | step s | run peak MiB | run anon peak MiB |",
            "|---|---|---|---|---|---:|---:|",
        ]
        for r in trained:
            losses = ", ".join(f"{v:.4f}" for v in r["loss"].values())
            steps = ", ".join(f"{s:.1f}" for s in r["step_s"])
            lines.append(
                f"| {r['model']} | {r['mode']} | {r['build']} | {losses} | {steps} "
                f"| {_mib(r['run_peak_bytes'])} | {_mib(r['run_anon_peak_bytes'])} |"
            )
    if result.get("pretrained_bytes"):
        written = result.get("pretrained_written_s")
        lines += [
            "",
            f"Pretrained directory: {result['pretrained_bytes'] / 2**30:.2f} GiB of safetensors"
            + (f", written in {written:.0f} s." if written else " (written before)."),
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker is not None:  # one rank, under torchrun
        worker(args)
        return
    if args.write_only:
        print(json.dumps(write_pretrained(args)))
        return
    from scripts.benchmarks.bench import report

    result = run(args)
    report(result, markdown(result), args.out, args.md)


if __name__ == "__main__":
    main()
