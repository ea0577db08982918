"""Metrics: local sums reduced to rank 0 once per interval; rank 0 alone writes them."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from trainer import comm
from trainer.memory import MemoryMonitor, bandwidth

# Order of the packed tensor reduced to rank 0 (one collective per logging interval).
_FIELDS = (
    "loss_sum",
    "correct",
    "samples",
    "step_time_s",
    "steps",
    "comm_busy_s",
    "comm_exposed_s",
)


class IntervalMetrics:
    """Sums this rank's figures between two logging points."""

    def __init__(self, device: torch.device, memory: MemoryMonitor | None = None):
        self.device = device
        self.memory = memory  # per-rank memory figures, gathered at the same points
        self._sums = dict.fromkeys(_FIELDS, 0.0)

    def add(self, loss: torch.Tensor, correct: torch.Tensor, samples: int, step_time_s: float):
        # loss and correct stay tensors until the interval ends: no sync per step.
        self._sums["loss_sum"] = self._sums["loss_sum"] + loss.detach() * samples
        self._sums["correct"] = self._sums["correct"] + correct.detach()
        self._sums["samples"] += samples
        self._sums["step_time_s"] += step_time_s
        self._sums["steps"] += 1

    def reduce(self) -> dict[str, float] | None:
        """Sum every rank's figures into rank 0; return averages there, None elsewhere."""
        self._sums["comm_busy_s"] = comm.stats.busy_s
        self._sums["comm_exposed_s"] = comm.stats.exposed_s
        bytes_per_op = dict(comm.stats.bytes_sent)
        packed = torch.stack(
            [torch.as_tensor(self._sums[f], dtype=torch.float64) for f in _FIELDS]
        ).to(self.device)
        comm.stats.reset()
        comm.reduce(packed, dst=0, tag="metrics").wait()
        memory = self.memory.gather() if self.memory is not None else {}  # one Gather
        comm.stats.reset()  # the metrics reduce and gather are not training traffic
        steps_local = self._sums["steps"]
        self._sums = dict.fromkeys(_FIELDS, 0.0)
        if comm.rank() != 0:
            return None
        s = dict(zip(_FIELDS, packed.tolist(), strict=True))
        if s["samples"] == 0:  # every step of the interval was skipped
            return {}
        p = comm.world_size()
        out = {
            "train/loss": s["loss_sum"] / s["samples"],
            "train/accuracy": s["correct"] / s["samples"],
            # every rank's step took about the same wall time: use the mean over ranks
            "perf/step_time_s": s["step_time_s"] / s["steps"],
            "perf/samples_per_s": s["samples"] / (s["step_time_s"] / p),
        }
        busy, exposed = s["comm_busy_s"] / p, s["comm_exposed_s"] / p
        out["comm/time_per_step_s"] = busy / steps_local
        out["comm/exposed_per_step_s"] = exposed / steps_local
        out["comm/overlap_pct"] = 100.0 * (1 - exposed / busy) if busy > 0 else 0.0
        for op, nbytes in bytes_per_op.items():
            out[f"comm/bytes_per_step/{op}"] = nbytes / steps_local
        out["comm/bytes_per_step/total"] = sum(bytes_per_op.values()) / steps_local
        out.update(bandwidth(bytes_per_op, busy, p))  # comm/algbw_GBps, comm/busbw_GBps
        out.update(memory)
        return out


class Rank0Writer:
    """TensorBoard and a final JSON summary, written by rank 0 only."""

    def __init__(self, run_dir: Path, enabled: bool):
        self.run_dir = run_dir
        self.enabled = enabled
        self._tb = None
        if enabled:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(run_dir))

    def scalars(self, values: dict[str, float], step: int) -> None:
        if self._tb is not None:
            for tag, v in values.items():
                self._tb.add_scalar(tag, v, step)

    def text(self, tag: str, text: str) -> None:
        if self._tb is not None:
            self._tb.add_text(tag, text)

    def final(self, values: dict) -> None:
        if not self.enabled:
            return
        path = self.run_dir / "final_metrics.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(values, indent=2, sort_keys=True))
        os.replace(tmp, path)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
