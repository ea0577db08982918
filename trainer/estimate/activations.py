"""Activation memory of one micro-batch, from one forward and backward run under torch's
FakeTensorMode: shapes and dtypes propagate, nothing is allocated.

[Note: counting activations]
`LiveBytes` (a TorchDispatchMode) adds up the storages that ops create and drops each one
when its storage is freed (a weak reference on the storage, the technique of torch's own
`torch.distributed._tools.mem_tracker`, which is private and whose categories the
recomputation of activation checkpointing confuses; we only need the total). Storages
that exist before the pass (parameters, buffers, the batch) are known from the start and
never counted, so views of them (`w.t()`) cost nothing, as on a device. The figure is
the peak over the whole pass: the tensors autograd saved, plus the gradients of
activations and the temporaries of backward, plus one parameter gradient at a time
(each is dropped by a hook once accumulated, as zero and fsdp do; ddp's are its buckets,
counted as model state). Parameter gradients are thus model state, not activations.

Fake tensors on the CPU device, not the meta device: on meta, attention falls back to
the math kernel, which keeps the (T, T) attention matrix, where the CPU (and a GPU)
runs a fused kernel that keeps only its output and log-sum-exp. The forward is the
engines' (inputs cast to the compute dtype, outputs to fp32, the trainer's loss, an
MoE's load-balancing loss added); an MoE routes as if balanced ([Note: routing in a pass
without values] in parallel/experts.py).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from trainer.models.hooks import model_hooks
from trainer.models.loss import loss_fn
from trainer.parallel.experts import balanced_routing
from trainer.parallel.precision import Precision, cast_module


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages ops created that are still alive, and their peak."""

    def __init__(self, known: list[torch.Tensor]):
        super().__init__()
        self.live = self.peak = 0
        # storage (its StorageImpl address) -> weak reference; None: existed before
        self._storages: dict[int, weakref.ref | None] = {
            t.untyped_storage()._cdata: None for t in known
        }

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._add(t.untyped_storage())
        return out

    def _add(self, storage: torch.UntypedStorage) -> None:
        key = storage._cdata
        if key in self._storages:  # the same storage again: an in-place op or a view
            return
        n = storage.nbytes()
        self._storages[key] = weakref.ref(storage, lambda _, key=key, n=n: self._free(key, n))
        self.live += n
        self.peak = max(self.peak, self.live)

    def _free(self, key: int, n: int) -> None:
        self._storages.pop(key, None)
        self.live -= n


@dataclass(frozen=True)
class Activations:
    peak: int  # bytes: the peak of the forward and backward pass ([Note: counting activations])
    saved: int  # bytes alive when the forward ends: what autograd saved (and the loss)
    predictions: int  # targets in the micro-batch: tokens (language models) or samples
    # ("pre" | "post", module name) of each module's forward, in order (backward's
    # recomputations left out): which units a forward calls again (parallel/calls.py)
    calls: tuple[tuple[str, str], ...] = ()


def measure_passes(
    build: Callable[[], nn.Module],
    sample: tuple[torch.Tensor, ...],
    micro_batches: list[int],
    precision: Precision,
) -> list[Activations]:
    """One forward and backward of each micro-batch size, with samples shaped like
    `sample` (x, y, *extra: what the model takes beside x, e.g. data.doc_mask's document
    segments), through the model `build()` makes, in fake tensors."""
    x0, y0, *extra0 = sample
    with FakeTensorMode(), balanced_routing():
        model = build()
        if precision.mixed:
            cast_module(model, precision.param_dtype)
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(_drop_grad)
        calls: list[tuple[str, str]] = []
        for name, m in model.named_modules():
            m.register_forward_pre_hook(lambda m, a, name=name: calls.append(("pre", name)))
            m.register_forward_hook(lambda m, a, o, name=name: calls.append(("post", name)))
        out = []
        for b in micro_batches:
            x = torch.empty((b, *x0.shape), dtype=x0.dtype)
            y = torch.empty((b, *y0.shape), dtype=y0.dtype)
            extra = [torch.zeros((b, *e.shape), dtype=e.dtype) for e in extra0]
            known = [*model.parameters(), *model.buffers(), x, y, *extra]
            with LiveBytes(known) as live:
                (inputs,) = precision.cast_in((x,))
                del calls[:]
                loss = loss_fn(precision.cast_out(model(inputs, *extra)), y)
                aux = model_hooks(model).extra_loss()  # (), as the loop adds it
                loss = loss if aux is None else loss + aux
                saved, forward = live.live, tuple(calls)
                loss.backward()
                del loss
            out.append(Activations(live.peak, saved, y.numel(), forward))
        return out


def _drop_grad(p: torch.Tensor) -> None:
    p.grad = None
