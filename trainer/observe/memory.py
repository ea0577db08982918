"""Memory and traffic accounting: what each rank actually holds, next to what the
formulas of the mode predict.

    psi = count_params(model)                # before build_engine (see MemoryMonitor)
    engine = build_engine(model, ...)
    monitor = MemoryMonitor(engine, psi)     # measures after every optimizer step
    figures = monitor.gather()        # every rank calls it: one Gather to rank 0

How it measures: [Note: what is measured, and when], beside `measure`; what it expects:
[Note: the expected figures], beside `expected`.
"""

from __future__ import annotations

import math
import resource
import sys
from typing import Any

import torch

from trainer import comm
from trainer.observe import heap

KINDS = ("params", "master", "grads", "optimizer", "comm")
# Order of the packed tensor gathered to rank 0 (one Gather per logging interval). "disk":
# the blocks of the offload file (mode.offload=disk), "host": the host memory a GPU run's
# offloaded state takes (mode.offload=host), "offload_wait_us": microseconds per step the
# optimizer step waited for the file or for its gradients' copies ([Note: offloaded
# state], [Note: host offload]).
FIELDS = (*KINDS, "model_state", "peak", "disk", "host", "offload_wait_us")


# ---------------------------------------------------------------------------------------
# Measured


# [Note: what is measured, and when]
# `measure()` adds up the live storages behind `engine.state_tensors()`, by kind (params,
# master, grads, optimizer, comm). A storage is counted once, by its `nbytes`, in the first
# kind that reaches it (in that order): ddp's per-parameter `.grad`
# views into one bucket count as that bucket; a freed fsdp buffer (storage resized to 0)
# counts as nothing. The monitor measures from an optimizer step post-hook, the moment
# when parameters, gradients and optimizer state all exist (fsdp drops its gradient
# shards right after the step), and keeps the per-kind maximum over the logging interval.
# Transient buffers that live only inside forward/backward (fsdp's gathered units) are
# not in that snapshot; the peak is: the high point of one training step per logging
# interval, the first after each log point, from its first forward to the end of its
# optimizer step. On CPU (`peak_step`) the storages alive at its start plus the C heap's
# growth during it ([Note: the CPU step peak] in trainer/observe/heap.py); on GPU
# (`peak_cuda_allocated`) the CUDA allocator's peak, reset when that step starts
# (`torch.cuda.reset_peak_memory_stats`) and read when it ends (`CudaStepPeak`): without
# the reset it would be the peak since the process started (the broadcast at engine
# construction, the whole model before fsdp shards it), and never fall. Both are host-side
# allocator figures, read without a device sync. Not the process's resident set, which is
# about 1 GB of torch libraries in every mode. (`peak_bytes()` below reads that, and the
# CUDA peak since the start.)


def measure(engine: Any) -> dict[str, int]:
    """Bytes this rank holds per kind, from live storages, plus model_state and peak."""
    held, device = _held(engine)
    return {**held, "peak": peak_bytes(device), **offloaded_bytes(engine)}


def offloaded_bytes(engine: Any) -> dict[str, int]:
    """Bytes this rank's offloaded state takes outside the device: "disk" (the offload
    file's allocated blocks), "host" (a GPU run's state in host memory); 0 without."""
    offload = getattr(engine, "offload", None)
    if offload is None:
        return {"disk": 0, "host": 0}
    return {"disk": offload.disk_bytes(), "host": offload.host_bytes()}


def _held(engine: Any) -> tuple[dict[str, int], torch.device]:
    tensors = engine.state_tensors()
    seen: set[tuple[str, int]] = set()
    out: dict[str, int] = {}
    device = getattr(engine, "device", None)
    on_device = device is not None and device.type != "cpu"
    device = device or torch.device("cpu")
    for kind in KINDS:
        total = 0
        for t in tensors.get(kind, []):
            storage = t.untyped_storage()
            key = (str(t.device), storage.data_ptr())
            if storage.nbytes() == 0 or key in seen:  # freed, or counted in an earlier kind
                continue
            if on_device and t.device.type == "cpu":  # host offload's: under "host"
                continue
            seen.add(key)
            total += storage.nbytes()
        out[kind] = total
    out["model_state"] = out["params"] + out["master"] + out["grads"] + out["optimizer"]
    return out, device


