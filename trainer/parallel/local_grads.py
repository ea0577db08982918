"""no_sync's gradients before they are reduced, in the modes that reduce into flat
buffers (zero, fsdp). ddp needs none of it: it adds gradients into its reduce-dtype
buckets directly.

Memory cost of no_sync in zero and fsdp: while inside, every parameter keeps a full-size
gradient (4Ψ bytes in fp32, as in ddp; with bf16 parameters a sum in the fp32 reduce
dtype, as FSDP2 keeps) on top of the sharded state, until the next synced backward
copies each into its buffer and frees it.
"""

from __future__ import annotations

import torch


class LocalGrads:
    """The full gradients this rank holds before they are reduced: autograd's `p.grad`
    and, when the parameters compute in a lower dtype than gradients are reduced in, the
    no_sync micro-batches' sum in the reduce dtype (k bf16 gradients added in bf16 would
    lose bits at every addition; FSDP2 sums in the reduce dtype for the same reason).
    `take` hands a parameter's whole gradient to its buffer and drops the rest. ddp needs
    none of it: it adds gradients into its reduce-dtype buckets directly."""

    def __init__(self) -> None:
        self._in_reduce_dtype: dict[int, torch.Tensor] = {}

    def add(self, p: torch.nn.Parameter, dtype: torch.dtype) -> None:
        """Move `p.grad` into the running sum (nothing to do when it is already `dtype`:
        autograd then accumulates in `p.grad` itself)."""
        if p.grad is None or p.grad.dtype == dtype:
            return
        total = self._in_reduce_dtype.get(id(p))
        if total is None:
            self._in_reduce_dtype[id(p)] = p.grad.to(dtype)
        else:
            total.add_(p.grad)
        p.grad = None

    @torch.no_grad()
    def take(self, p: torch.nn.Parameter) -> torch.Tensor | None:
        """`p`'s whole gradient (the running sum plus `p.grad`), dropping both; None when
        there is none."""
        total = self._in_reduce_dtype.pop(id(p), None)
        grad, p.grad = p.grad, None
        if total is None:
            return grad
        return total if grad is None else total.add_(grad)

    def tensors(self) -> list[torch.Tensor]:
        return list(self._in_reduce_dtype.values())

    def clear(self) -> None:
        self._in_reduce_dtype.clear()
