"""Tokens per second of model=gpt on token data through the trainer's engines, next to
the same model in a plain PyTorch loop (the floor), at 1 and 2 ranks: the tables of
docs/bench.md, "Tokens per second", and the side-by-side figures of docs/compile.md.

    python scripts/benchmarks/bench_tokens.py --nproc 1,2 --compile --md bench_tokens.md
    python scripts/benchmarks/bench_tokens.py --nproc 1 --data DIR   # token files (prepare_text.py)

Each world size in `--nproc` is one torchrun launch (as scripts/benchmarks/bench.py starts its
ranks); within a launch the contenders run in rounds, the order rotated every round, so
the ratios come from steps timed side by side. A step's time is the slowest rank's
(bench.py's `timed_steps`).

    floor        each rank trains its own copy with a plain PyTorch loop (forward,
                 cross-entropy, backward, AdamW step, zero_grad), no communication; its
                 tokens/s are summed over the ranks: at 1 rank the plain single-process
                 loop, at P ranks what perfect data parallelism would reach here
    ddp, zero, fsdp   build_engine(model, mode, AdamW) stepped as trainer/run/loop.py steps
                 it (`forward_backward`, `engine.step()`), on each rank's part of the
                 global batch (batch-per-rank windows per rank)
    *_compiled   with --compile: the same after trainer.models.compile.compile_layers(model)
                 (train.compile=true: each GPT block's forward through torch.compile)

What every contender shares: [Note: what every contender shares] beside build; the
columns: [Note: the columns] beside rows.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from scripts.benchmarks.bench import Built, launch, report, timed_steps, without_nproc  # noqa: E402
from trainer.models.builtin import GPT, loss_fn  # noqa: E402
from trainer.models.compile import compile_layers  # noqa: E402
from trainer.run import dist as tdist  # noqa: E402

MODES = ("ddp", "zero", "fsdp")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nproc", default="1,2", help="world sizes, one launch each")
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=64, help="window (tokens per sample)")
    ap.add_argument("--vocab-size", type=int, default=256, help="of the synthetic tokens")
    ap.add_argument("--nanogpt", action="store_true", help="model=nanogpt: no biases, tied head")
    ap.add_argument(
        "--fused", action="store_true", help="torch's fused AdamW (optim=adamw's default)"
    )
    ap.add_argument("--bucket-mb", type=float, help="ddp's and zero's bucket size")
    ap.add_argument("--data", type=Path, help="a token_file directory (default: synthetic)")
    ap.add_argument("--batch-per-rank", type=int, default=8, help="windows per rank and step")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per round")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps (compilation too)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--modes", default=",".join(MODES), help="engines to run")
    ap.add_argument("--compile", action="store_true", help="add the *_compiled contenders")
    ap.add_argument("--backend", default="inductor", help="torch.compile backend")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--json-out", type=Path, help=argparse.SUPPRESS)  # one launch's rows
    ap.add_argument("--out", type=Path, help="JSON results")
    ap.add_argument("--md", type=Path, help="markdown table")
    args = ap.parse_args(argv)
    args.nproc = [int(p) for p in str(args.nproc).split(",") if p]
    args.modes = [m for m in args.modes.split(",") if m]
    unknown = set(args.modes) - set(MODES)
    if unknown:
        ap.error(f"unknown modes {sorted(unknown)}; choose from {', '.join(MODES)}")
    return args


def contenders(args: argparse.Namespace) -> list[str]:
    names = ["floor", *args.modes]
    return names + [f"{n}_compiled" for n in names] if args.compile else names


# ---------------------------------------------------------------------------------------
# One launch: every contender on this world size


def dataset(args: argparse.Namespace):
    if args.data is not None:
        from trainer.data.tokens import TokenData

        return TokenData(dir=str(args.data), block_size=args.block_size)
    from trainer.data.datasets import synthetic_tokens

    n = 64 * args.batch_per_rank
    return synthetic_tokens(n=n, block_size=args.block_size, vocab_size=args.vocab_size)


def rank_batch(data, batch: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`batch` windows for this rank, (B, T) inputs and (B, T) targets."""
    g = torch.Generator().manual_seed(1000 + rank)
    idx = torch.randint(len(data), (batch,), generator=g).tolist()
    xs, ys = zip(*(data[i] for i in idx), strict=True)
    return torch.stack([torch.as_tensor(x) for x in xs]), torch.stack(
        [torch.as_tensor(y) for y in ys]
    )


