"""Collectives the trainer itself does not use, kept for the collectives demo, the
benchmark and MoE-style token dispatch: scatter, all-to-all and uneven all-to-all.

They go through collectives.py's launch path (byte counting, test hooks, comm stream,
`Handle`) exactly as the core collectives do.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from trainer.comm.collectives import Handle, launch, nbytes, on_comm_stream, rank, world_size


def scatter(
    output: torch.Tensor,
    scatter_list: list[torch.Tensor] | None,
    src: int = 0,
    *,
    tag: str = "",
    group=None,
) -> Handle:
    """Rank r receives `scatter_list[r]` from rank `src`."""
    sent = 0
    me = rank(group)
    if scatter_list and me == src:  # every piece but its own
        sent = sum(nbytes(t) for r, t in enumerate(scatter_list) if r != me)
    launch("scatter", tag, sent, group=group)
    return Handle(dist.scatter(output, scatter_list, src, group=group, async_op=True))


def all_to_all(
    output: torch.Tensor,
    input: torch.Tensor,
    output_splits: Sequence[int] | None = None,
    input_splits: Sequence[int] | None = None,
    *,
    tag: str = "",
    group=None,
) -> Handle:
    """Rank r's j-th input piece lands as rank j's r-th output piece (splits along dim 0)."""
    p = world_size(group)
    if input_splits is None:
        sent = (p - 1) / p * nbytes(input)
    else:
        row = nbytes(input) / max(input.shape[0], 1)
        sent = row * (sum(input_splits) - input_splits[rank(group)])
    launch("all_to_all", tag, sent, group=group)
    with on_comm_stream(output, input, group=group) as start:
        work = dist.all_to_all_single(
            output, input, output_splits, input_splits, group=group, async_op=True
        )
    return Handle(work, keep=(output, input), start=start, group=group)


def all_to_all_uneven(
    pieces: Sequence[torch.Tensor], *, tag: str = "", group=None
) -> tuple[list[torch.Tensor], Handle]:
    """Send `pieces[j]` (any number of rows along dim 0, zero included) to rank j, as MoE
    token dispatch does.

    The receiver cannot size its buffer without knowing what is coming, so the split
    sizes go first, in a small all-to-all this call waits for; the payload all-to-all is
    returned in flight. Returns the received pieces in source-rank order (valid once the
    handle is waited) and the handle.
    """
    p = world_size(group)
    if len(pieces) != p:
        raise ValueError(f"all_to_all_uneven: got {len(pieces)} pieces for world size {p}")
    sizes = torch.tensor([t.shape[0] for t in pieces], dtype=torch.int64, device=pieces[0].device)
    incoming = torch.empty_like(sizes)
    all_to_all(incoming, sizes, tag=tag, group=group).wait()  # (P,): rows from each rank
    input_splits, output_splits = sizes.tolist(), incoming.tolist()
    input = torch.cat(list(pieces))  # (sum sent, ...)
    output = input.new_empty((sum(output_splits), *input.shape[1:]))  # (sum received, ...)
    handle = all_to_all(output, input, output_splits, input_splits, tag=tag, group=group)
    return list(output.split(output_splits)), handle
