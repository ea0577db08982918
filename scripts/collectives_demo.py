"""Show what each collective does: every rank's data before and after, in rank order.

    torchrun --standalone --nproc-per-node=4 scripts/collectives_demo.py all_to_all
    torchrun --standalone --nproc-per-node=4 scripts/collectives_demo.py all

With 4 ranks the values are the reference table of docs/collectives.md; other world sizes
follow the same rules. Letters A, B, C, D stand for "rank 0's item", "rank 1's item", ...
Every demo goes through trainer.comm, the package the trainer itself uses (scatter and the
all-to-alls through trainer/comm/all_to_all.py, on the same launch path), so this is the
trainer's code path on Gloo (CPU) or NCCL (GPU).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from trainer import comm  # noqa: E402
from trainer.comm.all_to_all import all_to_all, all_to_all_uneven, scatter  # noqa: E402
from trainer.run import dist as tdist  # noqa: E402
from trainer.run.dist import DistEnv  # noqa: E402

# Every demo returns (before, after) for its rank: the values as shown to people (lists of
# ints or letters, or a word such as "empty"), so tests can compare them directly.
Shown = tuple[object, object]


def letters(t: torch.Tensor) -> list[str]:
    """Item codes 0, 1, 2, ... shown as A, B, C, ..."""
    return [chr(ord("A") + int(v)) for v in t.tolist()]


def ints(t: torch.Tensor) -> list[int]:
    return [int(v) for v in t.tolist()]


def demo_broadcast(env: DistEnv) -> Shown:
    """Rank 0's A is copied to every rank."""
    if env.rank == 0:
        t = torch.tensor([0.0], device=env.device)  # A
    else:
        t = torch.empty(1, device=env.device)  # a buffer of the right size, contents unset
    before = letters(t) if env.rank == 0 else "empty"
    comm.broadcast(t, src=0).wait()
    return before, letters(t)


def demo_reduce(env: DistEnv) -> Shown:
    """Sum into rank 0: 1 + 2 + 3 + 4 = 10."""
    t = torch.tensor([env.rank + 1.0], device=env.device)
    before = ints(t)
    comm.reduce(t, dst=0).wait()
    return before, ints(t) if env.rank == 0 else "undefined"


def demo_all_reduce(env: DistEnv) -> Shown:
    """Every rank gets the sum: [1, 10] + [2, 20] + [3, 30] + [4, 40] = [10, 100]."""
    t = torch.tensor([1.0, 10.0], device=env.device) * (env.rank + 1)
    before = ints(t)
    comm.all_reduce(t).wait()
    return before, ints(t)


def demo_gather(env: DistEnv) -> Shown:
    """Rank 0 collects every rank's item, in rank order."""
    t = torch.tensor([float(env.rank)], device=env.device)
    gathered = [torch.empty_like(t) for _ in range(env.world_size)] if env.rank == 0 else None
    comm.gather(t, gathered, dst=0).wait()
    return letters(t), letters(torch.cat(gathered)) if gathered else "nothing"


def demo_all_gather(env: DistEnv) -> Shown:
    """Every rank collects every rank's item, in rank order (FSDP's parameter rebuild)."""
    out = torch.empty(env.world_size, device=env.device)
    mine = out[env.rank : env.rank + 1]  # in place: the input is this rank's slot of output
    mine.fill_(env.rank)
    before = letters(mine)
    comm.all_gather(out, mine).wait()
    return before, letters(out)


def demo_scatter(env: DistEnv) -> Shown:
    """Rank 0 hands item r to rank r."""
    out = torch.empty(1, device=env.device)
    pieces = None
    before: object = "empty"
    if env.rank == 0:
        pieces = list(torch.arange(float(env.world_size), device=env.device).split(1))
        before = letters(torch.cat(pieces))
    scatter(out, pieces, src=0).wait()
    return before, letters(out)


def demo_reduce_scatter(env: DistEnv, example: int = 1) -> Shown:
    """Rank r gets the sum over ranks of everybody's r-th element (ZeRO's gradient shards).

    Example 1: rank r holds [10r, 10r+1, ...] -> rank 0 gets 0+10+20+30 = 60, rank 1 64, ...
    Example 2: rank r holds [1, 2, 3, 4] * 10^r -> rank 0 gets 1111, rank 1 2222, ...
    """
    p, r = env.world_size, env.rank
    j = torch.arange(float(p), device=env.device)
    full = 10 * r + j if example == 1 else (j + 1) * 10**r
    before = ints(full)
    out = torch.empty(1, device=env.device)
    comm.reduce_scatter(out, full).wait()
    return before, ints(out)


def demo_all_to_all(env: DistEnv) -> Shown:
    """Rank r's j-th item goes to rank j, landing in slot r (a transpose across ranks)."""
    p, r = env.world_size, env.rank
    sent = 10 * r + torch.arange(float(p), device=env.device)  # [10r + 0, 10r + 1, ...]
    received = torch.empty_like(sent)
    all_to_all(received, sent).wait()
    return ints(sent), ints(received)