def peak_bytes(device: torch.device) -> int:
    """Peak memory of this process: the CUDA allocator's peak on GPU (since the process
    started, or since the last reset: a training run resets it at each sampled step, see
    `CudaStepPeak`), the RSS high-water mark on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # "VmHWM:  123456 kB"
    except OSError:
        pass
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # bytes on macOS, kB else


def count_params(model: torch.nn.Module) -> int:
    """Ψ: elements in the model's parameters, each shared (tied) parameter once."""
    return sum(p.numel() for p in model.parameters())


def optimizer_bytes_per_param(optimizer: torch.optim.Optimizer) -> float | None:
    """Bytes of optimizer state per parameter element, read from the state it keeps
    (None before the first step). Only tensors shaped like their parameter count: the
    0-d `step` counters are a few bytes per tensor, not per element."""
    state_bytes, numel = 0, 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p)
            if not state:
                continue
            numel += p.numel()
            state_bytes += sum(
                v.numel() * v.element_size()
                for v in state.values()
                if torch.is_tensor(v) and v.numel() == p.numel() and v.dim() > 0
            )
    return state_bytes / numel if numel else None


# ---------------------------------------------------------------------------------------
# Expected


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _engine_class(mode: str) -> Any:
    from trainer.parallel import ENGINES  # the engines say how they lay out state

    return ENGINES[mode]


def bytes_per_element(
    mode: str, param_bytes: int, grad_bytes: int, optimizer_state_per_param_bytes: float
) -> dict[str, float]:
    """Bytes per parameter element of each model-state kind, before the sharded kinds
    (the engine's `sharded_kinds`) are divided over the ranks: the rule `expected` and
    the planning estimate (trainer/estimate/) both apply."""
    shape = _engine_class(mode)
    mixed = param_bytes != 4
    params, master = param_bytes, 4 if mixed else 0
    if shape.masters_are_params:
        params, master = 4, 0
    grads = 4 if "grads" in shape.sharded_kinds else grad_bytes + (4 if grad_bytes != 4 else 0)
    return {
        "params": params,
        "master": master,
        "grads": grads,
        "optimizer": optimizer_state_per_param_bytes,
    }


# [Note: the expected figures]
# Per rank, for Ψ parameters computing in b bytes (4 fp32, 2 bf16/fp16), gradients reduced
# in r bytes, and an optimizer keeping k bytes per parameter (read from its state after
# the first step: AdamW fp32 k=8, SGD with momentum k=4). With b = r = 4 (fp32):
#
#     ddp   params Ψb     grads Ψb     optimizer Ψk       (fp32 AdamW: 16Ψ)
#     zero  params Ψb     grads Ψb/P   optimizer Ψk/P     (4Ψ + 12Ψ/P)
#     fsdp  params Ψb/P   grads Ψb/P   optimizer Ψk/P     (16Ψ/P), plus while a step runs
#           the full params and grads of the root unit and of two units in flight
#
# Mixed precision (b = 2) adds fp32 masters, 4Ψ in ddp and 4Ψ/P in zero; fsdp's sharded
# params are its fp32 masters (4Ψ/P) and its b-byte full params exist only while a unit
# runs. Gradients after the step are fp32 next to the masters: 4Ψ/P in zero and fsdp; ddp
# keeps its r-byte buckets, plus fp32 copies for the masters when r is not 4.
# (bf16 AdamW, r = 4: ddp 2Ψ + 4Ψ + 4Ψ + 8Ψ, zero 2Ψ + 16Ψ/P, fsdp 16Ψ/P.)
#
# Traffic per rank per step, ring algorithms: ddp 2(P-1)/P·Ψr (AllReduce), zero
# (P-1)/P·Ψr + (P-1)/P·Ψb (ReduceScatter, AllGather), fsdp (P-1)/P·(Ψr + 2Ψb) (AllGather
# twice, ReduceScatter); int8 on the wire counts 1 + 4/block bytes per element (its
# scales), the blocks' padding and the exact used-flags left out. The formulas use Ψ
# unpadded; zero and fsdp pad flat buffers to a multiple of P, so their measured figures
# can be a few elements above.
#
# Expert parallelism ([Note: expert parameters in every mode] in parallel/experts.py):
# the Ψe expert parameters are handled as a model of Ψe/E parameters over the P/E ranks of
# an EDP group (ddp Ψe/E·(b + r + k); zero Ψe/E·b + Ψe/P·(r + k); fsdp Ψe/P·(b + r + k)),
# the rest as above over P ranks; the AllToAlls of token dispatch depend on the routing
# and are not in the expected traffic.
#
# Hybrid sharding ([Note: hybrid sharding] in comm/groups.py): the sharded kinds are split
# over the S ranks of a shard group instead of P (fsdp with fp32 AdamW: 16Ψ/S), the
# mode's collectives run inside the group (P -> S above), and each rank sends its slice
# of the gradients across the R = P/S replicas: 2(R-1)/R · Ψr/S, logged apart as
# `comm/bytes_per_step/across_groups`.


