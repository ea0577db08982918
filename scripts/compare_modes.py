"""Run ddp, zero and fsdp on the same config and world size; compare memory and traffic.

    python scripts/compare_modes.py                      # 2 and 4 ranks, MLP 1024x4
    python scripts/compare_modes.py --nproc 4 --out runs/cmp model.hidden=2048 optim=sgd
    tensorboard --logdir runs/compare                    # CUSTOM SCALARS tab

Each mode runs as `torchrun --standalone --nproc-per-node=P train.py mode=M ...` into
`<out>/p<P>/<mode>`, one after the other, with the same overrides. Afterwards this
script reads each run's `final_metrics.json` (rank 0 writes the last logged figures
there) and leaves:

  <out>/compare_modes.md     measured vs expected memory and traffic per mode (printed too)
  <out>/memory_chart.png     model-state bytes per rank per mode, measured and expected
                             (needs matplotlib; `--chart PATH` to put it elsewhere)
  <out>/events.out.tfevents  a custom scalars layout: one chart per memory and traffic
                             metric with every run (mode, P) overlaid
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = ("ddp", "zero", "fsdp")
KINDS = ("params", "master", "grads", "optimizer", "comm", "model_state")
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


def run_mode(mode: str, nproc: int, run_dir: Path, overrides: list[str]) -> dict:
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
        *overrides,
    ]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"error: mode={mode} on {nproc} ranks failed:\n{proc.stderr[-3000:]}")
    print(f"  {mode:5s} p={nproc}: {time.perf_counter() - t0:5.1f} s -> {run_dir}", flush=True)
    return json.loads((run_dir / "final_metrics.json").read_text())


# ---------------------------------------------------------------------------------------
# The table


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def _pair(final: dict, kind: str) -> str:
    measured = final[f"memory/{kind}_bytes/max"]
    want = final.get(f"memory/expected/{kind}_bytes")
    return _mib(measured) if want is None else f"{_mib(measured)} / {_mib(want)}"


def table(results: dict[str, dict], nproc: int) -> str:
    """One markdown table for one world size; figures per rank (max over ranks)."""
    base = results.get("ddp")
    lines = [
        f"### {nproc} ranks",
        "",
        "Memory in MiB per rank, `measured / expected` (max over ranks; measured right "
        "after the optimizer step); gap = measured model state over formula. Peak: RSS "
        "high-water mark on CPU (whole process), CUDA max allocated on GPU. Traffic in MiB "
        "sent per rank per step, counted by the comm module vs the ring formula.",
        "",
        "| mode | params | fp32 masters | grads | optimizer | comm buffers | model state | "
        "gap | model state vs ddp (measured / formula) | fsdp units in flight (expected) | "
        "peak | sent per step / ring | algbw GB/s | busbw GB/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mode, f in results.items():
        ratio = "n/a"
        if base is not None:
            measured = f["memory/model_state_bytes/max"] / base["memory/model_state_bytes/max"]
            formula = (
                f["memory/expected/model_state_bytes"] / base["memory/expected/model_state_bytes"]
            )
            ratio = f"{measured:.3f} / {formula:.3f}"
        units = f["memory/expected/working_set_bytes"] - f["memory/expected/model_state_bytes"]
        sent = f.get("comm/bytes_per_step/total", 0.0)
        lines.append(
            "| "
            + " | ".join(
                [
                    f"`{mode}`",
                    *(_pair(f, k) for k in ("params", "master", "grads", "optimizer")),
                    _mib(f["memory/comm_bytes/max"]),
                    _pair(f, "model_state"),
                    f"{f['memory/model_state_gap_pct']:+.3f}%",
                    ratio,
                    _mib(units) if units else "-",
                    _mib(f["memory/peak_bytes/max"]),
                    f"{_mib(sent)} / {_mib(f['comm/expected_bytes_per_step'])}",
                    f"{f.get('comm/algbw_GBps', 0):.3f}",
                    f"{f.get('comm/busbw_GBps', 0):.3f}",
                ]
            )
            + " |"
        )
    return "\n".join(lines) + "\n"


def order_check(results: dict[str, dict]) -> str:
    """States whether per-rank model state is ordered fsdp < zero < ddp."""
    present = [m for m in ("fsdp", "zero", "ddp") if m in results]
    sizes = [results[m]["memory/model_state_bytes/max"] for m in present]
    ok = all(a < b for a, b in zip(sizes, sizes[1:], strict=False))
    order = " < ".join(present)
    return f"model state per rank {order}: {'yes' if ok else 'NO'}"


# ---------------------------------------------------------------------------------------
# TensorBoard layout and the chart


def write_layout(out: Path) -> None:
    """Custom scalars: one Multiline chart per metric; every run under `out` that logs
    the tag appears on it, so all modes and world sizes share one chart."""
    from torch.utils.tensorboard import SummaryWriter

    memory = {
        f"{k} bytes per rank (max over ranks) vs expected": [
            "Multiline",
            [rf"^memory/{k}_bytes/max$", rf"^memory/expected/{k}_bytes$"],
        ]
        for k in KINDS
    }
    memory["peak bytes per rank (max over ranks)"] = ["Multiline", [r"^memory/peak_bytes/max$"]]
    memory["model state: each rank"] = ["Multiline", [r"^memory/model_state_bytes/rank\d+$"]]
    memory["model state gap to formula, %"] = ["Multiline", [r"^memory/model_state_gap_pct$"]]
    traffic = {
        "bytes sent per rank per step vs ring expectation": [
            "Multiline",
            [r"^comm/bytes_per_step/total$", r"^comm/expected_bytes_per_step$"],
        ],
        "bytes per step by collective": ["Multiline", [r"^comm/bytes_per_step/(?!total)"]],
        "algbw and busbw, GB/s": ["Multiline", [r"^comm/algbw_GBps$", r"^comm/busbw_GBps$"]],
        "communication time per step, s": ["Multiline", [r"^comm/time_per_step_s$"]],
    }
    with SummaryWriter(log_dir=str(out)) as w:
        w.add_custom_scalars({"memory": memory, "traffic": traffic})


def chart(all_results: dict[int, dict[str, dict]], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no chart (pip install matplotlib)")
        return False
    worlds = sorted(all_results)
    fig, axes = plt.subplots(1, len(worlds), figsize=(4 * len(worlds) + 1, 4.6), squeeze=False)
    colors = {
        "params": "#4C72B0",
        "master": "#64B5CD",
        "grads": "#DD8452",
        "optimizer": "#55A868",
        "comm": "#8172B3",
    }
    for ax, p in zip(axes[0], worlds, strict=True):
        results = all_results[p]
        modes = list(results)
        top = 0.0
        for i, mode in enumerate(modes):
            f = results[mode]
            bottom = 0.0
            for kind, color in colors.items():
                v = f[f"memory/{kind}_bytes/max"] / 2**20
                ax.bar(i, v, 0.6, bottom=bottom, color=color, label=kind)
                bottom += v
            want = f["memory/expected/model_state_bytes"] / 2**20
            units = f["memory/expected/working_set_bytes"] / 2**20
            ax.hlines(want, i - 0.38, i + 0.38, colors="black", linewidths=2,
                      label="expected model state")  # fmt: skip
            if units > want:
                ax.hlines(units, i - 0.38, i + 0.38, colors="black", linestyles="dashed",
                          label="+ fsdp units in flight (expected)")  # fmt: skip
            top = max(top, bottom, units)
        ax.set_xticks(range(len(modes)), modes)
        ax.set_ylim(0, top * 1.08)
        ax.set_title(f"{p} ranks")
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].set_ylabel("MiB per rank (max over ranks)")
    handles, labels = [], []
    for ax in axes[0]:  # one legend entry per label, across the panels
        for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=8, frameon=False)
    fig.suptitle("Model-state memory per rank: measured (bars), formula (lines)")
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", default="2,4", help="world sizes, comma-separated")
    ap.add_argument("--modes", default=",".join(MODES), help="modes, comma-separated")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "compare")
    ap.add_argument("--chart", type=Path, help="PNG path (default <out>/memory_chart.png)")
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
        print(f"{p} ranks:", flush=True)
        all_results[p] = {m: run_mode(m, p, out / f"p{p}" / m, args.overrides) for m in modes}
        sections.append(table(all_results[p], p) + "\n" + order_check(all_results[p]) + "\n")
    config = " ".join(DEFAULTS + args.overrides)
    text = f"## Memory and traffic per mode\n\nOverrides: `{config}`\n\n" + "\n".join(sections)
    print("\n" + text)
    out.mkdir(parents=True, exist_ok=True)
    (out / "compare_modes.md").write_text(text)
    write_layout(out)
    png = args.chart or out / "memory_chart.png"
    if chart(all_results, png):
        print(f"chart: {png}")
    print(f"table: {out / 'compare_modes.md'}\ntensorboard --logdir {out}")


if __name__ == "__main__":
    main()
