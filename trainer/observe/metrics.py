"""Metrics: local sums reduced to rank 0 once per interval; rank 0 alone writes them."""

from __future__ import annotations

import json
import math
import os
import re
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from trainer import comm
from trainer.models.loss import correct_count, loss_fn, trained_count
from trainer.observe import host
from trainer.observe.memory import MemoryMonitor, bandwidth
from trainer.observe.tb_layout import run_layout

# Order of the packed tensor reduced to rank 0 (one collective per logging interval).
ACROSS_REPLICAS = "ft_across_replica_groups"  # bytes a rank sent to the other replica groups

FIELDS = (
    "loss_sum",
    "correct",
    "predictions",  # targets.numel(): samples for a classifier, tokens for a language model
    "samples",
    "wall_s",  # the interval's wall time, between two synchronised points
    "timed_steps",  # steps run in it, skipped ones included
    "steps",
    "grad_norm_sum",
    "grad_norm_steps",
    "comm_busy_s",
    "comm_exposed_s",
)


# [Note: timing steps]
# A steady step only queues work on a GPU: nothing in it waits for the device (see
# trainer/observe/host.py), so host time around one step is the time to queue it, not to run it.
# The step clock times a logging interval instead, between two points where the device
# has caught up: `start_step()` synchronises it when the interval's first step begins
# (after the previous log point's metrics, eval and checkpoint, left out of the figure)
# and `reduce()` at the log point, before the metrics go out. Two waits per interval,
# none inside a steady step. `perf/step_time_s` is that wall time over the steps run in
# the interval (skipped ones too: they took the time), the mean over ranks; samples/s,
# tokens/s and MFU are the samples and tokens of the steps taken over the same wall
# time. Eval and checkpoints that fall between log points are left out by `untimed()`,
# which synchronises on entering and leaving them (at those steps only). On CPU a
# synchronize is a no-op and the same code runs. The first interval starts at the run's
# first step (after a resume: its first step), not at set-up; it includes what the first
# step alone pays (optimizer state, the allocator warming up), which its figure shows.


