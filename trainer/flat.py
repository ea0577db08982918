"""Flat buffers: many parameters laid end to end in one tensor, padded to split evenly.

A `FlatLayout` records where each parameter lives inside a flat buffer. ddp uses it for
gradient buckets; zero and fsdp also cut the padded buffer into P equal shards, rank r
owning elements [r*S, (r+1)*S).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class FlatLayout:
    shapes: tuple[torch.Size, ...]
    offsets: tuple[int, ...]
    numel: int  # elements actually used by parameters
    padded_numel: int  # numel rounded up to a multiple of the world size

    @classmethod
    def of(cls, tensors: Sequence[torch.Tensor], world_size: int = 1) -> FlatLayout:
        offsets, total = [], 0
        for t in tensors:
            offsets.append(total)
            total += t.numel()
        padded = -(-total // world_size) * world_size if total else world_size
        return cls(tuple(t.shape for t in tensors), tuple(offsets), total, padded)

    def shard_size(self, world_size: int) -> int:
        return self.padded_numel // world_size

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """One view per parameter into `flat`, shaped like the parameter."""
        return [
            flat[o : o + s.numel()].view(s) for o, s in zip(self.offsets, self.shapes, strict=True)
        ]

    def copy_in(self, flat: torch.Tensor, tensors: Iterable[torch.Tensor]) -> None:
        for view, t in zip(self.views(flat), tensors, strict=True):
            view.copy_(t)


def bucketize(params: Sequence[nn.Parameter], bucket_bytes: int) -> list[list[nn.Parameter]]:
    """Group parameters into buckets of about `bucket_bytes`, in reverse registration order.

    Backward produces gradients roughly from the last layer to the first, so reversed
    order lets the first bucket fill (and its communication start) earliest.
    """
    buckets: list[list[nn.Parameter]] = []
    current: list[nn.Parameter] = []
    size = 0
    for p in reversed(list(params)):
        nbytes = p.numel() * p.element_size()
        # A bucket is one flat tensor, so it cannot mix dtypes or devices.
        mixed = current and (p.dtype, p.device) != (current[0].dtype, current[0].device)
        if current and (size + nbytes > bucket_bytes or mixed):
            buckets.append(current)
            current, size = [], 0
        current.append(p)
        size += nbytes
    if current:
        buckets.append(current)
    return buckets
