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


class ScatterInput:
    """A flat gradient buffer as the input of a ReduceScatter, (P, S + extra): row r is
    what rank r receives the sum of, its S gradient elements followed by `extra` control
    elements that every rank fills alike (e.g. used-flags, [Note: used flags]).

    Without control elements the rows are simply the flat buffer cut in P, and each
    parameter's slot is one contiguous view. With them, a parameter that crosses a row
    boundary is written piece by piece (`write`): the control columns sit between its
    pieces, so no single view of it exists.
    """

    def __init__(
        self,
        layout: FlatLayout,
        world_size: int,
        extra: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.layout, self.extra = layout, extra
        self.shard = layout.shard_size(world_size)  # S
        # (P, S + extra); every element is written: slots by write/zero, the padding here,
        # the control columns by whoever fills them. So no memset of the whole buffer.
        self.rows = torch.empty(world_size, self.shard + extra, dtype=dtype, device=device)
        self.control = self.rows[:, self.shard :]  # (P, extra)
        self._flat = self.rows.view(-1) if not extra else None  # (P*S,) when contiguous
        self._zero_padding()

    def _zero_padding(self) -> None:
        last = self.layout.padded_numel - self.layout.numel  # padding at the very end
        if last:
            for start, stop, row, col in self._segments(self.layout.numel, last):
                self.rows[row, col : col + (stop - start)].zero_()

    def _segments(self, offset: int, numel: int):
        """(start, stop) ranges of a slot of `numel` elements at flat `offset`, with the row
        and column each range begins at."""
        s, pos, end = self.shard, offset, offset + numel
        while pos < end:
            row, col = divmod(pos, s)
            stop = min(end, (row + 1) * s)
            yield pos - offset, stop - offset, row, col
            pos = stop

    def write(self, i: int, grad: torch.Tensor) -> None:
        """Copy parameter i's gradient into its slot (casting to the buffer's dtype)."""
        o, n = self.layout.offsets[i], self.layout.shapes[i].numel()
        src = grad.reshape(-1)
        if self._flat is not None:
            self._flat[o : o + n].copy_(src)
            return
        for a, b, row, col in self._segments(o, n):
            self.rows[row, col : col + (b - a)].copy_(src[a:b])

    def zero(self, i: int) -> None:
        o, n = self.layout.offsets[i], self.layout.shapes[i].numel()
        if self._flat is not None:
            self._flat[o : o + n].zero_()
            return
        for a, b, row, col in self._segments(o, n):
            self.rows[row, col : col + (b - a)].zero_()

    @property
    def input(self) -> torch.Tensor:  # (P * (S + extra),)
        return self.rows.view(-1)
