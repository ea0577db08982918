"""The one way trainer code reads a device value on the host.

On a GPU every such read (`.item()`, `.tolist()`, `nonzero()`) makes the CPU wait until
the device has computed the value: the CPU stops queueing kernels and communication
stops overlapping compute. torch DDP and FSDP2 make none in a steady step, and neither
do the engines here, in any precision (fp16 decides on the device whether to skip a
step; only an optimizer that cannot skip by itself makes the host read that flag, see
[Note: dynamic loss scaling] in scaling.py). Reads belong at log intervals,
checkpoints and errors. So do waits for the whole device (`synchronize`): the step clock
makes one at each end of a logging interval ([Note: timing steps] in metrics.py).
Going through these functions lets a test count them (`counting()`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class Reads:
    count: int = 0
    where: list[str] = field(default_factory=list)  # what each read was for


_counters: list[Reads] = []


def count_read(why: str) -> None:
    """Count one host read made elsewhere (the GPU rehearsal's stand-ins for these functions)."""
    for c in _counters:
        c.count += 1
        c.where.append(why)


def item(t: torch.Tensor, why: str) -> float | int | bool:
    """`t.item()`, counted."""
    count_read(why)
    return t.item()


def tolist(t: torch.Tensor, why: str) -> list:
    """`t.tolist()`, counted."""
    count_read(why)
    return t.tolist()


def synchronize(device: torch.device, why: str) -> None:
    """Wait until `device` has run everything queued on it (a no-op off CUDA: CPU ops
    are done when they return), counted as a read."""
    count_read(why)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_to_host(dst: torch.Tensor, src: torch.Tensor, why: str) -> None:
    """`dst.copy_(src)` from the device into pinned host memory, queued on the current
    stream without waiting (not a read: nothing is counted); whoever reads `dst` first
    waits for an event recorded after it (`wait_event`)."""
    dst.copy_(src, non_blocking=True)


def wait_event(event: Any, why: str) -> None:
    """Wait until the device has run everything before `event` (a CUDA event), counted
    as a read: the host reads what a copy to the host wrote (mode.offload=host)."""
    count_read(why)
    event.synchronize()


@contextmanager
def counting() -> Iterator[Reads]:
    """Count the host reads made inside the block."""
    reads = Reads()
    _counters.append(reads)
    try:
        yield reads
    finally:
        _counters.remove(reads)