class IntervalMetrics:
    """Sums this rank's figures between two logging points.

    `flops_per_token` (6Ψ: forward 2Ψ, backward 4Ψ per prediction; an MoE's Ψ counts the
    top-k experts of each token only, experts.active_params) and `peak_flops` (one
    device's peak, see `peak_flops`) add model FLOPs utilisation when both are known.
    `clock` times the interval ([Note: timing steps]).
    """

    def __init__(
        self,
        device: torch.device,
        memory: MemoryMonitor | None = None,
        flops_per_token: float | None = None,
        peak_flops: float | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ):
        self.device = device
        self.memory = memory  # per-rank memory figures, gathered at the same points
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops
        self.clock = clock
        self._sums = dict.fromkeys(FIELDS, 0.0)
        self._started: float | None = None  # the clock when the interval's first step began

    def start_step(self) -> None:
        """At the top of every training step, skipped ones too. The interval's first
        synchronises the device and starts its clock ([Note: timing steps])."""
        if self._started is None:
            host.synchronize(self.device, "step clock")
            self._started = self.clock()
        self._sums["timed_steps"] += 1

    @contextmanager
    def untimed(self) -> Iterator[None]:
        """Leave the block's wall time out of the interval (eval, a checkpoint): the
        device is synchronised on entering and on leaving it. Nothing to leave out, and no
        wait, while no interval is being timed (right after a log point)."""
        if self._started is None:
            yield
            return
        host.synchronize(self.device, "step clock")
        paused = self.clock()
        try:
            yield
        finally:
            host.synchronize(self.device, "step clock")
            self._started += self.clock() - paused

    def add(
        self,
        loss: torch.Tensor,
        correct: torch.Tensor,
        predictions: int,
        samples: int | None = None,
        grad_norm: torch.Tensor | None = None,
        stepped: bool | torch.Tensor = True,
    ):
        """One step: mean `loss` and `correct` count over `predictions` (targets.numel()),
        from `samples` (targets.shape[0]; default: predictions). `stepped` is what
        `engine.step()` returned: the gradient norm of a skipped step (inf or NaN in fp16)
        is left out, on the device when the flag is a device tensor."""
        # loss, correct and grad_norm stay tensors until the interval ends: no sync per step.
        self._sums["loss_sum"] = self._sums["loss_sum"] + loss.detach() * predictions
        self._sums["correct"] = self._sums["correct"] + correct.detach()
        self._sums["predictions"] += predictions
        self._sums["samples"] += predictions if samples is None else samples
        self._sums["steps"] += 1
        if grad_norm is None or stepped is False:
            return
        # the same on every rank; summed with a count of steps
        norm, taken = grad_norm.detach(), 1
        if isinstance(stepped, torch.Tensor):
            norm, taken = torch.where(stepped, norm, 0.0), stepped.double()
        self._sums["grad_norm_sum"] = self._sums["grad_norm_sum"] + norm
        self._sums["grad_norm_steps"] = self._sums["grad_norm_steps"] + taken

    def reduce(
        self, latest: dict[str, Any] | None = None, averaged: dict[str, Any] | None = None
    ) -> dict[str, float] | None:
        """Sum every rank's figures into rank 0; return averages there, None elsewhere.
        `latest`: values to report as they are on rank 0 (the lr, the loss scale: floats or
        device tensors), read in the same transfer; `averaged`: values every rank has
        (an MoE's aux loss and expert loads), reported as their mean over ranks."""
        if self._started is not None:  # the interval ends when the device has caught up
            host.synchronize(self.device, "step clock")
            self._sums["wall_s"] = self.clock() - self._started
        self._started = None
        comm.stats.settle()  # CUDA: read the event timings of finished collectives
        self._sums["comm_busy_s"] = comm.stats.busy_s
        self._sums["comm_exposed_s"] = comm.stats.exposed_s
        bytes_per_op = dict(comm.stats.bytes_sent)
        across = comm.stats.bytes_across  # [Note: hybrid sharding] in comm/groups.py
        latest = latest or {}
        # Rank 0's own values ride along: the other ranks add zeros to them.
        own = [v if comm.rank() == 0 else 0.0 for v in latest.values()]
        averaged = averaged or {}
        own += list(averaged.values())
        # Some sums are device tensors (loss, correct, grad norm: no sync per step), the
        # others Python floats; every element goes to the metric device before stacking,
        # since torch.stack refuses a mix of CUDA and CPU tensors.
        packed = torch.stack(
            [
                torch.as_tensor(v, dtype=torch.float64, device=self.device)
                for v in [self._sums[f] for f in FIELDS] + own
            ]
        )  # (len(FIELDS) + len(latest),)
        comm.stats.reset()
        comm.reduce(packed, dst=0, tag="metrics").wait()
        memory = self.memory.gather() if self.memory is not None else {}  # one Gather
        comm.stats.reset()  # the metrics reduce and gather are not training traffic
        steps_local = self._sums["steps"]
        self._sums = dict.fromkeys(FIELDS, 0.0)
        if comm.rank() != 0:
            return None
        values = packed.tolist()
        s = dict(zip(FIELDS, values[: len(FIELDS)], strict=True))
        rank0 = dict(zip(latest, values[len(FIELDS) : len(FIELDS) + len(latest)], strict=True))
        p = comm.world_size()
        means = values[len(FIELDS) + len(latest) :]
        rank0.update({k: v / p for k, v in zip(averaged, means, strict=True)})
        if s["samples"] == 0:  # every step of the interval was skipped
            return {}
        out = {
            "train/loss": s["loss_sum"] / s["predictions"],
            "train/accuracy": s["correct"] / s["predictions"],
        }
        # every rank ran the interval in about the same wall time: the mean over ranks
        wall_s = s["wall_s"] / p
        if wall_s > 0:  # timed with start_step() ([Note: timing steps])
            out["perf/step_time_s"] = wall_s / (s["timed_steps"] / p)
            out["perf/samples_per_s"] = s["samples"] / wall_s
            out["perf/tokens_per_s"] = s["predictions"] / wall_s
        if s["grad_norm_steps"]:
            out["train/grad_norm"] = s["grad_norm_sum"] / s["grad_norm_steps"]
        out.update(rank0)
        if self.flops_per_token and self.peak_flops and wall_s > 0:
            # achieved model FLOP/s per device over its peak
            achieved = self.flops_per_token * out["perf/tokens_per_s"] / p
            out["perf/mfu_pct"] = 100.0 * achieved / self.peak_flops
        out.update(memory)
        if p == 1:  # nothing is sent inside the group: only what crossed replica groups
            if ACROSS_REPLICAS in bytes_per_op:  # (ft: comm/replicas.py, comm/diloco.py)
                out[f"comm/bytes_per_step/{ACROSS_REPLICAS}"] = (
                    bytes_per_op[ACROSS_REPLICAS] / steps_local
                )
            return out
        busy, exposed = s["comm_busy_s"] / p, s["comm_exposed_s"] / p
        out["comm/time_per_step_s"] = busy / steps_local
        out["comm/exposed_per_step_s"] = exposed / steps_local
        out["comm/overlap_pct"] = 100.0 * (1 - exposed / busy) if busy > 0 else 0.0
        for op, nbytes in bytes_per_op.items():
            out[f"comm/bytes_per_step/{op}"] = nbytes / steps_local
        out["comm/bytes_per_step/total"] = sum(bytes_per_op.values()) / steps_local
        if across:
            out["comm/bytes_per_step/across_groups"] = across / steps_local
            inside = sum(bytes_per_op.values()) - across
            out["comm/bytes_per_step/inside_groups"] = inside / steps_local
        out.update(bandwidth(bytes_per_op, busy, p))  # comm/algbw_GBps, comm/busbw_GBps
        return out


