"""What the optimizer steps: its param groups (every mode), and in zero and fsdp one piece
per parameter of each flat shard; a shard group whole again (`whole_values`).

[Note: per-parameter optimizer tensors]
zero and fsdp keep this rank's part of the model as slice r of flat buffers (a bucket, a
unit). The optimizer does not step that slice as one tensor: it steps one view of it per
parameter that reaches into it (`Piece`), as FSDP2's per-parameter sharding and FSDP's
`use_orig_params` do. That costs a few more tensors in the optimizer's foreach loop and
buys torch's per-parameter semantics exactly:
- a parameter that no rank used in a step ([Note: used flags] in used.py) gets
  `.grad = None` on every piece of it: its values and optimizer state stay as they are,
  where a flat shard with a zero gradient would decay it and move it by stale moments;
- AdamW keeps one step count per parameter, so its bias correction stays right for a
  parameter that skipped steps;
- padding belongs to no piece: the optimizer never touches it.
The pieces are views into the shard, so the optimizer updates the shard in place; their
gradients are views into the shard's reduced gradient, handed out after each backward.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from trainer import comm
from trainer.comm.groups import Mesh
from trainer.parallel.flat import FlatLayout


@dataclass
class Piece:
    name: str  # the parameter's name
    flag: int  # the parameter's used-flag position
    start: int  # [start, end) within this rank's shard
    end: int
    tensor: nn.Parameter  # view of the shard: the optimizer's tensor


@dataclass
class ShardGroup:
    """One flat buffer of trainable parameters as a checkpoint sees it (state.py)."""

    names: list[str]  # parameter names (module.named_parameters()) in flat order
    layout: FlatLayout  # shapes and offsets in the flat buffer, padded size
    local: torch.Tensor  # this rank's values: the whole buffer, or its slice [r*S, (r+1)*S)
    pieces: list[Piece]  # what the optimizer steps of it, with their ranges in `local`
    sharded: bool  # True: rank r holds slice r; False: every rank holds all of it
    # the group sharding it: None for the mode's shard group (all ranks unless hybrid);
    # expert parameters' is the expert-data-parallel group (parallel/experts.py)
    group: Any = None


def cut(
    names: Sequence[str], flags: Sequence[int], layout: FlatLayout, shard: torch.Tensor, rank: int
) -> list[Piece]:
    """The pieces of slice `rank` of a flat buffer with `layout`, over `shard` (S,)."""
    s = shard.numel()
    lo, hi = rank * s, (rank + 1) * s
    pieces = []
    for name, flag, o, shape in zip(names, flags, layout.offsets, layout.shapes, strict=True):
        a, b = max(o, lo), min(o + shape.numel(), hi)
        if a < b:
            view = shard.detach()[a - lo : b - lo]
            pieces.append(Piece(name, flag, a - lo, b - lo, nn.Parameter(view)))
    return pieces


def optimizer_tensors(pieces: Sequence[Piece], like: torch.Tensor) -> list[torch.Tensor]:
    """The pieces' tensors, or one empty placeholder when this rank's slice holds padding
    only: every rank then has the same param groups, in the same order."""
    if pieces:
        return [p.tensor for p in pieces]
    return [nn.Parameter(like.new_empty(0))]


def hand_out(pieces: Iterable[Piece], grad: torch.Tensor | None, unused: set[int]) -> None:
    """Each piece's `.grad`: its view of the shard's gradient (S,), None for parameters
    that no rank used since the last step."""
    for p in pieces:
        p.tensor.grad = None if grad is None or p.flag in unused else grad[p.start : p.end]


def split_by_options(
    named: Iterable[tuple[str, nn.Parameter]],
    options: Callable[[str, nn.Parameter], dict[str, Any]] | None,
) -> list[tuple[dict[str, Any], list[tuple[str, nn.Parameter]]]]:
    """Parameters grouped by the optimizer options `options` gives each, groups in order
    of first appearance; one group with {} when `options` is None. zero and fsdp lay each
    group out in flat buffers of its own, so that a shard never mixes two groups."""
    groups: dict[tuple, tuple[dict[str, Any], list]] = {}
    for name, p in named:
        opts = options(name, p) if options else {}
        groups.setdefault(tuple(sorted(opts.items())), (opts, []))[1].append((name, p))
    return list(groups.values())


def param_groups(pairs: Iterable[tuple[dict[str, Any], torch.Tensor]]) -> list[dict[str, Any]]:
    """torch.optim param groups from (options, tensor) pairs, one group per distinct
    options. Groups are ordered by their options (the defaults first), not by where the
    modes happen to meet them, so a checkpoint's groups line up in every mode."""
    groups: dict[tuple, dict[str, Any]] = {}
    for opts, t in pairs:
        key = tuple(sorted(opts.items()))
        groups.setdefault(key, {**opts, "params": []})["params"].append(t)
    return [groups[k] for k in sorted(groups, key=lambda k: (len(k), repr(k)))]


