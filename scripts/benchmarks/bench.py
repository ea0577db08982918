"""Step time and memory of ddp / zero / fsdp next to PyTorch's DDP and FSDP2: docs/bench.md.

    torchrun --standalone --nproc-per-node=2 scripts/benchmarks/bench.py --width 1024 --depth 8 \\
        --batch-per-rank 32 --steps 20 --rounds 3 --out bench.json --md bench.md
    python scripts/benchmarks/bench.py --nproc 2 ...        # the same; launches torchrun itself

Contenders, each paired with the PyTorch code that does the same job:

    floor                  no communication: each rank steps a local copy of the model
                           (forward, backward, AdamW). What perfect overlap would reach.
    ddp    vs torch_ddp    torch.nn.parallel.DistributedDataParallel (defaults)
    zero   vs fsdp2_keep   fully_shard(..., reshard_after_forward=False)
    fsdp   vs fsdp2        fully_shard(..., reshard_after_forward=True)

With `--shard-group-size S` (hybrid sharding, S dividing P), four more:

    zero_hybrid  vs fsdp2_hsdp_keep   mode=zero, mode.shard_group_size=S; fully_shard
                                      over a (P/S, S) DeviceMesh, reshard_after_forward=False
    fsdp_hybrid  vs fsdp2_hsdp        mode=fsdp, mode.shard_group_size=S; the same with
                                      reshard_after_forward=True (FSDP2's HSDP)

What every contender gets: [Note: what every contender gets], and traffic: [Note: traffic
of the contenders], beside build; timing: [Note: timing rounds] beside timed_steps; memory:
[Note: how memory is measured] beside memory_of.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from trainer import comm  # noqa: E402
from trainer.models.builtin import MLP  # noqa: E402
from trainer.observe import heap  # noqa: E402
from trainer.observe.memory import measure  # noqa: E402
from trainer.parallel import build_engine  # noqa: E402
from trainer.parallel.units import plan_units  # noqa: E402
from trainer.run import dist as tdist  # noqa: E402

CONTENDERS = ("floor", "ddp", "torch_ddp", "zero", "fsdp2_keep", "fsdp", "fsdp2")
HYBRID = ("zero_hybrid", "fsdp2_hsdp_keep", "fsdp_hybrid", "fsdp2_hsdp")
PAIRS = {
    "ddp": "torch_ddp",
    "zero": "fsdp2_keep",
    "fsdp": "fsdp2",
    "zero_hybrid": "fsdp2_hsdp_keep",
    "fsdp_hybrid": "fsdp2_hsdp",
}
# Targets from the issue: step time as a fraction of PyTorch's, peak model state / 16Ψ
# (memory targets hold at P=2).
TIME_TARGET = {"ddp": 0.95, "zero": 0.6, "fsdp": 0.6}
MEM_TARGET = {"ddp": 1.05, "zero": 0.68, "fsdp": 0.56}
NUM_CLASSES = 10


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--width", type=int, default=1024, help="MLP input and hidden width")
    ap.add_argument("--depth", type=int, default=8, help="hidden Linear layers")
    ap.add_argument("--batch-per-rank", type=int, default=32)
    ap.add_argument("--steps", type=int, default=20, help="timed steps per round")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps before them")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--contenders", default="", help="comma-separated (default: all)")
    ap.add_argument(
        "--shard-group-size",
        type=int,
        default=0,
        help="S: add the hybrid contenders, sharding within groups of S ranks",
    )
    ap.add_argument("--mem-width", type=int, default=0, help="memory pass width (0: none)")
    ap.add_argument("--mem-depth", type=int, default=0, help="memory pass depth")
    ap.add_argument("--no-memory", action="store_true", help="skip memory measurement")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--nproc", type=int, default=2, help="ranks, when not under torchrun")
    ap.add_argument("--out", type=Path, help="JSON results")
    ap.add_argument("--md", type=Path, help="markdown tables")
    args = ap.parse_args(argv)
    known = CONTENDERS + (HYBRID if args.shard_group_size else ())
    args.contenders = [c for c in args.contenders.split(",") if c] or list(known)
    unknown = set(args.contenders) - set(known)
    if unknown:
        hint = " (the hybrid ones need --shard-group-size)" if set(unknown) & set(HYBRID) else ""
        ap.error(f"unknown contenders {sorted(unknown)}; choose from {', '.join(known)}{hint}")
    return args


# ---------------------------------------------------------------------------------------
# Contenders: each builds a model from the same seed and returns a step function.


@dataclass
class Built:
    step: Callable[[], None]
    optimizer: torch.optim.Optimizer
    state: Callable[[], int]  # live model-state bytes ([Note: how memory is measured])
    bytes_per_step: Callable[[], float] | None  # formula (PyTorch's); None: comm.stats
    engine: object | None = None
    across_per_step: float = 0.0  # of bytes_per_step, sent between shard groups (formula)


def make_model(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    return MLP(in_dim=width, hidden=width, depth=depth, num_classes=NUM_CLASSES)


def make_batch(width: int, batch: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(batch, width, generator=g)  # (B, width)
    y = torch.randint(0, NUM_CLASSES, (batch,), generator=g)  # (B,)
    return x, y


def adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


def storage_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct live storages behind `tensors` (a DTensor by its local shard)."""
    seen, total = set(), 0
    for t in tensors:
        if hasattr(t, "to_local"):
            t = t.to_local()
        s = t.untyped_storage()
        if s.nbytes() and s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total