def make_model(args: argparse.Namespace, vocab: int) -> GPT:
    torch.manual_seed(0)
    return GPT(
        vocab_size=vocab,
        block_size=args.block_size,
        n_layer=args.n_layer,
        n_head=args.n_head,
        n_embd=args.n_embd,
        tie_weights=args.nanogpt,
        bias=not args.nanogpt,
    )


# [Note: what every contender shares]
# Same for all: trainer.models.builtin.GPT built from seed 0 (`--nanogpt`: bias-free with a
# tied head, as model=nanogpt), AdamW(lr=1e-3) with PyTorch's default implementation
# (`--fused`: torch's fused AdamW, optim=adamw's default; `--bucket-mb`: ddp's and zero's
# buckets), one fixed batch of windows per rank drawn from the token data
# (`data=tokens`'s synthetic bigram sequences, or `--data DIR` read by
# trainer.data.tokens.TokenData as `data=token_file data.dir=DIR` reads it), `--threads`
# torch threads per rank.
def build(name: str, args: argparse.Namespace, vocab: int, x, y) -> Built:
    from trainer.parallel import build_engine
    from trainer.run.loop import forward_backward

    model = make_model(args, vocab)
    base = name.removesuffix("_compiled")
    if name.endswith("_compiled"):
        compile_layers(model, args.backend)
    adamw = functools.partial(torch.optim.AdamW, lr=1e-3, **({"fused": True} if args.fused else {}))
    if base == "floor":
        opt = adamw(model.parameters())

        def step() -> None:
            loss_fn(model(x), y).backward()
            opt.step()
            opt.zero_grad()  # set_to_none, PyTorch's default

        return Built(step, opt, lambda: 0, lambda: 0.0)
    options = {} if args.bucket_mb is None or base == "fsdp" else {"bucket_mb": args.bucket_mb}
    engine = build_engine(model, base, adamw, **options)

    def engine_step() -> None:
        forward_backward(engine, x, y, 1)
        engine.step()

    return Built(engine_step, engine.optimizer, lambda: 0, None, engine)


def run(args: argparse.Namespace) -> dict:
    env = tdist.init("gloo")
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    data = dataset(args)
    vocab = getattr(data, "vocab_size", None) or data.data_vocab_size()
    x, y = rank_batch(data, args.batch_per_rank, env.rank)
    names = contenders(args)
    times: dict[str, list[float]] = {n: [] for n in names}
    rounds: list[dict[str, float]] = []
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        medians = {}
        for n in order:
            gc.collect()
            b = build(n, args, vocab, x, y)
            ts, _, _ = timed_steps(b, args.warmup, args.steps, x.device)
            del b
            times[n] += ts
            medians[n] = statistics.median(ts)
            if env.is_rank0:
                print(
                    f"P={env.world_size} round {r} {n:14s} {1e3 * medians[n]:8.2f} ms", flush=True
                )
        rounds.append(medians)
    psi = sum(p.numel() for p in make_model(args, vocab).parameters())
    tokens = args.batch_per_rank * args.block_size * env.world_size  # global, per step
    result = {
        "world_size": env.world_size,
        "psi": psi,
        "vocab_size": vocab,
        "tokens_per_step": tokens,
        "load_average_1min": [load_before, os.getloadavg()[0]],
        "rows": rows(names, times, rounds, tokens, env.world_size),
    }
    tdist.shutdown()
    return result if env.is_rank0 else {}


