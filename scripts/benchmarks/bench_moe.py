"""GPT-MoE (8 experts, top-2) with and without expert parallelism: tokens/s, expert
memory per rank and AllToAll bytes per step next to the formula: the table of
docs/bench.md, "Mixture of experts".

    python scripts/benchmarks/bench_moe.py --nproc 2,4 --modes ddp,fsdp --md moe.md

Each world size in `--nproc` is one torchrun launch; within it each mode runs at
mode.expert_parallel=1 (every rank holds every expert) and E=P (each rank n/P experts),
`--steps` timed steps after `--warmup`, the step time being the slowest rank's. Model:
trainer.models.builtin.GPTMoE (`--layers` blocks, all MoE, n_embd `--width`), AdamW,
each rank on its own random windows of `--batch` x `--seq` tokens. Columns: tokens/s =
global tokens per step / median step time; state MB = the largest rank's model state
as live tensors (engine.state_tensors(): parameters, masters, gradients, optimizer
state); experts MB = the fp32 expert parameter elements a rank holds (ddp and zero: its
parameters; fsdp: the pieces of its slices); a2a MB/step = `comm.stats` bytes of all_to_all
per rank and step (rank 0), formula = parallel/experts.py `all_to_all_bytes` with
balanced routing (the counts' few bytes aside).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from trainer import comm  # noqa: E402
from trainer.models.builtin import GPTMoE  # noqa: E402
from trainer.parallel import build_engine, experts  # noqa: E402
from trainer.run import dist as tdist  # noqa: E402
from trainer.run.loop import forward_backward  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", default="2,4", help="world sizes, comma-separated (2,4)")
    ap.add_argument("--modes", default="ddp,zero,fsdp")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8, help="sequences per rank")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--md", type=Path, help="append the table to this file")
    return ap.parse_args(argv)


def _bytes(tensors: list[torch.Tensor]) -> int:
    seen = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def one(mode: str, e: int, args: argparse.Namespace, env) -> dict:
    torch.manual_seed(0)
    vocab = 256
    model = GPTMoE(vocab_size=vocab, block_size=args.seq, n_layer=args.layers, n_head=4,
                   n_embd=args.width, n_experts=8, top_k=2, aux_loss_coef=0.01)  # fmt: skip
    shape = experts.moe_shape(model)
    opts = {"min_unit_params": 1} if mode == "fsdp" else {}
    adamw = functools.partial(torch.optim.AdamW, lr=1e-3)
    engine = build_engine(model, mode, adamw, expert_parallel=e, **opts)
    g = torch.Generator().manual_seed(env.rank)
    tokens = torch.randint(0, vocab, (args.batch, args.seq + 1), generator=g)
    x, y = tokens[:, :-1], tokens[:, 1:]
    times = []
    for i in range(args.warmup + args.steps):
        if i == args.warmup:
            comm.barrier().wait()
            comm.stats.reset()
        t0 = time.perf_counter()
        forward_backward(engine, x, y, 1)
        engine.step()
        times.append(time.perf_counter() - t0)
    a2a = comm.stats.bytes_sent.get("all_to_all", 0.0) / args.steps
    times = times[args.warmup :]
    every = torch.tensor(times, dtype=torch.float64)
    gathered = torch.empty(env.world_size * len(times), dtype=torch.float64)
    comm.all_gather(gathered, every).wait()
    step_s = statistics.median(gathered.view(env.world_size, -1).amax(0).tolist())
    state = engine.state_tensors()
    total = _bytes(
        [t for k in ("params", "master", "grads", "optimizer") for t in state.get(k, [])]
    )
    # expert parameter elements held here: ddp and zero keep them as parameters, fsdp as
    # pieces of its slices (the parameters are freed between steps)
    held = sum(q.numel() for n, q in model.named_parameters() if ".experts." in n)
    if mode == "fsdp":
        pieces = [c for g in engine.shard_groups() for c in g.pieces]
        held = sum(c.end - c.start for c in pieces if ".experts." in c.name)
    mine = torch.tensor([total, 4 * held], dtype=torch.float64)
    most = torch.empty(env.world_size * 2, dtype=torch.float64)
    comm.all_gather(most, mine).wait()
    most = most.view(env.world_size, 2).amax(0)
    formula = experts.all_to_all_bytes(shape, e, args.batch * args.seq, 4, 2) if e > 1 else 0
    return {
        "mode": mode, "P": env.world_size, "E": e,
        "tokens_per_s": env.world_size * args.batch * args.seq / step_s,
        "state_mb": most[0].item() / 1e6, "experts_mb": most[1].item() / 1e6,
        "a2a_mb": a2a / 1e6, "formula_mb": formula / 1e6,
    }  # fmt: skip


def run(args: argparse.Namespace) -> None:
    env = tdist.init("gloo")
    try:
        torch.set_num_threads(1)
        rows = [one(m, e, args, env) for m in args.modes.split(",") for e in (1, env.world_size)]
    finally:
        tdist.shutdown()
    if env.rank == 0:
        print("ROWS " + json.dumps(rows), flush=True)


def table(rows: list[dict]) -> str:
    head = (
        "| mode | P | E | tokens/s | state MB (max rank) | experts MB (max rank) "
        "| a2a MB/step | formula MB/step |"
    )
    lines = [head, "|" + "---|" * 8]
    for r in rows:
        lines.append(
            f"| {r['mode']} | {r['P']} | {r['E']} | {r['tokens_per_s']:.0f} | "
            f"{r['state_mb']:.2f} | {r['experts_mb']:.2f} | {r['a2a_mb']:.2f} | "
            f"{r['formula_mb']:.2f} |"
        )
    return "\n".join(lines)


def _worker_args(args: argparse.Namespace) -> list[str]:
    """The options a launch's ranks need (not --nproc, which torchrun would take)."""
    keys = ("modes", "layers", "width", "batch", "seq", "steps", "warmup")
    return [f"--{k}={getattr(args, k)}" for k in keys]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if "RANK" in os.environ:
        run(args)
        return
    import subprocess

    rows = []
    for p in [int(n) for n in args.nproc.split(",")]:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd += [f"--nproc-per-node={p}", __file__, *_worker_args(args)]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        out = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if out.returncode:
            sys.exit(out.stderr[-3000:])
        line = next(x for x in out.stdout.splitlines() if x.startswith("ROWS "))
        rows += json.loads(line[5:])
    text = table(rows)
    print(text)
    if args.md:
        with args.md.open("a") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