# [Note: gathering to rank 0]
# `full_state_dict(rank0_only=True)` (the name of FSDP's FullStateDictConfig option), which
# writes the run's final model, gathers each sharded group, a zero bucket or an fsdp unit,
# to rank 0 alone: a Gather within the first shard group, whose ranks hold one whole copy
# ([Note: hybrid sharding] in comm/groups.py); rank 0 copies its tensors out before the
# next group comes. The other ranks send the slices they already hold and allocate
# nothing, where an AllGather would leave each with a whole copy: rank 0 holds what it
# writes plus one group. Buffers and frozen parameters are copied by rank 0 alone; ddp's
# rank 0 copies its own parameters and the others do nothing.
@torch.no_grad()
def whole_values(
    groups: Sequence[ShardGroup],
    mesh: Mesh,
    rank0_only: bool = False,
    in_memory: Callable[[int], AbstractContextManager] = lambda i: nullcontext(),
    device: torch.device | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter of `groups` whole, as CPU copies by name, one group at a time: a
    sharded group's slices gathered over the shard group in rank order (a collective:
    every rank takes every item). `rank0_only`: to rank 0 alone, the other ranks get
    nothing ([Note: gathering to rank 0]). `in_memory(i)`: a context inside which group
    i's `local` is in memory (offloaded masters are read back for it). `device`: where
    the collectives run, if `local` is elsewhere (host offload's masters on the host:
    one group at a time is copied there)."""
    for i, g in enumerate(groups):
        with in_memory(i):
            yield from _whole_group(g, mesh, rank0_only, device)


def _whole_group(
    g: ShardGroup, mesh: Mesh, rank0_only: bool, device: torch.device | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    rank = comm.rank()
    # An expert group (its own `group`, parallel/experts.py) is gathered over it on
    # every rank: its values then go on to an AllGather over the EP group.
    expert = g.group is not None
    keeps = rank == 0 or not rank0_only or expert
    if g.sharded and rank0_only and rank >= mesh.shard_size and not expert:
        return  # a replica: the first shard group holds the same slices
    flat, full, slices = g.local.detach().reshape(-1), None, None
    if g.sharded and device is not None and flat.device != device:
        flat = flat.to(device)  # the collectives' device (NCCL's is the GPU)
    if g.sharded:  # the shard group's slices of the fp32 masters, in rank order
        full = flat.new_empty(g.layout.padded_numel) if keeps else None
        if rank0_only and not expert:
            slices = list(full.chunk(mesh.shard_size)) if keeps else None
            comm.gather(flat, slices, dst=0, tag="state", group=mesh.shard).wait()
        else:
            group = g.group if expert else mesh.shard
            comm.all_gather(full, flat, tag="state", group=group).wait()
        flat = full
    if keeps:
        yield from _copies(g.names, g.layout.views(flat))
    if full is not None:
        # now, not when Gloo's worker thread lets go of it: the next group's buffer
        # would sit beside this one
        comm.free_storage(full)


def _copies(names: list[str], views: list[torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    # A function of its own: no view of the gathered group outlives it.
    for name, view in zip(names, views, strict=True):
        yield name, view.to("cpu", copy=True)  # one copy, from CUDA too