# [Note: the columns]
# Columns: tokens/s = global tokens per step / median step time;
# / floor: against the floor of the same launch (same P); / 1-rank floor: against the
# floor of the 1-rank launch, when `--nproc` has 1; / eager: a compiled contender against
# its eager twin; per round: the range of that round's ratio to the floor.
def rows(names, times, rounds, tokens: int, world_size: int) -> list[dict]:
    med = {n: statistics.median(times[n]) for n in names}
    out = []
    for n in names:
        floor = "floor"  # the plain eager loop, for compiled contenders too
        eager = n.removesuffix("_compiled") if n.endswith("_compiled") else None
        out.append(
            {
                "contender": n,
                "world_size": world_size,
                "median_step_ms": 1e3 * med[n],
                "tokens_per_s": tokens / med[n],
                "ratio_to_floor": med[floor] / med[n],  # tokens/s over the floor's
                "ratio_to_floor_per_round": [r[floor] / r[n] for r in rounds],
                "ratio_to_eager": med[eager] / med[n] if eager else None,
            }
        )
    return out


# ---------------------------------------------------------------------------------------
# Output


def markdown(result: dict) -> str:
    c = result["config"]
    first = result["launches"][0]
    arch = ", nanoGPT's architecture (no biases, tied head)" if c.get("nanogpt") else ""
    fused = " (fused)" if c.get("fused") else ""
    buckets = "" if c.get("bucket_mb") is None else f", buckets of {c['bucket_mb']} MB"
    lines = [
        f"GPT {c['n_layer']} layers x {c['n_embd']} wide, {c['n_head']} heads, block "
        f"{c['block_size']}, vocab {first['vocab_size']} (Ψ = {first['psi']:,}){arch}, "
        f"{c['batch_per_rank']} windows per rank, AdamW{fused}{buckets}, {c['rounds']} rounds x "
        f"{c['steps']} timed steps after {c['warmup']} untimed, {c['threads']} thread(s) "
        f"per rank, data: {c['data']}, torch {c['torch']}.",
        "",
        "| P | contender | median step ms | tokens/s | / floor | per round | / 1-rank floor "
        "| / eager | load before / after |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    single = next((la for la in result["launches"] if la["world_size"] == 1), None)
    floor1 = single["rows"][0]["tokens_per_s"] if single else None
    for la in result["launches"]:
        load = " / ".join(f"{v:.1f}" for v in la["load_average_1min"])
        for r in la["rows"]:
            pr = r["ratio_to_floor_per_round"]
            one = f"{r['tokens_per_s'] / floor1:.2f}" if floor1 else "-"
            eager = "-" if r["ratio_to_eager"] is None else f"{r['ratio_to_eager']:.2f}"
            lines.append(
                f"| {la['world_size']} | `{r['contender']}` | {r['median_step_ms']:.1f} "
                f"| {r['tokens_per_s']:,.0f} | {r['ratio_to_floor']:.2f} "
                f"| {min(pr):.2f}-{max(pr):.2f} | {one} | {eager} | {load} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if "RANK" in os.environ:  # one launch, under torchrun
        result = run(args)
        if result and args.json_out:
            args.json_out.write_text(json.dumps(result) + "\n")
        return
    own = without_nproc(argv)  # each launch's world size is torchrun's
    launches = []
    with tempfile.TemporaryDirectory() as tmp:
        for p in args.nproc:
            part = Path(tmp) / f"p{p}.json"
            rc = launch(__file__, p, [*own, "--json-out", str(part)])
            if rc:
                sys.exit(rc)
            launches.append(json.loads(part.read_text()))
    result = {
        "config": {
            **{k: getattr(args, k) for k in ("n_layer", "n_head", "n_embd", "block_size")},
            **{k: getattr(args, k) for k in ("batch_per_rank", "steps", "warmup", "rounds")},
            "threads": args.threads,
            **{k: getattr(args, k) for k in ("nanogpt", "fused", "bucket_mb")},
            "data": str(args.data) if args.data else "synthetic tokens (data=tokens)",
            "compile_backend": args.backend if args.compile else None,
            "torch": torch.__version__,
        },
        "launches": launches,
    }
    report(result, markdown(result), args.out, args.md)


if __name__ == "__main__":
    main()
