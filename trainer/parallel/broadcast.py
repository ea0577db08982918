"""Tensors every rank keeps whole (the model at build time, buffers before a training
forward), sent from rank 0 in packs: many small tensors in one collective, without a
second copy of the whole model.
"""

from __future__ import annotations

import torch

from trainer import comm

# What one packed broadcast copies at most: many small tensors go in one collective, while
# a whole model packed at once would hold a second copy of it while it starts.
BROADCAST_PACK_BYTES = 64 * 2**20


def broadcast_tensors(tensors: list[torch.Tensor], src: int = 0) -> None:
    """Broadcast many tensors, packed into flat buffers of at most BROADCAST_PACK_BYTES per
    dtype (one collective each); a tensor larger than that is sent in place, alone."""
    if comm.world_size() == 1:
        return
    by_dtype: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault((t.dtype, t.device), []).append(t)
    for group in by_dtype.values():
        packs: list[list[torch.Tensor]] = [[]]
        size = 0
        for t in group:
            nbytes = t.numel() * t.element_size()
            if packs[-1] and size + nbytes > BROADCAST_PACK_BYTES:
                packs.append([])
                size = 0
            packs[-1].append(t)
            size += nbytes
        for pack in packs:
            _broadcast_pack(pack, src)


@torch.no_grad()
def _broadcast_pack(pack: list[torch.Tensor], src: int) -> None:
    if len(pack) == 1 and pack[0].is_contiguous():  # no copy needed
        comm.broadcast(pack[0].detach(), src, tag="state").wait()
        return
    flat = torch.cat([t.detach().reshape(-1) for t in pack])
    comm.broadcast(flat, src, tag="state").wait()
    offset = 0
    for t in pack:
        n = t.numel()
        t.copy_(flat[offset : offset + n].view_as(t))
        offset += n
    comm.free_storage(flat)
