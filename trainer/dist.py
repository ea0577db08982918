"""Process group set-up from torchrun's environment (or a single process), device choice."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from trainer.errors import ConfigError, PeerError

BACKENDS = ("auto", "gloo", "nccl")


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0


def resolve_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ConfigError(f"dist.backend={backend!r} is not one of {', '.join(BACKENDS)}")
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl" and not torch.cuda.is_available():
        raise ConfigError(
            "dist.backend=nccl needs a CUDA GPU and none is visible; use gloo or auto"
        )
    return backend


def init(backend: str = "auto", timeout_s: float = 600.0) -> DistEnv:
    """Join the process group torchrun describes, or make a group of one.

    A single `python train.py` still gets a real process group (world size 1), so every
    mode runs the same code path with or without torchrun.
    """
    backend = resolve_backend(backend)
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if backend == "nccl":
        if local_rank >= torch.cuda.device_count():
            raise ConfigError(
                f"LOCAL_RANK={local_rank} but only {torch.cuda.device_count()} GPU(s) are visible; "
                "start at most one process per GPU"
            )
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        timeout = timedelta(seconds=timeout_s)
        if "MASTER_ADDR" in os.environ:
            dist.init_process_group(
                backend, timeout=timeout, device_id=_device_id(device), **_attempt_store(timeout)
            )
        else:
            store = dist.HashStore()
            dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout)
            rank, world_size, local_rank = 0, 1, 0
    return DistEnv(rank, world_size, local_rank, device, backend)


def _attempt_store(timeout: timedelta) -> dict:
    """Under torchrun, a restarted group meets in the same store as the attempt before it,
    which still holds that attempt's keys (its ranks' Gloo addresses among them): a rank
    could read a dead peer's address before the new one replaces it, and fail to connect.
    So each attempt keeps its keys under its own prefix, numbered by how often this rank
    has joined: every rank joins once per attempt, so all ranks of one attempt agree
    (TORCHELASTIC_RESTART_COUNT need not: an agent restarting for a peer's sake keeps it)."""
    if "TORCHELASTIC_RESTART_COUNT" not in os.environ:
        return {}
    store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
    joins = store.add(f"shardtrain/joins/rank{rank}", 1)
    store = dist.PrefixStore(f"shardtrain/attempt{joins}", store)
    return {"store": store, "rank": rank, "world_size": world_size}


def _device_id(device: torch.device) -> torch.device | None:
    # Binding NCCL to the device lets it connect eagerly; Gloo takes no device.
    return device if device.type == "cuda" else None


def peer_failure(error: RuntimeError, timeout_s: float) -> PeerError | None:
    """The one-line error for a collective that failed because another rank stopped
    answering (Gloo raises after `dist.timeout_s`) or died; None for other errors."""
    text, rank = str(error), dist.get_rank() if dist.is_initialized() else 0
    if "timed out" in text.lower():
        return PeerError(
            f"rank {rank}: no answer from the other ranks within dist.timeout_s={timeout_s:g} s; "
            "a rank has stopped responding (hung, or waiting in another collective)"
        )
    if "closed by peer" in text or "reset by peer" in text:
        return PeerError(f"rank {rank}: lost the connection to another rank, which exited or died")
    return None


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
