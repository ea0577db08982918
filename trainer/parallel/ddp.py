"""mode=ddp: every rank keeps everything; gradient buckets are AllReduced during backward.

Parameters are grouped into buckets of about `bucket_mb` in reverse registration order.
Each bucket is one flat tensor and every parameter's `.grad` is a view into it, so the
AllReduce works on the gradients in place, with no copies. A post-accumulate-grad hook
counts the parameters that are ready; once a bucket is complete its AllReduce is launched
asynchronously while backward carries on with earlier layers. Buckets are launched
strictly in order (bucket i only after 0..i-1), so every rank issues the same sequence
of collectives even when ranks finish their buckets in a different order. All handles are
waited for in one place, after backward.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from trainer import comm
from trainer.flat import FlatLayout, bucketize
from trainer.parallel.engine import Engine, OptimizerFactory, ShardGroup


class _Bucket:
    def __init__(self, index: int, params: Sequence[nn.Parameter]):
        self.index = index
        self.params = list(params)
        self.layout = FlatLayout.of(self.params)
        p0 = self.params[0]
        self.grad = torch.zeros(self.layout.numel, dtype=p0.dtype, device=p0.device)
        self.views = self.layout.views(self.grad)
        self.pending = len(self.params)
        self.handle: comm.Handle | None = None


class DDPEngine(Engine):
    name = "ddp"

    def __init__(self, module: nn.Module, optimizer: OptimizerFactory, bucket_mb: float = 25.0):
        super().__init__(module)
        params = [p for p in module.parameters() if p.requires_grad]
        self._names = {id(p): n for n, p in module.named_parameters()}
        self.buckets = [
            _Bucket(i, ps) for i, ps in enumerate(bucketize(params, int(bucket_mb * 2**20)))
        ]
        self._ready: set[int] = set()
        self._next = 0  # first bucket not yet launched
        for b in self.buckets:
            for p, view in zip(b.params, b.views, strict=True):
                p.grad = view  # autograd accumulates into the bucket in place
                p.register_post_accumulate_grad_hook(self._hook(b, view))
        self.optimizer = optimizer(params)

    def _hook(self, bucket: _Bucket, view: torch.Tensor):
        def on_grad_ready(p: torch.Tensor) -> None:
            if p.grad is not view:
                # Someone replaced .grad (e.g. set it to None): put it back into the bucket.
                view.copy_(p.grad)
                p.grad = view
            if not self._sync:
                return
            if id(p) in self._ready:
                raise RuntimeError(
                    f"parameter {self._names[id(p)]!r} received its gradient twice in one "
                    "backward; ddp reduces each gradient once per backward"
                )
            self._ready.add(id(p))
            bucket.pending -= 1
            self._launch_ready()

        return on_grad_ready

    def _launch_ready(self, force: bool = False) -> None:
        while self._next < len(self.buckets):
            b = self.buckets[self._next]
            if b.pending and not force:
                return
            b.handle = comm.all_reduce(b.grad, average=True, tag=f"bucket{b.index}")
            self._next += 1

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()
        if not self._sync:
            return
        # Buckets still pending hold parameters that got no gradient this step (their
        # slots are zero, or hold gradients accumulated under no_sync): reduce them too,
        # in order, so that every rank issues the same collectives.
        self._launch_ready(force=True)
        for b in self.buckets:
            b.handle.wait()
            b.handle = None
            b.pending = len(b.params)
        self._ready.clear()
        self._next = 0

    def step(self) -> None:
        self.optimizer.step()
        self.zero_grad()

    def grad_tensors(self) -> tuple[list[torch.Tensor], bool]:
        # The AllReduced buckets: full gradients, identical on every rank, one per bucket.
        return [b.grad for b in self.buckets], False

    def zero_grad(self) -> None:
        for b in self.buckets:
            b.grad.zero_()  # in place: every .grad stays a view into its bucket

    def shard_groups(self) -> list[ShardGroup]:
        # Every rank holds every parameter whole: one unsharded group per parameter.
        params = [p for p in self.module.parameters() if p.requires_grad]
        return [ShardGroup([self._names[id(p)]], FlatLayout.of([p]), p, p, False) for p in params]
