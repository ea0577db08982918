"""The bar chart of scripts/compare_modes.py: model state per rank, per mode and world size.

Every mark is in the legend: stacked bars are what the rank with the most holds right
after the optimizer step, by kind, with the total written on top; a black tick is the
formula; a hatched box on an fsdp bar is the formula's full units that fsdp holds only
while a step runs (not in the post-step bars), with the total it reaches.
"""

from __future__ import annotations

from pathlib import Path

COLORS = {  # colour-blind-safe (Okabe-Ito)
    "params": "#0072B2",
    "master": "#56B4E9",
    "grads": "#E69F00",
    "optimizer": "#009E73",
    "comm": "#CC79A7",
}
NAMES = {
    "params": "parameters",
    "master": "fp32 master weights",
    "grads": "gradients",
    "optimizer": "optimizer state",
    "comm": "communication buffers",
}


def chart(all_results: dict[int, dict[str, dict]], path: Path) -> bool:
    """Write the PNG; False (and a hint) when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        print("matplotlib is not installed: no chart (pip install matplotlib)")
        return False
    worlds = sorted(all_results)
    kinds = [  # only kinds some run holds: every legend entry is on the chart
        k
        for k in COLORS
        if any(f.get(f"memory/{k}_MiB/max", 0) for r in all_results.values() for f in r.values())
    ]
    top = max(
        max(f["memory/model_state_MiB/max"], f.get("memory/expected/working_set_MiB", 0))
        for r in all_results.values()
        for f in r.values()
    )
    fig, axes = plt.subplots(1, len(worlds), figsize=(3.6 * len(worlds) + 0.6, 4.4), squeeze=False)
    any_units = False
    for ax, p in zip(axes[0], worlds, strict=True):
        results = all_results[p]
        for i, f in enumerate(results.values()):
            bottom = 0.0
            for kind in kinds:
                v = f.get(f"memory/{kind}_MiB/max", 0.0)
                ax.bar(i, v, 0.6, bottom=bottom, color=COLORS[kind])
                bottom += v
            units = f.get("memory/expected/working_set_MiB", 0.0)
            if units > bottom:
                any_units = True
                ax.bar(i, units - bottom, 0.6, bottom=bottom, fill=False, hatch="///",
                       edgecolor="#777777", linewidth=0.8)  # fmt: skip
                ax.text(i, units + top * 0.01, f"{units:.1f}", ha="center", va="bottom",
                        fontsize=8, color="#555555")  # fmt: skip
                ax.text(i, bottom - top * 0.01, f"{bottom:.1f}", ha="center", va="top",
                        fontsize=8, color="white", fontweight="bold")  # fmt: skip
            else:
                ax.text(i, bottom + top * 0.01, f"{bottom:.1f}", ha="center", va="bottom",
                        fontsize=8, fontweight="bold")  # fmt: skip
            want = f["memory/expected/model_state_MiB"]
            ax.hlines(want, i - 0.36, i + 0.36, colors="black", linewidths=1.6)
        ax.set_xticks(range(len(results)), list(results))
        ax.set_ylim(0, top * 1.12)
        ax.set_title(f"{p} ranks")
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].set_ylabel("MiB per rank (the rank holding most)")
    handles = [Patch(color=COLORS[k], label=NAMES[k]) for k in kinds]
    handles.append(plt.Line2D([], [], color="black", linewidth=1.6, label="formula"))
    if any_units:
        handles.append(
            Patch(
                fill=False,
                hatch="///",
                edgecolor="#777777",
                label="fsdp: + full units held only while a step runs (formula)",
            )  # fmt: skip
        )
    fig.legend(handles=handles, loc="lower center", ncol=3, fontsize=8, frameon=False)
    fig.suptitle("Model state per rank after the optimizer step, MiB (numbers: totals)")
    fig.tight_layout(rect=(0, 0.13, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
