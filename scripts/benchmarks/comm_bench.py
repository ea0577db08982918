"""Time each collective per message size: time, algbw, busbw and ring traffic per rank: the
tables of docs/comm_bench.md (summed up in docs/collectives.md).

    torchrun --standalone --nproc-per-node=4 scripts/benchmarks/comm_bench.py --max-mb 16 \\
        --out bench.json

Every op goes through trainer.comm, the trainer's own code path. reduce_scatter and
all_gather are timed twice: the backend's native op ("native") and comm's own exchange
of point-to-point sends ("p2p", what comm picks on Gloo), forced with comm.p2p(...).

Definitions follow nccl-tests: size = bytes of the full buffer (the all-reduce buffer,
the gathered output, the reduce-scatter input, one rank's all-to-all buffer);
algbw = size / time; busbw = algbw x factor, the factor that makes busbw comparable
with the link's bandwidth: all_reduce 2(P-1)/P, all_gather, reduce_scatter and
all_to_all (P-1)/P, broadcast and reduce 1. "ring traffic/rank" is what one rank sends
under the ring algorithm (docs/collectives.md): the bytes the link must carry.
Time per size is the median over --iters of the slowest rank's time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from trainer import comm  # noqa: E402
from trainer.comm.all_to_all import all_to_all  # noqa: E402
from trainer.run import dist as tdist  # noqa: E402
from trainer.run.dist import DistEnv  # noqa: E402

OPS = ["all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce", "all_to_all"]
HAS_P2P = {"reduce_scatter", "all_gather"}


def bus_factor(op: str, p: int) -> float:
    if op == "all_reduce":
        return 2 * (p - 1) / p
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (p - 1) / p
    return 1.0  # broadcast, reduce


def sizes(min_kb: float, max_mb: float) -> list[int]:
    """Powers of 4 bytes from min_kb KB up to max_mb MB: 1 KB, 4 KB, ..., 256 MB."""
    out, n = [], int(min_kb * 1024)
    while n <= max_mb * 2**20:
        out.append(n)
        n *= 4
    return out


def make_op(op: str, nbytes: int, env: DistEnv):
    """Buffers for one `size` of `op` and a function launching it once (returns a Handle)."""
    p, r = env.world_size, env.rank
    n = max(nbytes // 4 // p, 1) * p  # float32 elements, a multiple of P
    full = torch.ones(n, device=env.device)  # (n,)
    if op == "all_reduce":
        return n * 4, lambda: comm.all_reduce(full)
    if op == "reduce_scatter":
        shard = torch.empty(n // p, device=env.device)
        return n * 4, lambda: comm.reduce_scatter(shard, full)
    if op == "all_gather":  # in place, as FSDP and ZeRO use it
        return n * 4, lambda: comm.all_gather(full, full.view(p, -1)[r])
    if op == "broadcast":
        return n * 4, lambda: comm.broadcast(full, src=0)
    if op == "reduce":
        return n * 4, lambda: comm.reduce(full, dst=0)
    if op == "all_to_all":
        out = torch.empty_like(full)
        return n * 4, lambda: all_to_all(out, full)
    raise ValueError(f"unknown op {op!r}; choose from {', '.join(OPS)}")


def ring_traffic(op: str, nbytes: int, p: int) -> float:
    """Bytes one rank sends under the ring algorithm, for a full buffer of `nbytes`."""
    if op in ("broadcast", "reduce"):
        return float(nbytes)
    return bus_factor(op, p) * nbytes


def sync(env: DistEnv) -> None:
    if env.device.type == "cuda":
        torch.cuda.synchronize(env.device)


def time_op(env: DistEnv, launch, warmup: int, iters: int) -> float:
    """Median over iterations of the slowest rank's seconds for one launch + wait."""
    for _ in range(warmup):
        launch().wait()
    sync(env)
    mine = torch.empty(iters, dtype=torch.float64, device=env.device)
    for i in range(iters):
        comm.barrier().wait()  # start together, so the time is the op's, not a straggler's
        t = time.perf_counter()
        launch().wait()
        sync(env)
        mine[i] = time.perf_counter() - t
    every = torch.empty(env.world_size * iters, dtype=torch.float64, device=env.device)
    comm.all_gather(every, mine).wait()
    slowest = every.view(env.world_size, iters).amax(0)  # (iters,)
    return statistics.median(slowest.tolist())


