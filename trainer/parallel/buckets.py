"""Gradient buckets launched in one order on every rank: ddp's AllReduce and zero's
ReduceScatter both go through `BucketQueue`.

[Note: buckets in order]
Parameters are grouped into buckets of about `bucket_mb` in reverse registration order
(flat.bucketize), since backward produces gradients roughly from the last layer back.
A gradient hook tells the queue that a parameter's gradient is ready; once every
parameter of the oldest unlaunched bucket is ready, its collective is launched and the
next bucket is looked at. Buckets are launched strictly in index order, never as they
happen to complete: ranks that finish their buckets in different orders (a parameter
some rank did not use, data-dependent control flow) still issue the same sequence of
collectives, so no two different buckets are ever paired. A bucket that still waits for
a gradient when backward ends (a parameter that got none in this backward) is launched
from the end-of-backward callback, with the buckets after it, in the same order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Generic, Protocol, TypeVar

import torch

from trainer.parallel.used import Arrivals


class Bucket(Protocol):
    params: list[torch.nn.Parameter]


B = TypeVar("B", bound=Bucket)


class BucketQueue(Generic[B]):
    def __init__(
        self,
        buckets: Sequence[B],
        names: dict[int, str],
        launch: Callable[[B], None],
        mode: str,
    ):
        self.buckets = list(buckets)
        self._launch = launch  # starts one bucket's collective
        self._pending = [len(b.params) for b in self.buckets]  # gradients still to come
        self._index = {id(b): i for i, b in enumerate(self.buckets)}
        self._arrived = Arrivals(names, mode)  # gradients of this backward
        self._next = 0  # first bucket not yet launched

    def ready(self, bucket: B, p: torch.nn.Parameter) -> None:
        """`p`'s gradient (in `bucket`) is complete for this backward: launch what can be."""
        self._arrived.add(p)  # refuses a second arrival
        self._pending[self._index[id(bucket)]] -= 1
        self.launch()

    def has_gradient(self, p: torch.nn.Parameter) -> bool:
        return p in self._arrived

    def launch(self, force: bool = False) -> None:
        """Launch buckets in order while they are complete; all the rest when `force`."""
        while self._next < len(self.buckets):
            if self._pending[self._next] and not force:
                return
            self._launch(self.buckets[self._next])
            self._next += 1

    def reset(self) -> None:
        """After backward: every bucket waits for its gradients again."""
        self._pending = [len(b.params) for b in self.buckets]
        self._arrived.clear()
        self._next = 0
