"""Bytes per step and step time of ddp / zero / fsdp with fp32, bf16 and int8 on the wire,
on loopback and on simulated slow links (comm.simulated_link), side by side: the tables of
docs/bench.md, "int8 on the wire" and "ddp int8 overlaps its AllReduce".

    python scripts/benchmarks/bench_quantized.py --nproc 2 --links 0,10,1 --out q2.json --md q2.md
    torchrun --standalone --nproc-per-node=4 scripts/benchmarks/bench_quantized.py ...   # the same

Wires (what the collectives send; the model is an fp32 MLP, `--width` x `--depth`):

    fp32   everything in fp32
    bf16   precision=bf16, mode.reduce_dtype=bf16: forward and backward in bf16 too, so
           its step time on a CPU includes bf16's slow matrix products (README)
    int8   mode.reduce_dtype=int8 and (zero, fsdp) mode.gather_dtype=int8, fp32 compute

Links: 0 is loopback as it is (Gloo on loopback moves bytes at memory speed: fewer bytes
barely show); L > 0 makes every collective take at least its bytes / L Gb/s + `--latency-us`
([Note: a simulated link] in trainer/comm/collectives.py). Rounds alternate the
contenders in an order rotated every round; a step's time is the slowest rank's; the
table gives the median over all timed steps of all rounds and the bytes each rank sent
per step, counted by trainer.comm (the packed bytes and scales for int8).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from scripts.benchmarks.bench import launch, report, without_nproc  # noqa: E402
from trainer import comm  # noqa: E402
from trainer.models.builtin import MLP  # noqa: E402
from trainer.parallel import build_engine  # noqa: E402
from trainer.run import dist as tdist  # noqa: E402

MODES = ("ddp", "zero", "fsdp")
WIRES = {
    "fp32": {},
    "bf16": {"precision": "bf16", "reduce_dtype": "bf16"},
    "int8": {"reduce_dtype": "int8", "gather_dtype": "int8"},
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--batch-per-rank", type=int, default=16)
    ap.add_argument(
        "--bucket-mb", type=float, help="ddp's and zero's bucket_mb (default: the engines')"
    )
    ap.add_argument("--steps", type=int, default=5, help="timed steps per round")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--links", default="0,10,1", help="Gb/s, comma-separated (0: loopback)")
    ap.add_argument("--latency-us", type=float, default=0.0)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--wires", default=",".join(WIRES))
    ap.add_argument("--nproc", type=int, default=2, help="ranks, when not under torchrun")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--md", type=Path)
    return ap.parse_args(argv)


def _options(mode: str, wire: str, bucket_mb: float | None = None) -> dict:
    opts = dict(WIRES[wire])
    if mode == "ddp":
        opts.pop("gather_dtype", None)  # ddp gathers nothing: its AllReduce is int8 both ways
    if bucket_mb is not None and mode in ("ddp", "zero"):
        opts["bucket_mb"] = bucket_mb
    return opts


def _time(args, env, mode: str, wire: str, gbps: float) -> tuple[list[float], float, float, float]:
    """Per timed step the slowest rank's seconds; per step, the bytes this rank sent, the
    collectives it launched and the seconds it waited for them (comm.stats.exposed_s)."""
    torch.manual_seed(0)
    model = MLP(in_dim=args.width, hidden=args.width, depth=args.depth)
    opt = torch.optim.AdamW
    options = _options(mode, wire, args.bucket_mb)
    engine = build_engine(model, mode, lambda ps: opt(ps, lr=1e-3), **options)
    g = torch.Generator().manual_seed(env.rank)
    x = torch.randn(args.batch_per_rank, args.width, generator=g)
    y = torch.randint(0, 10, (args.batch_per_rank,), generator=g)
    comm.simulated_link(gbps or None, args.latency_us / 1e6)
    times = []
    try:
        for i in range(args.warmup + args.steps):
            if i == args.warmup:
                comm.stats.reset()
            comm.barrier().wait()
            t = time.perf_counter()
            F.cross_entropy(engine(x), y).backward()
            engine.step()
            times.append(time.perf_counter() - t)
        sent = sum(comm.stats.bytes_sent.values()) / args.steps
        exposed = comm.stats.exposed_s / args.steps
        calls = (
            sum(n for op, n in comm.stats.calls.items() if comm.stats.bytes_sent[op]) / args.steps
        )
    finally:
        comm.simulated_link(None)
    mine = torch.tensor(times[args.warmup :])
    every = torch.empty(env.world_size * mine.numel())
    with comm.unaccounted():  # not part of the figures
        comm.all_gather(every, mine, tag="bench").wait()
    return every.view(env.world_size, -1).max(0).values.tolist(), sent, calls, exposed


def run(args: argparse.Namespace) -> dict:
    env = tdist.init("gloo")
    torch.set_num_threads(1)
    links = [float(v) for v in args.links.split(",")]
    contenders = [
        (m, w, gb) for gb in links for m in args.modes.split(",") for w in args.wires.split(",")
    ]
    results: dict[str, dict] = {}
    for r in range(args.rounds):
        shift = r % len(contenders)
        for mode, wire, gbps in contenders[shift:] + contenders[:shift]:
            times, sent, calls, exposed = _time(args, env, mode, wire, gbps)
            row = results.setdefault(
                f"{mode}/{wire}/{gbps:g}",
                {"times": [], "bytes": sent, "calls": calls, "exposed": []},
            )
            row["times"] += times
            row["exposed"].append(exposed)
    tdist.shutdown()
    if env.rank != 0:
        return {}
    psi = sum(
        p.numel() for p in MLP(in_dim=args.width, hidden=args.width, depth=args.depth).parameters()
    )
    for row in results.values():
        row["median_s"] = statistics.median(row["times"])
    return {
        "world_size": env.world_size,
        "params": psi,
        "args": vars(args) | {"out": None, "md": None},
        "results": results,
    }


def markdown(result: dict) -> str:
    res, p = result["results"], result["world_size"]
    links = sorted({k.split("/")[2] for k in res}, key=float)
    out = [
        f"{p} ranks, Ψ = {result['params']:,}; bytes sent per rank per step (trainer.comm), "
        "step time (median, slowest rank) per link; x: vs fp32 of the same mode and link",
        "",
        "| mode | wire | bytes/step | vs fp32 | "
        + " | ".join(f"{'loopback' if float(v) == 0 else v + ' Gb/s'} step s (x)" for v in links)
        + " |",
        "|---|---|---|---|" + "---|" * len(links),
    ]
    for key in res:
        mode, wire, link = key.split("/")
        if link != links[0]:
            continue
        base = res[f"{mode}/fp32/{link}"]["bytes"]
        cells = []
        for v in links:
            t, t32 = res[f"{mode}/{wire}/{v}"]["median_s"], res[f"{mode}/fp32/{v}"]["median_s"]
            cells.append(f"{t:.3f} ({t32 / t:.2f}x)")
        row = res[key]
        out.append(
            f"| {mode} | {wire} | {row['bytes']:,.0f} | {row['bytes'] / base:.3f} | "
            + " | ".join(cells)
            + " |"
        )
    out += ["", *overlap(result)] if "0" in links and len(links) > 1 else []
    return "\n".join(out) + "\n"


def overlap(result: dict) -> list[str]:
    """Each simulated link's step against what full overlap would give: the longer of the
    loopback step (compute, its own quantization included, communication at memory
    speed) and the link time of the bytes this rank sent (bytes / bandwidth + latency per
    collective)."""
    res = result["results"]
    latency_s = result["args"]["latency_us"] / 1e6
    out = [
        "step time vs max(compute, link): compute = the same mode and wire on loopback, "
        "link = bytes/step x 8 / bandwidth + latency x collectives; waited: rank 0's time "
        "in wait() per step (comm.stats.exposed_s), median over rounds",
        "",
        "| mode | wire | link | step s | compute s | link s | step / max | waited s/step |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for key, row in res.items():
        mode, wire, link = key.split("/")
        if float(link) == 0:
            continue
        compute = res[f"{mode}/{wire}/0"]["median_s"]
        link_s = row["bytes"] * 8 / (float(link) * 1e9) + latency_s * row["calls"]
        out.append(
            f"| {mode} | {wire} | {link} Gb/s | {row['median_s']:.3f} | {compute:.3f} | "
            f"{link_s:.3f} | {row['median_s'] / max(compute, link_s):.2f} | "
            f"{statistics.median(row['exposed']):.3f} |"
        )
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if "RANK" not in os.environ:
        sys.exit(launch(__file__, args.nproc, without_nproc(argv)))
    result = run(args)
    if result:
        report(result, markdown(result), args.out, args.md)


if __name__ == "__main__":
    main()