def run(env: DistEnv, ops: list[str], byte_sizes: list[int], warmup: int, iters: int):
    rows = []
    for op in ops:
        for nbytes in byte_sizes:
            # Native and p2p back to back per size, so both see the same machine load.
            for impl in ("native", "p2p") if op in HAS_P2P else ("native",):
                with comm.p2p(impl == "p2p"):
                    actual, launch = make_op(op, nbytes, env)
                    seconds = time_op(env, launch, warmup, iters)
                algbw = actual / seconds / 1e9
                rows.append(
                    {
                        "op": op,
                        "impl": impl,
                        "bytes": actual,
                        "time_ms": seconds * 1e3,
                        "algbw_gbps": algbw,
                        "busbw_gbps": algbw * bus_factor(op, env.world_size),
                        "ring_traffic_bytes": ring_traffic(op, actual, env.world_size),
                    }
                )
    return rows


def human(nbytes: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if nbytes < 1024 or unit == "GB":
            return f"{nbytes:.0f} {unit}" if nbytes == int(nbytes) else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    raise AssertionError


def markdown(rows: list[dict], header: str) -> str:
    lines = [
        header,
        "",
        "| op | impl | size | time (ms) | algbw (GB/s) | busbw (GB/s) | ring traffic/rank |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row['op']} | {row['impl']} | {human(row['bytes'])} | {row['time_ms']:.3f} "
            f"| {row['algbw_gbps']:.3f} | {row['busbw_gbps']:.3f} "
            f"| {human(row['ring_traffic_bytes'])} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", default=",".join(OPS), help="comma-separated subset of ops")
    parser.add_argument("--min-kb", type=float, default=1.0, help="smallest size, KB")
    parser.add_argument("--max-mb", type=float, default=256.0, help="largest size, MB")
    parser.add_argument("--iters", type=int, default=10, help="timed iterations per size")
    parser.add_argument("--warmup", type=int, default=2, help="untimed iterations per size")
    parser.add_argument("--backend", default="auto", choices=tdist.BACKENDS)
    parser.add_argument("--out", help="write the rows and set-up as JSON here (rank 0)")
    parser.add_argument("--md", help="write the markdown table here (rank 0)")
    args = parser.parse_args()
    ops = [op.strip() for op in args.ops.split(",") if op.strip()]
    unknown = sorted(set(ops) - set(OPS))
    if unknown:
        parser.error(f"unknown ops {unknown}; choose from {', '.join(OPS)}")
    byte_sizes = sizes(args.min_kb, args.max_mb)
    if not byte_sizes:
        parser.error(f"no sizes between --min-kb {args.min_kb} and --max-mb {args.max_mb}")

    env = tdist.init(args.backend)
    try:
        rows = run(env, ops, byte_sizes, args.warmup, args.iters)
    finally:
        tdist.shutdown()
    if env.rank != 0:
        return
    device = torch.cuda.get_device_name(env.device) if env.device.type == "cuda" else "CPU"
    setup = {
        "backend": env.backend,
        "world_size": env.world_size,
        "device": device,
        "torch": torch.__version__,
        "iters": args.iters,
        "warmup": args.warmup,
    }
    header = (
        f"{env.backend}, {env.world_size} ranks, {device}, torch {torch.__version__}, "
        f"median of {args.iters} iterations"
    )
    table = markdown(rows, header)
    print(table, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({**setup, "rows": rows}, f, indent=1)
    if args.md:
        with open(args.md, "w") as f:
            f.write(table)


if __name__ == "__main__":
    main()
