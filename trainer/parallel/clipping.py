"""Clipping by the global norm, the same in every mode: `engine.clip_grad_norm_(max_norm)`
calls `clip_grad_norm_` here with the gradients the engine holds after backward (full ones
in ddp, this rank's slices in zero and fsdp) and returns what
`torch.nn.utils.clip_grad_norm_` returns on one process.
"""

from __future__ import annotations

import torch

from trainer import comm


@torch.no_grad()
def clip_grad_norm_(
    grads: list[torch.Tensor], max_norm: float, sharded: bool, group, device: torch.device
) -> torch.Tensor:
    """Scale `grads` in place so that their global L2 norm is at most `max_norm`; return
    the norm before clipping. `sharded`: each rank holds slices (padding zero, adding
    nothing to a norm), so the squared norms are summed over `group` (one small
    AllReduce) and every rank computes the same norm and the same scale."""
    norms = [torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads]
    sq = torch.stack(norms).square().sum() if norms else torch.zeros((), device=device)
    if sharded:  # each slice once: summed over one shard group, not its replicas
        sq = sq.reshape(1)
        comm.all_reduce(sq, tag="grad_norm", account=False, group=group).wait()
        sq = sq.reshape(())
    total = sq.sqrt()
    # As torch: the 1e-6 keeps a zero norm finite; a factor above 1 is clamped away.
    scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(scale.to(g.dtype))
    return total
