"""`profile=true`: record a few steps with torch.profiler, one Chrome trace per rank.

Open `<run dir>/traces/rank0.json` in chrome://tracing or https://ui.perfetto.dev: on GPU
the collectives sit on their own stream beside the compute kernels; on CPU the Gloo
work shows on its own threads.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, schedule


class _NoProfiler:
    def step(self) -> None:
        pass


@contextlib.contextmanager
def maybe_profile(enabled: bool, run_dir: Path, rank: int, active: int = 3) -> Iterator:
    """Yields an object whose `step()` the loop calls once per training step."""
    if not enabled:
        yield _NoProfiler()
        return
    out = run_dir / "traces"
    out.mkdir(parents=True, exist_ok=True)
    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)

    def write(prof: profile) -> None:
        prof.export_chrome_trace(str(out / f"rank{rank}.json"))

    # Skip the first steps: they include one-time allocation and connection set-up.
    with profile(
        activities=activities,
        schedule=schedule(wait=1, warmup=1, active=active, repeat=1),
        on_trace_ready=write,
        record_shapes=False,
    ) as prof:
        yield prof