def expected(
    mode: str,
    numel: int,
    world_size: int,
    param_bytes: int,
    grad_bytes: int,
    optimizer_state_per_param_bytes: float,
    unit_bytes: int = 0,
    shard_group_size: int | None = None,
) -> dict[str, float]:
    """Model-state bytes per rank the formulas predict (see [Note: the expected figures]).

    `param_bytes` is the compute dtype's size, `grad_bytes` the reduce dtype's. Below 4
    bytes, parameters have fp32 masters. `working_set` adds `unit_bytes`, the full units
    fsdp holds while a step runs. Sharded kinds are split over `shard_group_size` ranks
    (hybrid sharding), all `world_size` by default."""
    per = bytes_per_element(mode, param_bytes, grad_bytes, optimizer_state_per_param_bytes)
    sharded = _engine_class(mode).sharded_kinds
    split = shard_group_size or world_size
    out = {k: numel * v / (split if k in sharded else 1) for k, v in per.items()}
    out["model_state"] = out["params"] + out["master"] + out["grads"] + out["optimizer"]
    out["working_set"] = out["model_state"] + unit_bytes
    return out


def expected_traffic(
    mode: str,
    numel: int,
    bytes_per_elem: int,
    world_size: int,
    grad_bytes: int | None = None,
    shard_group_size: int | None = None,
) -> float:
    """Bytes each rank sends per step under the ring model: parameters AllGathered in
    `bytes_per_elem`, gradients reduced in `grad_bytes` (the same when not given). With
    hybrid sharding the collectives of the mode run inside shard groups of
    `shard_group_size`, plus `expected_traffic_across`."""
    shape = _engine_class(mode)
    p = shard_group_size or world_size
    r = bytes_per_elem if grad_bytes is None else grad_bytes
    inside = (shape.grads_sent * r + shape.params_sent * bytes_per_elem) * (p - 1) / p * numel
    return inside + expected_traffic_across(mode, numel, r, world_size, shard_group_size)


def expected_traffic_across(
    mode: str, numel: int, grad_bytes: int, world_size: int, shard_group_size: int | None
) -> float:
    """Bytes each rank sends per step between shard groups (hybrid sharding): its 1/S
    slice of the gradients AllReduced over the R = P/S replicas, 2(R-1)/R · Ψr/S."""
    if not shard_group_size or shard_group_size == world_size:
        return 0.0
    r = world_size // shard_group_size
    return 2 * (r - 1) / r * numel * grad_bytes / shard_group_size


# nccl-tests bus bandwidth factors: busbw = algbw x factor.
def bus_factor(op: str, world_size: int) -> float:
    p = world_size
    if op == "all_reduce":
        return 2 * (p - 1) / p
    if op in ("reduce_scatter", "all_gather", "all_to_all"):
        return (p - 1) / p
    return 1.0


