"""Process group set-up from torchrun's environment (or a single process), device choice."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from trainer.comm import groups as comm_groups
from trainer.errors import ConfigError, PeerError, is_collective_timeout

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
        index = cuda_device_index(
            local_rank, torch.cuda.device_count(), os.environ.get("CUDA_VISIBLE_DEVICES")
        )
        device = torch.device("cuda", index)
        torch.cuda.set_device(device)
        # precision=fp32 means fp32 in every kernel, as on CPU: torch already keeps TF32
        # off for matmuls, but cuDNN's convolutions use it by default, which would make
        # model=cnn/resnet18 differ from a CPU run by more than rounding (gpu_check.sh) and
        # their MFU be measured against the wrong peak. bf16 is the fast path.
        torch.backends.cudnn.allow_tf32 = False
        # [Note: NCCL timeouts] Set before the group exists: NCCL reads it at creation.
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", NCCL_ERROR_HANDLING)
    else:
        device = torch.device("cpu")
    timeout = timedelta(seconds=timeout_s)
    comm_groups.set_timeout(timeout)  # the groups the engines make wait as long
    if not dist.is_initialized():
        if "MASTER_ADDR" in os.environ:
            dist.init_process_group(
                backend, timeout=timeout, device_id=_device_id(device), **_attempt_store(timeout)
            )
        else:
            store = dist.HashStore()
            dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout)
            rank, world_size, local_rank = 0, 1, 0
    return DistEnv(rank, world_size, local_rank, device, backend)


def cuda_device_index(local_rank: int, device_count: int, visible: str | None) -> int:
    """The CUDA device this rank uses, among the `device_count` it sees.

    torchrun (and SLURM without GPU binding) shows every rank all of the node's GPUs:
    rank LOCAL_RANK takes GPU LOCAL_RANK. Launchers that bind one GPU per rank (SLURM's
    `--gpus-per-task=1`, Ray, Kubernetes device plugins, a wrapper script) set each rank's
    CUDA_VISIBLE_DEVICES to its own GPU: the rank sees exactly one, device 0, whatever its
    LOCAL_RANK. Anything else would put two ranks on one GPU, which NCCL does not allow.
    """
    if 0 <= local_rank < device_count:
        return local_rank
    if device_count == 1 and visible:
        return 0
    seen = f" (CUDA_VISIBLE_DEVICES={visible})" if visible else ""
    raise ConfigError(
        f"LOCAL_RANK={local_rank} but only {device_count} GPU(s) are visible{seen}; "
        "start at most one process per GPU"
    )


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


# [Note: NCCL timeouts]
# What a user sees when a rank stops answering (hung, killed without its socket closing,
# waiting in another collective) depends on the backend:
# - Gloo: every rank waiting on a collective with it raises in its main thread once the
#   collective has waited `dist.timeout_s` ("Timed out waiting 600000ms for recv"), and
#   `peer_failure` turns that into one line: "rank R: no answer from the other ranks
#   within dist.timeout_s=600 s; a rank has stopped responding (...)".
# - NCCL: collectives do not block the CPU, so no call times out in the main thread.
#   ProcessGroupNCCL's watchdog thread finds the work that ran past `dist.timeout_s`.
#   With TORCH_NCCL_ASYNC_ERROR_HANDLING=2, which `init` sets unless the user set it, the
#   watchdog aborts the communicators: the stuck kernels return, and the rank's next NCCL
#   call or wait raises "NCCL communicator was aborted on rank R. Original reason for
#   failure was: [Rank R] Watchdog caught collective operation timeout: WorkNCCL(...) ran
#   for 600000 milliseconds before timing out", which `peer_failure` turns into "rank R:
#   no answer from the other ranks within dist.timeout_s=600 s: NCCL's watchdog timed
#   out a collective and aborted the communicator; a rank has stopped responding (...)".
#   That line comes when the main thread next touches NCCL, a little after the timeout.
#   With torch's default, 3 (or 1), the watchdog ends the process itself (SIGABRT: no
#   Python exception, no line of ours; NCCL's "Watchdog caught collective operation
#   timeout ... we are taking the entire process down" is the last line in the log),
#   and with 0 the run hangs. A communicator aborted for another reason (an NCCL error,
#   a peer that died) is named as such, with NCCL's first line.
# The NCCL paths are not run by the tests (one GPU cannot hold two NCCL ranks); the
# texts matched are torch's (ProcessGroupNCCL.cpp), tests/test_dist.py feeds them in.
NCCL_ERROR_HANDLING = "2"

_STOPPED = "a rank has stopped responding (hung, or waiting in another collective)"


def peer_failure(error: RuntimeError, timeout_s: float) -> PeerError | None:
    """The one-line error for a collective that failed because another rank stopped
    answering or died, as each backend reports it ([Note: NCCL timeouts]); None for
    other errors."""
    text, rank = str(error), dist.get_rank() if dist.is_initialized() else 0
    lowered = text.lower()
    waited = f"rank {rank}: no answer from the other ranks within dist.timeout_s={timeout_s:g} s"
    if "watchdog caught collective operation timeout" in lowered:  # NCCL
        return PeerError(
            f"{waited}: NCCL's watchdog timed out a collective and aborted the "
            f"communicator; {_STOPPED}"
        )
    if "communicator was aborted" in lowered:  # NCCL, for another reason than a timeout
        first = text.strip().splitlines()[0][:300]
        return PeerError(f"rank {rank}: NCCL aborted the communicator after an error ({first})")
    if is_collective_timeout(error):  # Gloo ("timed out")
        return PeerError(f"{waited}; {_STOPPED}")
    if "closed by peer" in text or "reset by peer" in text:
        return PeerError(f"rank {rank}: lost the connection to another rank, which exited or died")
    return None


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    comm_groups.forget()