def evaluate(
    engine: Any, batches: Iterable[tuple[torch.Tensor, ...]], device: torch.device
) -> dict[str, float] | None:
    """Loss and accuracy on held-out `batches` (this rank's share), reduced to rank 0.
    A batch is (inputs, targets, *extra), the model called as `engine(inputs, *extra)`;
    the figures are per trained target, ignored ones left out ([Note: what the loss is
    averaged over] in trainer/models/loss.py).

    Every rank calls it with the same number of batches (fsdp's forward gathers units).
    The model runs in eval mode under no_grad (BatchNorm uses its running statistics);
    the engine goes back to training mode after. One Reduce; its traffic and the eval
    forwards' stay out of the training communication figures. Rank 0 gets `eval/loss`
    and `eval/accuracy` (and `eval/perplexity` for token targets), the other ranks None.
    `batches` in named parts (`parts`: datasets.EvalParts) also gives `eval/loss/<name>`
    for each, and eval/loss and eval/accuracy are the parts' figures weighted.
    """
    # named, weighted parts: a mix of token directories ([Note: held-out figures of a mix]
    # in trainer/data/mix.py); else one part
    parts = getattr(batches, "parts", None) or [(None, 1.0, batches)]
    table = torch.zeros(len(parts), 3, dtype=torch.float64, device=device)  # (parts, 3):
    sequences = False  # each part's loss sum, correct count, target count
    engine.eval()
    try:
        with torch.no_grad(), comm.unaccounted():
            for sums, batch in _part_batches(table, parts):  # sums: the batch's part's row
                inputs, targets, *extra = (t.to(device, non_blocking=True) for t in batch)
                logits = engine(inputs, *extra)
                n = trained_count(targets)  # on the device: no host read per batch
                sums[0] += loss_fn(logits, targets).double() * n
                sums[1] += correct_count(logits, targets)
                sums[2] += n
                sequences = targets.dim() > 1  # (B, T) targets: tokens
            comm.reduce(table, dst=0, tag="eval").wait()
    finally:
        engine.train()
    if comm.rank() != 0:
        return None
    rows, weights = table.tolist(), [weight for _, weight, _ in parts]
    # each part's mean, weighted (one part: its own, exactly)
    loss = sum(w * r[0] / r[2] for w, r in zip(weights, rows, strict=True)) / sum(weights)
    correct = sum(w * r[1] / r[2] for w, r in zip(weights, rows, strict=True)) / sum(weights)
    out = {"eval/loss": loss, "eval/accuracy": correct}
    for (name, _, _), (loss_sum, _, count) in zip(parts, rows, strict=True):
        if name is not None:
            out[f"eval/loss/{name}"] = loss_sum / count
    if sequences:  # a language model's: the exponential of the mean loss per token
        out["eval/perplexity"] = math.exp(min(out["eval/loss"], 700.0))
    return out