def bandwidth(bytes_per_op: dict[str, float], seconds: float, world_size: int) -> dict[str, float]:
    """algbw and busbw in GB/s, as nccl-tests defines them.

    `bytes_per_op` are the bytes each rank sent (comm.stats, ring model), which is what
    busbw measures: busbw = sent / time. algbw = data size / time, where each op's data
    size is its bytes sent divided by its bus factor."""
    sent = {op: b for op, b in bytes_per_op.items() if b > 0}
    if seconds <= 0 or not sent:
        return {}
    alg = sum(b / bus_factor(op, world_size) for op, b in sent.items())
    return {
        "comm/algbw_GBps": alg / seconds / 1e9,
        "comm/busbw_GBps": sum(sent.values()) / seconds / 1e9,
    }


# ---------------------------------------------------------------------------------------
# Per rank, every logging interval


def gather_to_rank0(values: dict[str, int], device: torch.device) -> list[dict[str, int]] | None:
    """Every rank's `values` (keys FIELDS) to rank 0 with one Gather; None elsewhere."""
    packed = torch.tensor([int(values[f]) for f in FIELDS], dtype=torch.int64, device=device)
    is_root = comm.rank() == 0
    rows = [torch.empty_like(packed) for _ in range(comm.world_size())] if is_root else None
    comm.gather(packed, rows, dst=0, tag="memory").wait()
    if not is_root:
        return None
    return [dict(zip(FIELDS, r.tolist(), strict=True)) for r in rows]