def uneven_count(src: int, dst: int, p: int) -> int:
    """How many items rank `src` sends to rank `dst`: unequal, sometimes none, like MoE."""
    return (3 * src + dst) % p


def demo_all_to_all_uneven(env: DistEnv) -> Shown:
    """Rank r sends uneven_count(r, j) copies of item 10r+j to rank j.

    The split sizes travel first (each rank learns how much is coming from whom), then the
    variable-length pieces: MoE token dispatch with unbalanced routing.
    """
    p, r = env.world_size, env.rank
    pieces = [
        torch.full((uneven_count(r, j, p),), 10.0 * r + j, device=env.device) for j in range(p)
    ]
    received, handle = all_to_all_uneven(pieces)
    handle.wait()
    return [ints(t) for t in pieces], [ints(t) for t in received]


def demo_barrier(env: DistEnv, late_s: float = 0.5) -> Shown:
    """Rank 0 arrives `late_s` late; nobody leaves before it has arrived.

    Returns (arrived, left) in seconds since a start time all ranks share (rank 0's clock,
    broadcast), so the stamps of different ranks can be compared.
    """
    comm.barrier().wait()
    start = torch.tensor([time.time()], dtype=torch.float64, device=env.device)
    comm.broadcast(start, src=0).wait()
    t0 = float(start)
    if env.rank == 0:
        time.sleep(late_s)
    arrived = time.time() - t0
    comm.barrier().wait()
    left = time.time() - t0
    return arrived, left


# (op name as given on the command line, demo, what the op does in one line)
DEMOS: list[tuple[str, Callable[[DistEnv], Shown], str]] = [
    ("broadcast", demo_broadcast, "rank 0's data is copied to every rank"),
    ("reduce", demo_reduce, "the sum arrives on rank 0 only"),
    ("all_reduce", demo_all_reduce, "every rank gets the sum"),
    ("gather", demo_gather, "rank 0 collects every rank's data in rank order"),
    ("all_gather", demo_all_gather, "every rank collects every rank's data"),
    ("scatter", demo_scatter, "rank 0 hands piece r to rank r"),
    ("reduce_scatter", demo_reduce_scatter, "rank r gets the sum of everybody's r-th piece"),
    (
        "reduce_scatter",
        lambda env: demo_reduce_scatter(env, example=2),
        "second example: rank r holds [1, 2, 3, 4] x 10^r",
    ),
    ("all_to_all", demo_all_to_all, "rank r's j-th piece goes to rank j, into slot r"),
    (
        "all_to_all_uneven",
        demo_all_to_all_uneven,
        "split sizes are exchanged first, then pieces of any length move",
    ),
    ("barrier", demo_barrier, "rank 0 is 0.5 s late; nobody leaves before it arrives"),
]
OPS = list(dict.fromkeys(name for name, _, _ in DEMOS))


def show(value: object) -> str:
    """[1, 2] / [A, B] / [[2, 2], []] / empty: lists without quotes, ints as ints."""
    if isinstance(value, list):
        return "[" + ", ".join(show(v) for v in value) + "]"
    if isinstance(value, float):
        return f"{value:+.3f} s"
    return str(value)


def line(name: str, rank: int, before: object, after: object) -> str:
    if name == "barrier":
        return f"rank {rank}: barrier arrived {show(before)} -> left {show(after)}"
    return f"rank {rank}: {name} input={show(before)} -> {show(after)}"


LINE_BYTES = 512  # every rank's line is sent to rank 0 as a fixed-size byte tensor


def print_in_rank_order(env: DistEnv, text: str) -> None:
    """Gather every rank's text to rank 0, which prints them in rank order."""
    data = text.encode()[:LINE_BYTES]
    buf = torch.zeros(LINE_BYTES, dtype=torch.uint8, device=env.device)
    buf[: len(data)] = torch.tensor(list(data), dtype=torch.uint8)
    gathered = None
    if env.rank == 0:
        gathered = [torch.empty_like(buf) for _ in range(env.world_size)]
    comm.gather(buf, gathered, dst=0).wait()
    if gathered is not None:
        for t in gathered:
            print(bytes(t.cpu().tolist()).rstrip(b"\0").decode(), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("op", choices=[*OPS, "all"], help="which collective to show")
    op = parser.parse_args().op
    env = tdist.init("auto")
    try:
        for name, demo, what in DEMOS:
            if op not in ("all", name):
                continue
            if env.rank == 0:
                print(f"== {name}: {what} ({env.backend}, {env.world_size} ranks)", flush=True)
            before, after = demo(env)
            print_in_rank_order(env, line(name, env.rank, before, after))
    finally:
        tdist.shutdown()


if __name__ == "__main__":
    main()
