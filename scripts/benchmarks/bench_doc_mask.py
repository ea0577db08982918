"""What `data.doc_mask=true` costs the built-in GPT: forward + backward with plain causal
attention against documents kept apart, side by side in one run: the table of
docs/own_text.md, "Documents kept apart".

    python scripts/benchmarks/bench_doc_mask.py                  # 6 x 384, block 256, batch 8, CPU
    python scripts/benchmarks/bench_doc_mask.py --device cuda    # the same on a GPU

One model (trainer.models.builtin.GPT, `--layers` blocks of `--embd`, `--heads` heads,
no weight tying), one batch of `--batch` x `--block` random ids cut into documents of 1
to 2 x `--doc-len` tokens (segments as trainer/data/tokens.py makes them, the targets
that start a document ignored). Each round times one forward + backward of each
variant, in turn, the first of the pair alternating from round to round, after
`--warmup` untimed rounds: `causal` is `model(x)` (scaled_dot_product_attention with
is_causal=True), `doc_mask` is `model(x, segments)` (a (B, 1, T, T) boolean mask, built
in the forward and included in its time). Reported: each variant's median over
`--rounds` rounds, and the median (and range) of the per-round ratios doc_mask / causal,
with the machine's load average (a shared machine's other jobs show there).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from trainer.models.builtin import GPT  # noqa: E402
from trainer.models.loss import IGNORE_INDEX, loss_fn  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--embd", type=int, default=384)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--block", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=65)
    ap.add_argument("--doc-len", type=int, default=64, help="mean document length")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, help="torch's intra-op threads (default: its own)")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


def batch(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids, targets (the document starts ignored) and segments, each (B, T)."""
    rng = np.random.default_rng(args.seed)
    ids = torch.from_numpy(rng.integers(args.vocab, size=(args.batch, args.block + 1)))
    starts = np.zeros((args.batch, args.block + 1), dtype=bool)  # window offsets 1..T
    for row in starts:
        at = 0
        while (at := at + int(rng.integers(1, 2 * args.doc_len + 1))) <= args.block:
            row[at] = True
    starts = torch.from_numpy(starts)
    segments = starts[:, :-1].cumsum(1)
    targets = ids[:, 1:].masked_fill(starts[:, 1:], IGNORE_INDEX)
    return ids[:, :-1], targets, segments


def fwd_bwd(model: GPT, x: torch.Tensor, y: torch.Tensor, extra: tuple, device) -> float:
    """Seconds of one forward + backward (the device caught up before and after)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    loss_fn(model(x, *extra), y).backward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    model.zero_grad(set_to_none=True)
    return seconds


def main(argv: list[str] | None = None) -> dict[str, float]:
    args = parse_args(argv)
    load = os.getloadavg()[0]
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    model = GPT(args.vocab, args.block, args.layers, args.heads, args.embd).to(device)
    x, y, seg = (t.to(device) for t in batch(args))
    variants = {"causal": (), "doc_mask": (seg,)}
    times: dict[str, list[float]] = {k: [] for k in variants}
    for r in range(args.warmup + args.rounds):
        order = list(variants) if r % 2 == 0 else list(variants)[::-1]
        took = {k: fwd_bwd(model, x, y, variants[k], device) for k in order}
        if r >= args.warmup:
            for k, s in took.items():
                times[k].append(s)
    ratios = [m / c for m, c in zip(times["doc_mask"], times["causal"], strict=True)]
    out = {
        "causal_s": statistics.median(times["causal"]),
        "doc_mask_s": statistics.median(times["doc_mask"]),
        "ratio": statistics.median(ratios),
    }
    docs = float((seg[:, -1] + 1).float().mean())
    print(
        f"GPT {args.layers} x {args.embd}, block {args.block}, batch {args.batch}, "
        f"{docs:.1f} documents per window, {args.device}, {torch.get_num_threads()} threads, "
        f"{args.rounds} rounds, load average {load:.1f} -> {os.getloadavg()[0]:.1f}"
    )
    print("| forward + backward | causal | doc_mask | doc_mask / causal |")
    print("|---|---|---|---|")
    print(
        f"| median of {args.rounds} (s) | {out['causal_s']:.3f} | {out['doc_mask_s']:.3f} "
        f"| {out['ratio']:.2f}x ({min(ratios):.2f}-{max(ratios):.2f}) |"
    )
    return out


if __name__ == "__main__":
    main()