class CudaStepPeak(heap.StepPeak):
    """The CUDA allocator's peak over the window of `heap.StepPeak` (one training step
    per arming): its peak statistic is reset when the step starts, so what is read when
    it ends is that step's high point, model state alive at its start included (the
    reset sets the peak to the bytes allocated then). Allocator bookkeeping only: no
    device sync."""

    def __init__(self, module, optimizer, device: torch.device):
        super().__init__(module, optimizer)
        self.device = device

    def _begin(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def _now(self) -> int:
        return int(torch.cuda.max_memory_allocated(self.device))

    def _end(self) -> None:
        pass


class MemoryMonitor:
    """Measures this rank after each optimizer step; `gather()` brings every rank's figures
    and the expected ones to rank 0 as TensorBoard scalars.

    `numel` is Ψ, counted with `count_params(model)` before the model is wrapped: fsdp
    points the module's parameters at empty tensors while they are sharded.

    [Note: what a step costs the monitor]
    The held bytes are read at the first step after each gather and again at the gather
    (a walk over every state tensor: 0.5 ms of the 40 ms CPU GPT step; every step's walk
    would cost 1%). The step peak is sampled at the first step, then at the first step
    of the first interval at least `peak_every` steps after the last sample: on CPU the
    sampled step runs every op under a watcher, 16 ms more on that GPT. An interval
    without a sample has no peak figure (TensorBoard shows the samples)."""

    def __init__(self, engine: Any, numel: int, peak_every: int = 1):
        self.engine = engine
        self.peak_every = peak_every
        self._steps = 0  # optimizer steps so far
        self._sampled_at = 0  # the step count when the step peak was last armed
        self._fresh = True  # no held-bytes reading yet in this interval
        params = list(engine.module.parameters())
        self.numel = numel
        self.param_bytes = params[0].element_size() if params else 4
        precision = getattr(engine, "precision", None)
        self.grad_bytes = _itemsize(precision.reduce_dtype) if precision else self.param_bytes
        # what an element costs on the wire: int8 blocks and their scales where quantized
        self.wire = (
            (precision.wire_bytes("params"), precision.wire_bytes("grads"))
            if precision
            else (self.param_bytes, self.grad_bytes)
        )
        self.device = params[0].device if params else torch.device("cpu")
        self._high: dict[str, int] | None = None  # per-kind maximum since the last gather
        self._waited_s, self._offload_steps = 0.0, 0  # the interval's offload waits
        optimizer = getattr(engine, "optimizer", None)
        self._step_peak: heap.StepPeak | None = None
        if optimizer is not None:
            optimizer.register_step_post_hook(self._after_step)
            if self.device.type == "cuda":
                self._step_peak = CudaStepPeak(engine.module, optimizer, self.device)
            elif self.device.type == "cpu" and heap.available():
                self._step_peak = heap.StepPeak(engine.module, optimizer, self._held_bytes)

    @property
    def step_peak(self) -> heap.StepPeak | CudaStepPeak | None:
        """What measures a step's peak here: CudaStepPeak on CUDA, heap.StepPeak on CPU
        (where the heap can be watched), None otherwise."""
        return self._step_peak

    def _after_step(self, *_: object) -> None:
        self._steps += 1
        offload = getattr(self.engine, "offload", None)
        if offload is not None:  # run once per step, after its last buffer
            self._waited_s += offload.last_step["wait_s"]
            self._offload_steps += 1
        if self._fresh:
            self._fresh = False
            self.update()

    def update(self) -> None:
        now, _ = _held(self.engine)  # the peak is read once, at gather time
        self._high = (
            now if self._high is None else {k: max(v, self._high[k]) for k, v in now.items()}
        )

    def _held_bytes(self) -> int:
        return sum(_held(self.engine)[0][k] for k in KINDS)

    def expected(self) -> dict[str, float] | None:
        """This engine's formula figures; None before the first step."""
        k = optimizer_bytes_per_param(self.engine.optimizer)
        if k is None:
            return None
        units = self.engine.working_set_bytes()
        p, s = self.engine.world_size, self.engine.mesh.shard_size
        dense, experts, e = self._split()
        out = expected(self.engine.name, dense, p, self.param_bytes, self.grad_bytes, k, units, s)
        if experts:  # [Note: the expected figures]: the experts as Ψe/E over P/E ranks
            mine = expected(self.engine.name, experts // e, p // e, self.param_bytes,
                            self.grad_bytes, k)  # fmt: skip
            out = {key: v + (mine[key] if key != "working_set" else mine["model_state"])
                   for key, v in out.items()}  # fmt: skip
        mp = getattr(self.engine, "precision", None)
        if self.engine.name == "zero" and mp is not None and mp.gather_int8 and not mp.mixed:
            apart = 4 * self.numel / s  # its fp32 master apart from `full` (docs/quantized.md)
            for key in ("master", "model_state", "working_set"):
                out[key] += apart
        offload = getattr(self.engine, "offload", None)
        if offload is not None:  # in the file, or on the host (docs/offload.md)
            on_host = offload.kind == "host"
            moved = out["optimizer"] + (out["master"] if offload.move_masters or on_host else 0)
            if on_host:  # [Note: host offload]: per rank, the fp32 master and its pinned
                # gradient beside the state; fsdp's gathered shard stays, in the compute dtype
                shard = self.numel / s
                out["host"] = out["optimizer"] + 2 * 4 * shard
                if self.engine.name == "fsdp":
                    moved += (4 - self.param_bytes) * shard
                    out["params"] -= (4 - self.param_bytes) * shard
            out["optimizer"] = 0.0
            if offload.move_masters or on_host:
                out["master"] = 0.0
            out["model_state"] -= moved
            out["working_set"] -= moved
            out["disk"] = 0.0 if on_host else float(offload.nbytes)
        return out

    def _split(self) -> tuple[int, int, int]:
        """(dense Ψ, expert Ψ over all experts, E): expert parallelism's split of the
        parameters; (Ψ, 0, 1) without it."""
        ep = self.engine.experts
        if ep is None:
            return self.numel, 0, 1
        experts = sum(math.prod(shape) for shape in ep.full_shapes.values())
        return self.numel - experts, experts, ep.groups.ep_size

    def expected_traffic(self) -> float | None:
        p, s = self.engine.world_size, self.engine.mesh.shard_size
        dense, experts, e = self._split()
        (mode, (b, r)) = self.engine.name, self.wire
        traffic = expected_traffic(mode, dense, b, p, r, s)
        if traffic is not None:
            traffic += self.engine.traffic_beyond_formula()
        if traffic is None or not experts:
            return traffic
        # the experts' reductions over the P/E ranks of the EDP group; AllToAlls apart
        return traffic + expected_traffic(mode, experts // e, b, p // e, r, None)

    def expected_traffic_across(self) -> float:
        p, s = self.engine.world_size, self.engine.mesh.shard_size
        return expected_traffic_across(self.engine.name, self.numel, self.wire[1], p, s)

    def peak(self) -> int | None:
        """This rank's peak bytes in the step sampled since the last call: the CUDA
        allocator's peak on GPU, the CPU step peak on CPU ([Note: what is measured, and
        when]); None if unknown or no step was sampled."""
        if self._step_peak is None:
            return None
        due = self._steps - self._sampled_at >= self.peak_every
        if due:
            self._sampled_at = self._steps
        return self._step_peak.take(arm=due)

    def end_interval(self) -> dict[str, int]:
        """This rank's figures for the interval now ending (bytes; peak -1: no sample)."""
        self.update()  # the interval's end, beside its first step's reading
        self._fresh = True
        local, self._high = self._high, None
        peak = self.peak()
        local["peak"] = -1 if peak is None else peak  # -1: not measured (packed as int64)
        local.update(offloaded_bytes(self.engine))
        steps = max(1, self._offload_steps)
        local["offload_wait_us"] = int(self._waited_s / steps * 1e6)
        self._waited_s, self._offload_steps = 0.0, 0
        return local

    def gather(self) -> dict[str, float]:
        """Collective: every rank calls it. Rank 0 gets the figures in MiB (see `report`),
        the other ranks {}."""
        rows = gather_to_rank0(self.end_interval(), self.device)
        if rows is None:
            return {}
        out = report(rows, self.expected(), self.device.type)
        traffic = self.expected_traffic()
        if traffic:  # None for an unknown mode; 0 on one rank, where nothing is sent
            out["comm/expected_bytes_per_step"] = traffic
        across = self.expected_traffic_across()
        if across:  # hybrid sharding: the part that goes between shard groups
            out["comm/expected_bytes_per_step_across_groups"] = across
        return out


MiB = 2**20
# What the peak figure is, by device type: it names the tag, so a chart says which.
PEAK_NAMES = {"cuda": "peak_cuda_allocated", "cpu": "peak_step"}


def report(
    rows: list[dict[str, int]], exp: dict[str, float] | None, device_type: str
) -> dict[str, float]:
    """TensorBoard scalars in MiB from every rank's `rows` (keys FIELDS) and the formula.

    The max over ranks (the rank that limits you) is `memory/<kind>_MiB/max`, beside the
    formula `memory/expected/<kind>_MiB`; each rank's own figure is apart, under
    `per_rank/<kind>_MiB/rank<r>`, so that the `memory` tag filter shows a dozen charts.
    Kinds that are zero on every rank and in the formula (fp32 masters in fp32, comm
    buffers freed before the step ends) are left out, and so is the working set where it
    equals the model state (no transient units)."""
    exp = exp or {}
    out: dict[str, float] = {}
    rows = [{"disk": 0, "host": 0, "offload_wait_us": 0, **row} for row in rows]  # no offload
    for f in FIELDS:
        if f == "offload_wait_us":  # a time, not bytes; only where something is offloaded
            if any(row["disk"] or row["host"] for row in rows):
                out["offload/wait_ms_per_step/max"] = max(row[f] for row in rows) / 1e3
            continue
        if f == "peak":
            if any(row[f] < 0 for row in rows):  # not measured on some rank
                continue
            name = PEAK_NAMES.get(device_type, "peak")
        else:
            if all(row[f] == 0 for row in rows) and not exp.get(f):
                continue
            name = f
        out[f"memory/{name}_MiB/max"] = max(row[f] for row in rows) / MiB
        for r, row in enumerate(rows):
            out[f"per_rank/{name}_MiB/rank{r}"] = row[f] / MiB
    for k, v in exp.items():
        if k == "working_set" and v == exp.get("model_state"):
            continue
        if v:
            out[f"memory/expected/{k}_MiB"] = v / MiB
    return out
