"""The process groups the engines communicate over, each built once per process: the
(replicate, shard) mesh of hybrid sharding ([Note: hybrid sharding], below) and a second
group per group for fsdp's AllGathers (`gather_group`).

Groups come from `dist.new_subgroups_by_enumeration`, which every rank calls with the
same lists, so every rank must build a mesh at the same point (engine construction).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from trainer.errors import ConfigError

# [Note: hybrid sharding]
# With `mode.shard_group_size=S` (zero and fsdp) the P ranks form R = P/S shard groups of
# S consecutive ranks (one node's GPUs when each node runs S ranks) and S replica groups
# of R ranks each, holding the same slice in every shard group:
#
#     P = 4, S = 2    shard groups   {0, 1} {2, 3}     AllGather, ReduceScatter
#                     replica groups {0, 2} {1, 3}     AllReduce of the reduced slice
#
# Parameters, gradients and optimizer state are sharded over the S ranks of a shard group
# (slice = rank within it) and replicated across the R groups. Each gradient buffer is
# ReduceScattered (averaged) inside the shard group, then its slice is AllReduced
# (averaged) across the replica group: the mean over all P ranks, while only 1/S of the
# gradient crosses between groups, 2(R-1)/R · Ψr/S bytes per rank and step. AllGathers
# never leave the shard group. This is FSDP2's HSDP (a 2-D DeviceMesh of ("replicate",
# "shard")) and torchtitan's dp_replicate x dp_shard. S = P is full sharding (no replica
# group, the default group as before); S = 1 is plain replication, with ddp's result.


@dataclass(frozen=True)
class Mesh:
    """This rank's view of the (replicate, shard) layout of the ranks."""

    shard: dist.ProcessGroup | None  # the S ranks sharding with this one (None: all ranks)
    replicate: dist.ProcessGroup | None  # the R ranks holding this rank's slice (None: R = 1)
    shard_size: int  # S: ranks per shard group
    shard_rank: int  # this rank's position in its shard group: the slice it owns
    replicas: int  # R = P / S


def check_shard_group_size(s: Any, world_size: int) -> None:
    """Hybrid sharding needs whole shard groups: one line naming the valid sizes."""
    if isinstance(s, bool) or not isinstance(s, int) or s < 1 or world_size % s:
        valid = ", ".join(str(d) for d in range(1, world_size + 1) if world_size % d == 0)
        raise ConfigError(
            f"mode.shard_group_size={s!r} must divide the world size {world_size}: use one "
            f"of {valid} (or null for all ranks)"
        )


_meshes: dict[tuple[object, int], Mesh] = {}
_across: set[dist.ProcessGroup] = set()  # replica groups: their traffic crosses shard groups
_second: dict[object, dist.ProcessGroup | None] = {}


def mesh(shard_group_size: int | None) -> Mesh:
    """The mesh for `mode.shard_group_size` (None: all ranks shard). Refuses, in one line,
    a size that does not divide the world size."""
    p, rank = dist.get_world_size(), dist.get_rank()
    s = p if shard_group_size is None else shard_group_size
    check_shard_group_size(s, p)
    key = (dist.group.WORLD, s)
    if key not in _meshes:
        if s == p:
            _meshes[key] = Mesh(None, None, p, rank, 1)
        else:
            shard, _ = dist.new_subgroups_by_enumeration(
                [list(range(g * s, (g + 1) * s)) for g in range(p // s)]
            )
            replicate, _ = dist.new_subgroups_by_enumeration(
                [list(range(j, p, s)) for j in range(s)]
            )
            if p // s > 1:
                _across.add(replicate)
            _meshes[key] = Mesh(shard, replicate if p // s > 1 else None, s, rank % s, p // s)
    return _meshes[key]


def gather_group(group: dist.ProcessGroup | None = None) -> dist.ProcessGroup:
    """A second group over the ranks of `group` (None: all ranks), with the same backend,
    made once per group: its collectives are matched among themselves only, whatever
    order they interleave with `group`'s on each rank (fsdp's AllGathers, [Note: one
    collective order on every rank] in parallel/schedule.py). Every rank must first call
    it at the same point, for every group of a partition (see `mesh`)."""
    key = group if group is not None else dist.group.WORLD
    if key not in _second:
        if group is None:
            _second[key] = dist.new_group(backend=dist.get_backend())
        else:
            # Every shard group gets its twin; new_subgroups_by_enumeration needs all ranks.
            ranks = dist.get_process_group_ranks(group)
            s, p = len(ranks), dist.get_world_size()
            _second[key], _ = dist.new_subgroups_by_enumeration(
                [list(range(g * s, (g + 1) * s)) for g in range(p // s)]
            )
    return _second[key]


def crosses_groups(group: dist.ProcessGroup | None) -> bool:
    """True for a replica group: its traffic goes between shard groups (between nodes,
    when a shard group is one node)."""
    return group is not None and group in _across