def torch_state_bytes(model: nn.Module, opt: torch.optim.Optimizer, extra: int = 0) -> int:
    params = list(model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    state = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    return storage_bytes(params + grads + state) + extra


# [Note: traffic of the contenders]
# Bytes each rank sends per step. Ours: counted by trainer.comm (ring model) over
# the timed steps. PyTorch's: the ring formula for the collectives it issues (DDP one
# AllReduce of Ψ; FSDP2 one AllGather per unit forward, another per unit backward when it
# reshards after forward (not the root), one ReduceScatter per unit; HSDP the same inside
# groups of S plus an AllReduce of each unit's 1/S slice across the P/S groups). "across"
# is the part sent between shard groups (between nodes, when a group is a node).
#
# [Note: what every contender gets]
# FSDP2 shards the same units as `mode=fsdp` (trainer.parallel.units.plan_units: here
# every hidden Linear), then the root. Every contender gets the same model (same seed),
# the same batch on each rank, and AdamW(lr=1e-3) with PyTorch's default implementation.
def build(name: str, width: int, depth: int, x: torch.Tensor, y: torch.Tensor, s: int = 0) -> Built:
    """Contender `name`; `s` is the shard group size of the hybrid ones."""
    model = make_model(width, depth)
    p, psi = comm.world_size(), sum(t.numel() for t in model.parameters())

    def plain_step(module: nn.Module, opt: torch.optim.Optimizer) -> Callable[[], None]:
        def step() -> None:
            F.cross_entropy(module(x), y).backward()
            opt.step()
            opt.zero_grad()  # set_to_none, PyTorch's default

        return step

    if name == "floor":
        opt = adamw(model.parameters())
        return Built(
            plain_step(model, opt), opt, lambda: torch_state_bytes(model, opt), lambda: 0.0
        )

    if name in ("ddp", "zero", "fsdp", "zero_hybrid", "fsdp_hybrid"):
        mode, options = name.removesuffix("_hybrid"), {}
        if name.endswith("_hybrid"):
            options["shard_group_size"] = s
        engine = build_engine(model, mode, optimizer=adamw, **options)

        def step() -> None:
            engine.backward(F.cross_entropy(engine(x), y))
            engine.step()

        return Built(step, engine.optimizer, lambda: measure(engine)["model_state"], None, engine)

    if name == "torch_ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        ddp = DDP(model)
        opt = adamw(ddp.parameters())
        # The Reducer's flat gradient buckets are not reachable from Python; their sizes
        # are (one zero tensor per bucket, made here, outside any measured window).
        buckets = storage_bytes([b.buffer() for b in ddp.reducer._get_zeros_like_grad_buckets()])
        ring = 2 * (p - 1) / p * psi * 4
        return Built(
            plain_step(ddp, opt), opt, lambda: torch_state_bytes(model, opt, buckets), lambda: ring
        )

    if name in ("fsdp2", "fsdp2_keep", "fsdp2_hsdp", "fsdp2_hsdp_keep"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        reshard = not name.endswith("_keep")
        g = s if "hsdp" in name else p  # ranks sharding one copy
        mesh = init_device_mesh("cpu", (p // g, g), mesh_dim_names=("replicate", "shard"))
        if g == p:
            mesh = mesh["shard"]  # plain FSDP: a 1-D mesh
        units = [u.module for u in plan_units(model)[1:]]  # the units mode=fsdp would make
        unit_numel = [sum(t.numel() for t in m.parameters()) for m in units]
        for m in units:
            fully_shard(m, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
        opt = adamw(model.parameters())
        # AllGather per unit forward (+ per non-root unit backward when resharding),
        # ReduceScatter per unit: each moves (g-1)/g of the unit's bytes per rank; HSDP
        # then AllReduces each unit's 1/g slice over the p/g replicas.
        gathered = psi + (sum(unit_numel) if reshard else 0)
        r = p // g
        across = 2 * (r - 1) / r * 4 * psi / g
        ring = (g - 1) / g * 4 * (gathered + psi) + across
        return Built(
            plain_step(model, opt),
            opt,
            lambda: torch_state_bytes(model, opt),
            lambda: ring,
            across_per_step=across,
        )

    raise ValueError(name)


# ---------------------------------------------------------------------------------------
# Measuring


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on `device` before the clock is read: on CUDA a step
    returns when its kernels are queued, not run. A no-op on CPU, where ops are done when
    they return; every contender is timed the same way."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# [Note: timing rounds]
# Rounds alternate the contenders, in an order rotated every round, so drift of a
# shared machine hits all of them alike. Within a round each contender is built fresh,
# warmed up (`--warmup` steps), then `--steps` steps are timed one by one; a step's time is
# the slowest rank's. The table gives the median over all timed steps of all rounds, the
# ratios of those medians and, per round, the range of the ratio of that round's medians;
# the JSON keeps each round's medians.
def timed_steps(
    b: Built, warmup: int, steps: int, device: torch.device
) -> tuple[list[float], float, float]:
    """Per-step seconds (slowest rank per step), bytes sent per step and, of those, the
    bytes sent between shard groups."""
    for _ in range(warmup):
        b.step()
    synchronize(device)
    comm.barrier().wait()
    comm.stats.reset()
    times = torch.empty(steps, dtype=torch.float64)  # (steps,)
    for i in range(steps):
        t0 = time.perf_counter()
        b.step()
        synchronize(device)
        times[i] = time.perf_counter() - t0
    sent = sum(comm.stats.bytes_sent.values()) / steps
    across = comm.stats.bytes_across / steps
    if b.bytes_per_step is not None:
        sent, across = b.bytes_per_step(), b.across_per_step
    p = comm.world_size()
    every = torch.empty(p * steps, dtype=torch.float64)  # (P*steps,): rank r's at [r*steps:]
    comm.all_gather(every, times).wait()
    return every.view(p, steps).amax(0).tolist(), sent, across


def heap_bytes() -> int:
    """Bytes in use in the C heap of this process ([Note: the CPU step peak])."""
    if not heap.available():
        raise SystemExit("peak memory needs glibc's mallinfo2(); run with --no-memory")
    return heap.heap_bytes()


# [Note: how memory is measured]
# Two figures per rank, in units of 16Ψ (fp32 params, grads and AdamW's two moments: what
# one process training alone holds; Ψ = parameters):
#   state  live model-state storages right after the optimizer step (its post-hook), each
#          storage counted once: ours from `trainer.observe.memory.measure(engine)` (params, grads,
#          optimizer state; comm buffers apart); PyTorch's from the module's parameters (a
#          DTensor by its local shard), their `.grad`, the optimizer state and, for DDP, its
#          gradient buckets (the Reducer keeps a flat copy of all gradients beside `.grad`
#          unless gradient_as_bucket_view=True; they are not reachable from Python, so
#          their sizes are read from `reducer._get_zeros_like_grad_buckets()`).
#   peak   the highest C-heap use during one steady step (after warm-up) above the use
#          before the model was built. Heap use is glibc's `mallinfo2()` (in-use heap
#          chunks + blocks malloc mapped on its own: every thread and arena, so buffers of
#          the backend's own threads count too), sampled after every tensor op of the step
#          (trainer/observe/heap.py's TorchDispatchMode: forward, backward, hooks,
#          optimizer). It includes what the step holds for a moment: gathered units,
#          bucket buffers, receive buffers, autograd's per-parameter gradients, optimizer
#          temporaries, activations.
#          (torch.profiler's memory events were tried first: they miss frees made on
#          other threads, so FSDP2's figure crept up step after step.)
# Memory is measured once per contender (it does not drift), after the timed steps of the
# first round; `--mem-width/--mem-depth` add a pass on a larger model for memory alone.
def memory_of(
    name: str, width: int, depth: int, x, y, s: int = 0, warmup: int = 2
) -> dict[str, float]:
    """Build `name`, step it; live model state and peak heap bytes above the baseline."""
    gc.collect()
    base = heap_bytes()  # before the model exists
    b = build(name, width, depth, x, y, s)
    snap: dict[str, int] = {}
    state = b.state
    b.optimizer.register_step_post_hook(lambda *_: snap.__setitem__("state", state()))
    for _ in range(warmup):
        b.step()
    heap_bytes()  # fails with a hint where mallinfo2() is missing
    with heap.HeapPeak() as mode:
        b.step()
    del b
    gc.collect()
    return {"state": snap["state"], "peak": mode.peak - base}


def max_over_ranks(values: dict[str, float]) -> dict[str, float]:
    keys = sorted(values)
    t = torch.tensor([values[k] for k in keys], dtype=torch.float64)  # (K,)
    p = comm.world_size()
    every = torch.empty(p * len(keys), dtype=torch.float64)
    comm.all_gather(every, t).wait()
    return dict(zip(keys, every.view(p, -1).amax(0).tolist(), strict=True))


# ---------------------------------------------------------------------------------------
# The run


def run(args: argparse.Namespace) -> dict:
    env = tdist.init("gloo")
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]  # other jobs on the machine: read the figures with it
    x, y = make_batch(args.width, args.batch_per_rank, env.rank)
    psi = sum(t.numel() for t in make_model(args.width, args.depth).parameters())
    names = args.contenders
    times: dict[str, list[float]] = {n: [] for n in names}
    rounds: list[dict[str, float]] = []
    sent: dict[str, float] = {}
    across: dict[str, float] = {}
    mem: dict[str, dict[str, float]] = {}
    s = args.shard_group_size
    if s and env.world_size % s:
        raise SystemExit(f"--shard-group-size {s} must divide the world size {env.world_size}")
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        medians = {}
        for n in order:
            gc.collect()
            b = build(n, args.width, args.depth, x, y, s)
            ts, sent[n], across[n] = timed_steps(b, args.warmup, args.steps, x.device)
            del b
            times[n] += ts
            medians[n] = statistics.median(ts)
            if r == 0 and not args.no_memory:
                mem[n] = max_over_ranks(memory_of(n, args.width, args.depth, x, y, s))
            if env.is_rank0:
                print(f"round {r} {n:11s} {1e3 * medians[n]:8.2f} ms", flush=True)
        rounds.append(medians)
    result = {
        "config": {
            "world_size": env.world_size,
            "width": args.width,
            "depth": args.depth,
            "batch_per_rank": args.batch_per_rank,
            "steps": args.steps,
            "warmup": args.warmup,
            "rounds": args.rounds,
            "threads": args.threads,
            "shard_group_size": s or None,
            "psi": psi,
            "torch": torch.__version__,
            "load_average_1min": [load_before, os.getloadavg()[0]],  # before, after timing
        },
        "rows": rows(names, times, rounds, sent, across, mem, psi),
        "rounds": rounds,
    }
    if args.mem_width and args.mem_depth:
        mx, my = make_batch(args.mem_width, args.batch_per_rank, env.rank)
        mpsi = sum(t.numel() for t in make_model(args.mem_width, args.mem_depth).parameters())
        mrows = []
        for n in names:
            m = max_over_ranks(memory_of(n, args.mem_width, args.mem_depth, mx, my, s))
            mrows.append({"contender": n, **_mem_fields(m, mpsi)})
            if env.is_rank0:
                print(f"memory {n:11s} peak {m['peak'] / 16 / mpsi:.3f} x 16Ψ", flush=True)
        result["memory_pass"] = {
            "width": args.mem_width,
            "depth": args.mem_depth,
            "psi": mpsi,
            "rows": mrows,
        }
    tdist.shutdown()
    return result if env.is_rank0 else {}


def _mem_fields(m: dict[str, float] | None, psi: int) -> dict[str, float | None]:
    if not m:
        return {"state_bytes": None, "peak_bytes": None, "state_16psi": None, "peak_16psi": None}
    return {
        "state_bytes": m["state"],
        "peak_bytes": m["peak"],
        "state_16psi": m["state"] / (16 * psi),
        "peak_16psi": m["peak"] / (16 * psi),
    }


def rows(names, times, rounds, sent, across, mem, psi) -> list[dict]:
    """Ratios of medians over all timed steps, and each round's ratio of its medians (a
    paired figure: both sides of a round ran minutes apart at most)."""
    med = {n: statistics.median(times[n]) for n in names}
    floor = med.get("floor")
    out = []
    for n in names:
        ref = PAIRS.get(n)
        per_round = [r[n] / r[ref] for r in rounds] if ref in med else []
        out.append(
            {
                "contender": n,
                "vs": ref,
                "median_step_ms": 1e3 * med[n],
                "ratio_to_torch": med[n] / med[ref] if ref in med else None,
                "ratio_to_torch_per_round": per_round,
                "ratio_to_floor": med[n] / floor if floor else None,
                "bytes_per_step": sent[n],
                "bytes_across_per_step": across[n],
                **_mem_fields(mem.get(n), psi),
            }
        )
    return out


# ---------------------------------------------------------------------------------------
# Output


def _f(v, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def markdown(result: dict) -> str:
    c = result["config"]
    lines = [
        f"{c['world_size']} ranks, MLP {c['depth']} x {c['width']} (Ψ = {c['psi']:,}), "
        f"{c['batch_per_rank']} samples per rank, AdamW, {c['rounds']} rounds x "
        f"{c['steps']} timed steps, torch {c['torch']}, {c['threads']} thread(s) per rank; "
        "load average (1 min) before / after timing: "
        + " / ".join(f"{v:.1f}" for v in c["load_average_1min"])
        + ".",
        "",
        "| contender | vs | median step ms | / PyTorch | per round | target | / floor | "
        "state / 16Ψ | peak / 16Ψ | MB sent per step | of which across groups |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        n, pr = r["contender"], r["ratio_to_torch_per_round"]
        spread = f"{min(pr):.2f}-{max(pr):.2f}" if pr else "-"
        lines.append(
            f"| `{n}` | {'`' + r['vs'] + '`' if r['vs'] else ''} "
            f"| {r['median_step_ms']:.1f} | {_f(r['ratio_to_torch'], '.2f')} | {spread} "
            f"| {_f(TIME_TARGET.get(n), '.2f')} | {_f(r['ratio_to_floor'], '.2f')} "
            f"| {_f(r['state_16psi'], '.3f')} | {_f(r['peak_16psi'], '.3f')} "
            f"| {r['bytes_per_step'] / 1e6:.1f} | {r['bytes_across_per_step'] / 1e6:.2f} |"
        )
    if "memory_pass" in result:
        mp = result["memory_pass"]
        lines += [
            "",
            f"Memory pass: MLP {mp['depth']} x {mp['width']} (Ψ = {mp['psi']:,}, "
            f"16Ψ = {16 * mp['psi'] / 2**20:.0f} MiB), per rank, max over ranks.",
            "",
            "| contender | state / 16Ψ | peak / 16Ψ | target (peak) | state MiB | peak MiB |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for r in mp["rows"]:
            lines.append(
                f"| `{r['contender']}` | {r['state_16psi']:.3f} | {r['peak_16psi']:.3f} "
                f"| {_f(MEM_TARGET.get(r['contender']), '.2f')} "
                f"| {r['state_bytes'] / 2**20:.0f} | {r['peak_bytes'] / 2**20:.0f} |"
            )
    lines += ["", *targets(result)]
    return "\n".join(lines) + "\n"


def targets(result: dict) -> list[str]:
    """One line per target of the issue: the measured figure and whether it is met."""
    out = []
    by_name = {r["contender"]: r for r in result["rows"]}
    for n, limit in TIME_TARGET.items():
        ratio = by_name.get(n, {}).get("ratio_to_torch")
        if ratio is not None:
            ok = "met" if ratio <= limit else "NOT met"
            out.append(f"- step time `{n}` / `{PAIRS[n]}`: {ratio:.2f} (target <= {limit}): {ok}")
    out += hybrid_targets(result, by_name)
    mp = result.get("memory_pass")
    if mp and result["config"]["world_size"] == 2:  # the memory targets are stated at P=2
        for r in mp["rows"]:
            limit = MEM_TARGET.get(r["contender"])
            if limit is not None:
                ok = "met" if r["peak_16psi"] <= limit else "NOT met"
                out.append(
                    f"- peak memory `{r['contender']}`: {r['peak_16psi']:.3f} x 16Ψ "
                    f"(target <= {limit}): {ok}"
                )
    return out


def hybrid_targets(result: dict, by_name: dict[str, dict]) -> list[str]:
    """Hybrid sharding: step time against FSDP2's HSDP no worse than full sharding's
    against FSDP2; bytes across groups and model state per rank against their formulas
    (trainer/observe/memory.py: 2(R-1)/R · 4Ψ/S across, fp32 AdamW state 16Ψ/S for fsdp and
    4Ψ + 12Ψ/S for zero)."""
    c = result["config"]
    s, p, psi = c.get("shard_group_size"), c["world_size"], c["psi"]
    if not s:
        return []
    out, r = [], p // s
    for ours in ("zero_hybrid", "fsdp_hybrid"):
        row = by_name.get(ours)
        if row is None:
            continue
        full = by_name.get(ours.removesuffix("_hybrid"), {}).get("ratio_to_torch")
        if row["ratio_to_torch"] is not None and full is not None:
            ok = "met" if row["ratio_to_torch"] <= full else "NOT met"
            out.append(
                f"- step time `{ours}` / `{PAIRS[ours]}`: {row['ratio_to_torch']:.2f} "
                f"(target <= {full:.2f}, `{ours.removesuffix('_hybrid')}` / its PyTorch "
                f"pair in this run): {ok}"
            )
        formula = 2 * (r - 1) / r * 4 * psi / s
        extra = row["bytes_across_per_step"] - formula
        out.append(
            f"- bytes across groups `{ours}`: {row['bytes_across_per_step']:,.0f} per step; "
            f"formula 2(R-1)/R · 4Ψ/S = {formula:,.0f} (+{extra:,.0f}: padding to a "
            "multiple of S and the used-flags)"
        )
        if row.get("state_bytes"):
            want = 16 * psi / s if ours == "fsdp_hybrid" else 4 * psi + 12 * psi / s
            out.append(
                f"- model state per rank `{ours}`: {row['state_bytes'] / 2**20:.2f} MiB; "
                f"formula {want / 2**20:.2f} MiB"
            )
    return out


def without_nproc(argv: list[str] | None) -> list[str]:
    """The arguments minus `--nproc N`: torchrun would take it for its --nproc-per-node."""
    args, out = list(sys.argv[1:] if argv is None else argv), []
    while args:
        a = args.pop(0)
        if a == "--nproc":
            args.pop(0)
        elif not a.startswith("--nproc="):
            out.append(a)
    return out


def launch(script: str, nproc: int, args: list[str]) -> int:
    """Run `script args` on `nproc` local ranks under torchrun; its exit status."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc-per-node={nproc}", script, *args]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    return subprocess.run(cmd, env=env).returncode


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if "RANK" not in os.environ:  # not under torchrun: launch it, with these arguments
        sys.exit(launch(__file__, args.nproc, without_nproc(argv)))
    result = run(args)
    if result:
        report(result, markdown(result), args.out, args.md)


def report(result: dict, text: str, out: Path | None, md: Path | None) -> None:
    """Print the table; write the figures as JSON to `out` and the table to `md`."""
    print(text)
    if out:
        out.write_text(json.dumps(result, indent=2) + "\n")
    if md:
        md.write_text(text)


if __name__ == "__main__":
    main()
