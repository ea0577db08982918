"""Run ddp, zero and fsdp on the same config and world size; compare memory and traffic.

    python scripts/compare_modes.py                      # 2 and 4 ranks, MLP 1024x4
    python scripts/compare_modes.py --nproc 4 --out runs/cmp model.hidden=2048 optim=sgd
    python scripts/compare_modes.py --nproc 4 --shard-group-size 2   # + hybrid sharding
    tensorboard --logdir runs/compare                    # CUSTOM SCALARS tab

Each mode runs as `torchrun --standalone --nproc-per-node=P train.py mode=M ...` into
`<out>/p<P>/<mode>`, one after the other, with the same overrides, its progress shown
as it runs. `--shard-group-size S` adds `zero_hybrid` and `fsdp_hybrid` (zero and fsdp
with `mode.shard_group_size=S`) at every world size that S divides and exceeds. Their
checkpoints go to a temporary directory, removed after each run (`--keep-checkpoints`:
under each run directory, as a plain run). Afterwards this script
reads each run's `final_metrics.json` (rank 0 writes the last logged figures there),
prints the headline table and leaves:

  <out>/compare_modes.md     the headline (model state per rank, saved vs ddp), then the
                             full table of measured vs expected memory and traffic
  <out>/memory_chart.png     model-state MiB per rank per mode (scripts/memory_chart.py;
                             needs matplotlib; `--chart PATH` to put it elsewhere)
  <out>/by_world_size/<mode> one TensorBoard run per mode whose x-axis (step) is the world
                             size: model state per rank in MiB, fraction of ddp, saved
                             vs ddp, formula, peak, traffic; with the Custom Scalars layout
                             that leads with them and the headline as a text summary
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]  # trainer/, and memory_chart beside this file

from memory_chart import chart  # noqa: E402  (scripts/, beside this file)

from trainer.observe.tb_layout import run_layout  # noqa: E402

MiB = 2**20
MODES = ("ddp", "zero", "fsdp")
# A model where parameters, not activations or the runtime, dominate model state, and
# few steps: each run takes seconds on CPU.
DEFAULTS = [
    "model=mlp",
    "model.hidden=1024",
    "model.depth=4",
    "train.steps=20",
    "train.log_every=10",
    "train.batch_size=64",
    "train.save_final=false",
]


HYBRID = "_hybrid"  # suffix of a mode run with mode.shard_group_size


def runs_at(modes: list[str], nproc: int, shard_group_size: int) -> list[str]:
    """The runs at one world size: the modes, then their hybrid variants where S fits."""
    hybrid = shard_group_size and nproc % shard_group_size == 0 and shard_group_size < nproc
    extra = [m + HYBRID for m in ("zero", "fsdp") if m in modes] if hybrid else []
    return list(modes) + extra


def run_mode(
    mode: str,
    nproc: int,
    run_dir: Path,
    overrides: list[str],
    ckpt_dir: Path | None,
    shard_group_size: int = 0,
) -> dict:
    """One training run, its output (progress bar, final line) going to the terminal.
    `mode` may name a hybrid run (`zero_hybrid`): that mode with `shard_group_size`."""
    label, mode = mode, mode.removesuffix(HYBRID)
    if label != mode:
        overrides = [f"mode.shard_group_size={shard_group_size}", *overrides]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(ROOT / "train.py"),
        f"mode={mode}",
        f"hydra.run.dir={run_dir}",
        *DEFAULTS,
        *([f"ckpt.dir={ckpt_dir}"] if ckpt_dir is not None else []),
        *overrides,
    ]
    print(f"\n== {label} on {nproc} ranks -> {run_dir}", flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT)
    if proc.returncode != 0:
        sys.exit(f"error: {label} on {nproc} ranks failed (exit {proc.returncode}); see above")
    print(f"== {label} on {nproc} ranks: {time.perf_counter() - t0:.1f} s", flush=True)
    return json.loads((run_dir / "final_metrics.json").read_text())


# ---------------------------------------------------------------------------------------
# The headline


def sig3(x: float) -> str:
    """`x` to 3 significant digits, without an exponent: 48.7, 0.438, 1230 (whole numbers
    keep their digits)."""
    if x == 0:
        return "0"
    return f"{x:.{max(0, 2 - math.floor(math.log10(abs(x))))}f}"


def state_mib(f: dict) -> float:
    return f["memory/model_state_MiB/max"]


def all_modes(all_results: dict[int, dict[str, dict]]) -> list[str]:
    """Every run label of any world size, in the order they ran."""
    return list(dict.fromkeys(m for r in all_results.values() for m in r))


def headline(all_results: dict[int, dict[str, dict]]) -> str:
    """Mode x world size: model state MiB per rank, and what it saves against ddp."""
    worlds = sorted(all_results)
    modes = all_modes(all_results)
    head = ["mode"] + [c for p in worlds for c in (f"P={p}: MiB per rank", "saved vs ddp")]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for mode in modes:
        cells = [f"`{mode}`"]
        for p in worlds:
            if mode not in all_results[p]:  # a hybrid run where S does not fit
                cells += ["-", "-"]
                continue
            f, base = all_results[p][mode], all_results[p].get("ddp")
            mine = state_mib(f)
            if base is None:
                saved = "n/a"
            elif mode == "ddp":
                saved = "(baseline)"
            else:
                d = state_mib(base) - mine
                saved = f"{sig3(d)} MiB ({sig3(100 * d / state_mib(base))} %)"
            cells += [sig3(mine), saved]
        lines.append("| " + " | ".join(cells) + " |")
    gaps = [
        round((f["memory/model_state_MiB/max"] - f["memory/expected/model_state_MiB"]) * MiB)
        for r in all_results.values()
        for f in r.values()
    ]
    lines += [
        "",
        "Model state = parameters + gradients + optimizer state (+ fp32 masters), held by "
        "the rank with the most right after the optimizer step. Measured; every figure is "
        f"within {max(gaps)} bytes of its formula (AdamW's step counters, ddp's used-flags, "
        "padding).",
    ]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------
# The table


def _mib(n: float) -> str:
    return f"{n:.2f}"


def _pair(final: dict, kind: str) -> str:
    measured = final.get(f"memory/{kind}_MiB/max", 0.0)  # absent: zero on every rank
    want = final.get(f"memory/expected/{kind}_MiB", 0.0)
    return f"{_mib(measured)} / {_mib(want)}"


def _peak(final: dict) -> tuple[str, str]:
    """(the peak in MiB, what it is), whichever this run measured."""
    for name, what in (("peak_step", "CPU step"), ("peak_cuda_allocated", "CUDA step")):
        if f"memory/{name}_MiB/max" in final:
            return _mib(final[f"memory/{name}_MiB/max"]), what
    return "-", ""


def table(results: dict[str, dict], nproc: int) -> str:
    """One markdown table for one world size; figures per rank (max over ranks)."""
    base = results.get("ddp")
    lines = [
        f"### {nproc} ranks",
        "",
        "Memory in MiB per rank, `measured / expected` (max over ranks; measured right "
        "after the optimizer step); gap = measured model state minus formula, in bytes. "
        "Peak: on CPU the tensors live at one step's high point (model state at its start "
        "+ heap growth during it), on GPU the CUDA allocator's max allocated. Traffic in MiB "
        "sent per rank per step, counted by the comm module vs the ring formula; of it, "
        "what hybrid runs send between shard groups.",
        "",
        "| mode | params | fp32 masters | grads | optimizer | comm buffers | model state | "
        "gap | model state vs ddp (measured / formula) | fsdp units in flight (expected) | "
        "peak | sent per step / ring | across groups / formula | algbw GB/s | busbw GB/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mode, f in results.items():
        ratio = "n/a"
        if base is not None:
            measured = state_mib(f) / state_mib(base)
            formula = f["memory/expected/model_state_MiB"] / base["memory/expected/model_state_MiB"]
            ratio = f"{measured:.4f} / {formula:.4f}"
        expected_state = f["memory/expected/model_state_MiB"]
        units = f.get("memory/expected/working_set_MiB", expected_state) - expected_state
        gap = round((state_mib(f) - expected_state) * MiB)
        sent = f.get("comm/bytes_per_step/total", 0.0) / MiB
        lines.append(
            "| "
            + " | ".join(
                [
                    f"`{mode}`",
                    *(_pair(f, k) for k in ("params", "master", "grads", "optimizer")),
                    _mib(f.get("memory/comm_MiB/max", 0.0)),
                    _pair(f, "model_state"),
                    f"{gap:+d} B",
                    ratio,
                    _mib(units) if units else "-",
                    " ".join(_peak(f)),
                    f"{_mib(sent)} / {_mib(f.get('comm/expected_bytes_per_step', 0.0) / MiB)}",
                    _across(f),
                    f"{f.get('comm/algbw_GBps', 0):.3f}",
                    f"{f.get('comm/busbw_GBps', 0):.3f}",
                ]
            )
            + " |"
        )
    return "\n".join(lines) + "\n"


def _across(final: dict) -> str:
    """MiB sent between shard groups per step, measured / formula; '-' without groups."""
    want = final.get("comm/expected_bytes_per_step_across_groups", 0.0)
    if not want:
        return "-"
    got = final.get("comm/bytes_per_step/across_groups", 0.0)
    return f"{_mib(got / MiB)} / {_mib(want / MiB)}"


def order_check(results: dict[str, dict]) -> str:
    """States whether per-rank model state is ordered fsdp < zero < ddp."""
    present = [m for m in ("fsdp", "zero", "ddp") if m in results]
    sizes = [state_mib(results[m]) for m in present]
    ok = all(a < b for a, b in zip(sizes, sizes[1:], strict=False))
    order = " < ".join(present)
    return f"model state per rank {order}: {'yes' if ok else 'NO'}"


# ---------------------------------------------------------------------------------------
# TensorBoard layout and the chart


# What each mode's summary run logs at step = world size: (tag, chart title), the first
# two side by side at the top of the layout.
COMPARE_CHARTS = (
    ("compare/model_state_MiB", "model state per rank, MiB (measured) - x: world size"),
    ("compare/fraction_of_ddp", "model state as a fraction of ddp's (measured) - x: world size"),
    ("compare/formula_model_state_MiB", "model state per rank, MiB (formula) - x: world size"),
    ("compare/saved_vs_ddp_MiB", "saved per rank vs ddp, MiB (measured) - x: world size"),
    ("compare/peak_step_MiB", "peak per rank, MiB (CPU: one step's high point) - x: world size"),
    ("compare/peak_cuda_allocated_MiB", "peak per rank, MiB (CUDA: one step) - x: world size"),
    ("compare/sent_per_step_MiB", "sent per rank per step, MiB (measured) - x: world size"),
)
COMPARE_CATEGORY = "modes side by side (x: world size; one line per mode)"


def summary_scalars(f: dict, base: dict | None) -> dict[str, float]:
    """One run's figures for its mode's summary run, in MiB."""
    out = {
        "compare/model_state_MiB": state_mib(f),
        "compare/formula_model_state_MiB": f["memory/expected/model_state_MiB"],
        "compare/sent_per_step_MiB": f.get("comm/bytes_per_step/total", 0.0) / MiB,
    }
    if base is not None:
        out["compare/fraction_of_ddp"] = state_mib(f) / state_mib(base)
        out["compare/saved_vs_ddp_MiB"] = state_mib(base) - state_mib(f)
    for name in ("peak_step", "peak_cuda_allocated"):
        if f"memory/{name}_MiB/max" in f:
            out[f"compare/{name}_MiB"] = f[f"memory/{name}_MiB/max"]
    return out


def write_summary(out: Path, all_results: dict[int, dict[str, dict]], text: str) -> list[Path]:
    """One TensorBoard run per mode, `<out>/by_world_size/<mode>`, with step = world size.

    One run per mode, not one run with a tag per mode: TensorBoard colours lines by run,
    so each mode gets its own colour, the same in every chart, and its name in the legend.
    Each writes the same layout: the comparison first, then the charts of every run it
    summarises ([Note: one layout, merged over runs] in trainer/observe/tb_layout.py); its name
    sorts before `p<P>/`, so TensorBoard takes its layout first. The first mode's run
    also holds the headline as a text summary."""
    from torch.utils.tensorboard import SummaryWriter

    per_run_tags = {t for r in all_results.values() for f in r.values() for t in f}
    rows = {
        mode: {
            p: summary_scalars(r[mode], r.get("ddp")) for p, r in all_results.items() if mode in r
        }
        for mode in all_modes(all_results)
    }
    summary_tags = {t for by_p in rows.values() for v in by_p.values() for t in v}
    compare = {
        title: ["Multiline", [f"^{tag}$"]] for tag, title in COMPARE_CHARTS if tag in summary_tags
    }
    layout = {COMPARE_CATEGORY: compare, **run_layout(per_run_tags)}
    dirs = []
    for i, (mode, by_p) in enumerate(rows.items()):
        run = out / "by_world_size" / mode
        with SummaryWriter(log_dir=str(run)) as w:
            w.add_custom_scalars(layout)
            if i == 0:
                w.add_text("compare/headline", text)
            for p, values in sorted(by_p.items()):
                for tag, v in values.items():
                    w.add_scalar(tag, v, p)
        dirs.append(run)
    return dirs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", default="2,4", help="world sizes, comma-separated")
    ap.add_argument("--modes", default=",".join(MODES), help="modes, comma-separated")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "compare")
    ap.add_argument(
        "--shard-group-size",
        type=int,
        default=0,
        help="S: also run zero and fsdp with mode.shard_group_size=S (hybrid sharding)",
    )
    ap.add_argument("--chart", type=Path, help="PNG path (default <out>/memory_chart.png)")
    ap.add_argument(
        "--keep-checkpoints",
        action="store_true",
        help="keep each run's checkpoints (default: written to a temporary directory, removed)",
    )
    ap.add_argument("overrides", nargs="*", help="Hydra overrides for every run")
    args = ap.parse_args()
    worlds = [int(p) for p in args.nproc.split(",")]
    modes = args.modes.split(",")
    if any(m not in MODES for m in modes):
        ap.error(f"--modes {args.modes}: each must be one of {', '.join(MODES)}")
    out = args.out.resolve()
    all_results: dict[int, dict[str, dict]] = {}
    sections = []
    for p in worlds:
        all_results[p] = {}
        for m in runs_at(modes, p, args.shard_group_size):
            # Nobody resumes these runs: their checkpoints (train.py writes one at the
            # last step) go to a directory removed as soon as the run ends.
            with tempfile.TemporaryDirectory(prefix="compare_ckpt_") as tmp:
                ckpt = None if args.keep_checkpoints else Path(tmp)
                all_results[p][m] = run_mode(
                    m, p, out / f"p{p}" / m, args.overrides, ckpt, args.shard_group_size
                )
        sections.append(table(all_results[p], p) + "\n" + order_check(all_results[p]) + "\n")
    config = " ".join(DEFAULTS + args.overrides)
    head = f"## Model state per rank\n\nOverrides: `{config}`\n\n" + headline(all_results)
    order = "\n".join(f"{p} ranks: {order_check(r)}" for p, r in all_results.items())
    print("\n" + head + "\n" + order + "\n")
    full = "## Memory and traffic per mode, in full\n\n" + "\n".join(sections)
    out.mkdir(parents=True, exist_ok=True)
    (out / "compare_modes.md").write_text(head + "\n" + full)
    write_summary(out, all_results, head)
    png = args.chart or out / "memory_chart.png"
    if chart(all_results, png):
        print(f"chart: {png}")
    print(f"full table: {out / 'compare_modes.md'}\ntensorboard --logdir {out}")
    # Two or three points per line: TensorBoard's default smoothing and outlier clipping
    # would move them and cut off the lowest line.
    print(
        "then open http://localhost:6006/#custom_scalars&_smoothingWeight=0&_ignoreYOutliers=false"
    )


if __name__ == "__main__":
    main()
