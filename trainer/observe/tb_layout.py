"""The Custom Scalars layout every run writes: training first, then memory, then traffic.

[Note: one layout, merged over runs]
TensorBoard merges the layouts of all runs in the order of their names: the first run's
layout sets the order of categories, and a later run adds the charts that run alone has
(identical charts are kept once). A category the first layout lacks is copied from
the first later run that has it, and TensorBoard 2.x's merge then drops the charts that
further runs add to it; so category titles are fixed, a chart's title and tags depend
only on the tags it shows, and a script that writes a summary run sorted first (see
scripts/compare_modes.py) gives it the charts of all the runs it summarises. A chart is
written only when one of its tags is logged, a category only when it has a chart.

Custom Scalars colours lines by run, not by tag, so two tags of one run in one chart
draw in the same colour. Measured figures and their formula therefore get charts of
their own, side by side, instead of sharing one.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

Chart = tuple[str, list[str]]  # title, tag regexes (one line per run and matching tag)

TRAINING, MEMORY, COMM = "training", "memory per rank, MiB", "communication"

_KIND_NAMES = {
    "params": "parameters",
    "master": "fp32 master weights",
    "grads": "gradients",
    "optimizer": "optimizer state",
    "comm": "communication buffers",
}
PEAK_TITLES = {
    "peak_step": "peak: tensors live at one step's high point (CPU)",
    "peak_cuda_allocated": "peak: CUDA allocator max allocated (GPU)",
}


def _charts() -> dict[str, list[Chart]]:
    memory: list[Chart] = [
        ("model state per rank, MiB (measured, max over ranks)", [r"^memory/model_state_MiB/max$"]),
        ("model state per rank, MiB (formula)", [r"^memory/expected/model_state_MiB$"]),
        *(
            (f"{title}, MiB per rank (max over ranks)", [rf"^memory/{name}_MiB/max$"])
            for name, title in PEAK_TITLES.items()
        ),
        (
            "fsdp working set, MiB (formula: model state + full units while a step runs)",
            [r"^memory/expected/working_set_MiB$"],
        ),
        *(
            (f"{title} per rank, MiB (max over ranks)", [rf"^memory/{kind}_MiB/max$"])
            for kind, title in _KIND_NAMES.items()
        ),
        ("model state of each rank, MiB", [r"^per_rank/model_state_MiB/rank\d+$"]),
        # mode.offload=disk (docs/offload.md): the file beside the memory, and its waits
        ("offload file on disk per rank, MiB (max over ranks)", [r"^memory/disk_MiB/max$"]),
        ("offload file per rank, MiB (formula)", [r"^memory/expected/disk_MiB$"]),
        # mode.offload=host: the state in host memory, measured beside its formula
        (
            "offloaded state in host memory per rank, MiB (measured, formula)",
            [r"^memory/host_MiB/max$", r"^memory/expected/host_MiB$"],
        ),
        (
            "offload: the step waited for the file or its gradients' copies, ms",
            [r"^offload/wait_ms_per_step/max$"],
        ),
    ]
    return {
        TRAINING: [
            ("loss (train, eval)", [r"^train/loss$", r"^eval/loss$"]),
            ("accuracy (train, eval)", [r"^train/accuracy$", r"^eval/accuracy$"]),
            ("samples per second", [r"^perf/samples_per_s$"]),
            ("learning rate", [r"^train/lr$"]),
            ("gradient norm", [r"^train/grad_norm$"]),
            ("fp16 loss scale", [r"^train/loss_scale$"]),
            ("model FLOPs utilisation, %", [r"^perf/mfu_pct$"]),
            # data.mix (trainer/data/mix.py)
            ("tokens trained on, by mixed source", [r"^data/tokens/.+$"]),
            ("held-out loss, by mixed source", [r"^eval/loss/.+$"]),
        ],
        MEMORY: memory,
        COMM: [
            ("bytes sent per rank per step (measured)", [r"^comm/bytes_per_step/total$"]),
            ("bytes sent per rank per step (ring formula)", [r"^comm/expected_bytes_per_step$"]),
            (
                "bytes sent per step, by collective",
                [
                    r"^comm/bytes_per_step/(all_reduce|reduce_scatter|all_gather|all_to_all|broadcast)$"
                ],
            ),
            ("time in communication per step, s", [r"^comm/time_per_step_s$"]),
            ("communication the step waited for, s", [r"^comm/exposed_per_step_s$"]),
            ("bus bandwidth, GB/s", [r"^comm/busbw_GBps$"]),
        ],
    }


# Charts of figures the first logged ones cannot have yet, shown with those they come with:
# each source's held-out loss, logged at the first evaluation, with the mix's token counts
_SHOWN_WITH = {"held-out loss, by mixed source": [r"^data/tokens/.+$"]}


def run_layout(tags: Iterable[str]) -> dict[str, dict[str, list]]:
    """The layout for a run logging `tags`, in SummaryWriter.add_custom_scalars' form:
    {category: {chart title: ["Multiline", [tag regexes]]}}, only the charts some logged
    tag matches ([Note: one layout, merged over runs])."""
    tags = list(tags)
    layout: dict[str, dict[str, list]] = {}
    for category, charts in _charts().items():
        shown = {
            title: ["Multiline", regexes]
            for title, regexes in charts
            if any(re.search(rx, t) for rx in [*regexes, *_SHOWN_WITH.get(title, [])] for t in tags)
        }
        if shown:
            layout[category] = shown
    return layout
