"""Process group set-up from torchrun's environment (or a single process), device choice."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from trainer.errors import ConfigError

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
            dist.init_process_group(backend, timeout=timeout, device_id=_device_id(device))
        else:
            store = dist.HashStore()
            dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout)
            rank, world_size, local_rank = 0, 1, 0
    return DistEnv(rank, world_size, local_rank, device, backend)


def _device_id(device: torch.device) -> torch.device | None:
    # Binding NCCL to the device lets it connect eagerly; Gloo takes no device.
    return device if device.type == "cuda" else None


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
