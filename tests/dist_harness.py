"""Run a function on P real processes joined in a Gloo group, collect what each returns."""

from __future__ import annotations

import io
import os
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

CTX = mp.get_context("forkserver")
# Children fork from a server that has already imported torch: much faster than spawn,
# and unlike fork from pytest it carries no OpenMP thread pool that could deadlock.
# torch._dynamo too: the first optimizer a process builds imports it (several seconds
# per rank, all ranks at once on a small machine). And the trainer (what the training
# loop imports: engines, models, collectives) and pytest, which each test module's
# functions bring: a 2-rank call took 0.42 s without them, 0.10 s with them. None of
# them starts a thread or touches a device on import (tests/warm_cli.py asserts it of
# the same imports).
CTX.set_forkserver_preload(
    ["torch", "torch.distributed", "torch._dynamo", "trainer.run.dist", "trainer.run.loop",
     "pytest"]
)  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(
    fn, rank: int, world_size: int, port: int, queue, args, kwargs, pg_timeout_s: float = 120
) -> None:
    """Rank `rank` of `run_distributed`: join the group, run `fn(env, *args, **kwargs)`
    and put (rank, result or error) on `queue`."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    import torch

    from trainer.run import dist as tdist

    torch.set_num_threads(1)  # P ranks share two cores
    try:
        env = tdist.init("gloo", timeout_s=pg_timeout_s)
        out = fn(env, *args, **kwargs)
        # Plain bytes: torch's queue pickler would pass tensors through shared memory
        # that vanishes when this process exits.
        buf = io.BytesIO()
        torch.save(out, buf)
        queue.put((rank, "ok", buf.getvalue()))
    except BaseException:  # report every failure to the parent, which raises it
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        tdist.shutdown()


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 240,
    pg_timeout_s: float = 120,
    **kwargs: Any,
) -> list[Any]:
    """Call `fn(env, *args, **kwargs)` on each of `world_size` ranks; return results by rank.
    `pg_timeout_s`: how long a collective may wait for its peers before it raises."""
    queue = CTX.Queue()
    port = free_port()
    procs = [
        CTX.Process(
            target=worker,
            args=(fn, r, world_size, port, queue, args, kwargs, pg_timeout_s),
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors = []
    try:
        for _ in range(world_size):
            rank, status, out = queue.get(timeout=timeout)
            if status == "error":
                errors.append(f"rank {rank}:\n{out}")
                break
            results[rank] = torch.load(io.BytesIO(out), weights_only=False)
    finally:
        for p in procs:
            p.join(timeout=5 if errors else timeout)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError("distributed worker failed\n" + "\n".join(errors))
    return [results[r] for r in range(world_size)]