def _part_batches(
    table: torch.Tensor, parts: list[tuple[Any, float, Iterable]]
) -> Iterator[tuple[torch.Tensor, Any]]:
    """(the part's row of `table`, a batch) for every batch of every part, in order."""
    for row, (_, _, batches) in zip(table, parts, strict=True):
        for batch in batches:
            yield row, batch


# Dense peak FLOP/s of one device by name (vendor data sheets, no sparsity), by the dtype
# of the matmuls. fp32 is the plain fp32 peak (TF32 tensor cores are off by default in
# torch). A key is a whole model name inside torch.cuda.get_device_name(): bounded by
# neither a letter nor a digit on either side, the longest key first, so "NVIDIA L40S"
# is an L40S and not an L4, and "NVIDIA H100 NVL" an H100 NVL, not an H100 SXM (see
# `device_key`).
PEAK_FLOPS: dict[str, dict[torch.dtype, float]] = {
    "H100 PCIe": {torch.bfloat16: 756e12, torch.float16: 756e12, torch.float32: 51e12},
    "H100 NVL": {torch.bfloat16: 835e12, torch.float16: 835e12, torch.float32: 60e12},
    "H100": {torch.bfloat16: 989e12, torch.float16: 989e12, torch.float32: 67e12},
    "H200": {torch.bfloat16: 989e12, torch.float16: 989e12, torch.float32: 67e12},
    "A100": {torch.bfloat16: 312e12, torch.float16: 312e12, torch.float32: 19.5e12},
    "L40S": {torch.bfloat16: 362e12, torch.float16: 362e12, torch.float32: 91.6e12},
    "L40": {torch.bfloat16: 181e12, torch.float16: 181e12, torch.float32: 90.5e12},
    "L4": {torch.bfloat16: 121e12, torch.float16: 121e12, torch.float32: 30.3e12},
    "A10G": {torch.bfloat16: 70e12, torch.float16: 70e12, torch.float32: 31.2e12},
    "V100": {torch.float16: 125e12, torch.float32: 15.7e12},
    "T4": {torch.float16: 65e12, torch.float32: 8.1e12},
}


def device_key(name: str) -> str | None:
    """The PEAK_FLOPS key that names the device `name` (as torch.cuda.get_device_name()
    gives it), or None. "NVIDIA A100-SXM4-80GB" is an A100, "NVIDIA L40S" no L4."""
    for key in sorted(PEAK_FLOPS, key=len, reverse=True):
        if re.search(rf"(?<![A-Za-z0-9]){re.escape(key)}(?![A-Za-z0-9])", name):
            return key
    return None


def peak_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    """The device's peak FLOP/s for `dtype` matmuls; None on CPU or for an unknown GPU."""
    if device.type != "cuda":
        return None
    key = device_key(torch.cuda.get_device_name(device))
    return None if key is None else PEAK_FLOPS[key].get(dtype)


class Rank0Writer:
    """TensorBoard and a final JSON summary, written by rank 0 only. With the first
    scalars comes a Custom Scalars layout (trainer/observe/tb_layout.py): loss and accuracy
    first, then memory, then communication, in every run."""

    def __init__(self, run_dir: Path, enabled: bool):
        self.run_dir = run_dir
        self.enabled = enabled
        self._tb = None
        self._layout_written = False
        if enabled:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(run_dir))

    def scalars(self, values: dict[str, float], step: int) -> None:
        if self._tb is not None:
            if not self._layout_written:  # the first figures tell which charts to show
                self._tb.add_custom_scalars(run_layout(values))
                self._layout_written = True
            for tag, v in values.items():
                self._tb.add_scalar(tag, v, step)

    def text(self, tag: str, text: str, step: int | None = None) -> None:
        if self._tb is not None:
            self._tb.add_text(tag, text, step)

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
