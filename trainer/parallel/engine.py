"""The interface the training loop talks to, whatever the mode.

    engine = build_engine(model, mode="ddp", optimizer=partial(AdamW, lr=1e-3))
    loss = loss_fn(engine(x), y)
    engine.backward(loss)
    engine.step()

Each mode subclasses `Engine` in its own file and decides where gradients live, when
they are communicated and what the optimizer sees.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from trainer import comm

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


class Engine:
    """Wraps a model for one data-parallel mode. Subclasses implement backward and step."""

    name = "base"
    shards_parameters = False  # True: each rank keeps 1/P of the parameters' state

    def __init__(self, module: nn.Module):
        self.module = module
        self.world_size = comm.world_size()
        self.rank = comm.rank()
        # Ranks may have built the model with different seeds: rank 0's values win.
        broadcast_tensors(list(module.parameters()) + list(module.buffers()))
        self._buffers = [b for b in module.buffers()]
        self._sync = True

    # -- forward -------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.module.training:
            # As torch DDP's broadcast_buffers: running statistics follow rank 0.
            self._broadcast_buffers()
        return self.module(*args, **kwargs)

    def _broadcast_buffers(self) -> None:
        if self._buffers and self.world_size > 1:
            broadcast_tensors(self._buffers)

    # -- what every mode implements -----------------------------------------------------
    def backward(self, loss: torch.Tensor) -> None:
        raise NotImplementedError

    def step(self) -> None:
        raise NotImplementedError

    def zero_grad(self) -> None:
        """Drop accumulated gradients without stepping (e.g. a skipped non-finite step)."""
        self.optimizer.zero_grad(set_to_none=True)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded state with the keys of `module.state_dict()`, as CPU copies."""
        return {k: v.detach().cpu().clone() for k, v in self.module.state_dict().items()}

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The tensors this rank holds, by kind, for memory accounting from live storages.

        Keys: "params", "grads", "optimizer", "comm" (buffers kept for communication).
        Modes that keep extra storage (shards, flat buffers) override this.
        """
        params = list(self.module.parameters())
        grads = [p.grad for p in params if p.grad is not None]
        opt = getattr(self, "optimizer", None)
        return {
            "params": params,
            "grads": grads,
            "optimizer": optimizer_state_tensors(opt) if opt is not None else [],
            "comm": [],
        }

    # -- gradient clipping -------------------------------------------------------------
    def grad_tensors(self) -> tuple[list[torch.Tensor], bool]:
        """The gradients this rank holds after backward, and whether they are shards.

        Unsharded (ddp): every rank holds the same full, averaged gradients. Sharded
        (zero, fsdp): each rank holds its 1/P slice of the flat buffers; the padding at
        the end is zero, so it adds nothing to a norm.
        """
        return [p.grad for p in self.module.parameters() if p.grad is not None], False

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale the gradients so that their global L2 norm is at most `max_norm`; return
        the norm before clipping, as `torch.nn.utils.clip_grad_norm_` does on one process.

        Call it after `backward()` and before `step()`, on every rank: in sharded modes
        the squared norms of the shards are summed over ranks (one small AllReduce), so
        every rank computes the same norm and the same scale.
        """
        grads, sharded = self.grad_tensors()
        device = next(self.module.parameters()).device
        norms = [torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads]
        sq = torch.stack(norms).square().sum() if norms else torch.zeros((), device=device)
        if sharded:
            sq = sq.reshape(1)
            comm.all_reduce(sq, tag="grad_norm", account=False).wait()
            sq = sq.reshape(())
        total = sq.sqrt()
        # As torch: the 1e-6 keeps a zero norm finite; a factor above 1 is clamped away.
        scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(scale.to(g.dtype))
        return total

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the first backward outside communicates."""
        prev, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = prev

    def train(self, mode: bool = True) -> Engine:
        self.module.train(mode)
        return self

    def eval(self) -> Engine:
        return self.train(False)


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]


def broadcast_tensors(tensors: list[torch.Tensor], src: int = 0) -> None:
    """Broadcast many tensors with one collective per dtype (packed into a flat buffer)."""
    if comm.world_size() == 1:
        return
    by_dtype: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault((t.dtype, t.device), []).append(t)
    for group in by_dtype.values():
        flat = torch.cat([t.detach().reshape(-1) for t in group])
        comm.broadcast(flat, src, tag="state").wait()
        offset = 0
        with torch.no_grad():
            for t in group:
                n = t.numel()
                t.copy_(flat[offset : offset + n].view_as(t))
                offset += n
