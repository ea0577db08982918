"""The process groups the engines communicate over, each built once per process: the
(replicate, shard) mesh of hybrid sharding ([Note: hybrid sharding], below), the
expert-parallel and expert-data-parallel groups ([Note: expert parallel groups]) and a
second group per group for fsdp's AllGathers (`gather_group`).

Groups come from `dist.new_subgroups_by_enumeration`, which every rank calls with the
same lists, so every rank must build a mesh at the same point (engine construction).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
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


# Every group made here waits for its peers as long as the default group does
# (dist.timeout_s, set by trainer/run/dist.py's init): torch gives a new group the
# backend's default otherwise (30 minutes on Gloo), however short the run asked for.
_timeout: timedelta | None = None


def set_timeout(timeout: timedelta) -> None:
    global _timeout
    _timeout = timeout


_meshes: dict[tuple[object, int], Mesh] = {}
_across: set[dist.ProcessGroup] = set()  # replica groups: their traffic crosses shard groups
_second: dict[object, dist.ProcessGroup | None] = {}
# the partition of all ranks that each subgroup was built in (its twin is built alike)
_partition: dict[dist.ProcessGroup, list[list[int]]] = {}


def _subgroup(partition: list[list[int]]) -> dist.ProcessGroup:
    """This rank's group of `partition` (every rank calls it with the same lists)."""
    group, _ = dist.new_subgroups_by_enumeration(partition, timeout=_timeout)
    _partition[group] = partition
    return group


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
            shard = _subgroup([list(range(g * s, (g + 1) * s)) for g in range(p // s)])
            replicate = _subgroup([list(range(j, p, s)) for j in range(s)])
            if p // s > 1:
                _across.add(replicate)
            _meshes[key] = Mesh(shard, replicate if p // s > 1 else None, s, rank % s, p // s)
    return _meshes[key]


def gather_group(group: dist.ProcessGroup | None = None, role: str = "gather") -> dist.ProcessGroup:
    """Another group over the ranks of `group` (None: all ranks), with the same backend,
    made once per group and `role`: its collectives are matched among themselves only,
    whatever order they interleave with `group`'s on each rank (fsdp's AllGathers, [Note:
    one collective order on every rank] in parallel/schedule.py; role "again": the
    AllGathers of a unit called again, [Note: a unit called again after another] in
    parallel/calls.py; role "int8": all_reduce_int8's AllGathers on Gloo, [Note: int8
    AllReduce in two chained phases] in quantized.py). Every rank must first call it at
    the same point, for every group of a partition (see `mesh`)."""
    key = (group if group is not None else dist.group.WORLD, role)
    if key not in _second:
        if group is None:
            _second[key] = dist.new_group(backend=dist.get_backend(), timeout=_timeout)
        else:
            # Every group of the partition gets its twin; new_subgroups_by_enumeration
            # needs all ranks.
            partition = _partition[group]
            _second[key], _ = dist.new_subgroups_by_enumeration(partition, timeout=_timeout)
    return _second[key]


def crosses_groups(group: dist.ProcessGroup | None) -> bool:
    """True for a replica group: its traffic goes between shard groups (between nodes,
    when a shard group is one node)."""
    return group is not None and group in _across


# [Note: expert parallel groups]
# With `mode.expert_parallel=E` the P ranks form P/E expert-parallel (EP) groups of E
# consecutive ranks (one node's GPUs, when a node runs E ranks: the AllToAlls of token
# dispatch stay on the fast links) and E expert-data-parallel (EDP) groups of P/E ranks,
# the ranks at the same position in their EP groups:
#
#     P = 4, E = 2    EP groups  {0, 1} {2, 3}    AllToAll of tokens; each rank holds
#                                                 n_experts / E of every MoE layer's experts
#                     EDP groups {0, 2} {1, 3}    hold the same experts: their gradients
#                                                 are reduced here, their state sharded here
#
# Dense parameters are handled over all P ranks as without EP. The layout is
# torchtitan's (an EP mesh inside the data-parallel ranks) and DeepSpeed-MoE's
# "expert data parallel" groups. E = P: one EP group, EDP groups of one rank.


@dataclass(frozen=True)
class ExpertGroups:
    """This rank's view of the expert-parallel layout."""

    ep: dist.ProcessGroup  # the E ranks exchanging tokens with this one
    edp: dist.ProcessGroup  # the P/E ranks holding the same experts as this one
    ep_size: int  # E
    ep_rank: int  # position in the EP group: which slice of the experts this rank holds
    edp_size: int  # P / E
    edp_rank: int  # position in the EDP group
    edp_mesh: Mesh  # the EDP group as the mesh zero and fsdp shard expert parameters over


def check_expert_parallel(e: Any, world_size: int, n_experts: int | None = None) -> None:
    """E must divide the world size and every MoE layer's number of experts (None: not
    known yet): one line naming the valid values."""
    valid = [
        d
        for d in range(1, world_size + 1)
        if world_size % d == 0 and (n_experts is None or n_experts % d == 0)
    ]
    if isinstance(e, bool) or not isinstance(e, int) or e < 1 or e not in valid:
        experts = "" if n_experts is None else f" and the number of experts {n_experts}"
        raise ConfigError(
            f"mode.expert_parallel={e!r} must divide the world size {world_size}{experts}: "
            f"use one of {', '.join(map(str, valid))}"
        )


_expert_groups: dict[int, ExpertGroups] = {}


def expert_groups(e: int) -> ExpertGroups:
    """The EP and EDP groups for `mode.expert_parallel=E` ([Note: expert parallel
    groups]); built once, at the same point on every rank."""
    p, rank = dist.get_world_size(), dist.get_rank()
    if p % e:
        raise ConfigError(f"mode.expert_parallel={e} must divide the world size {p}")
    if e not in _expert_groups:
        ep = _subgroup([list(range(g * e, (g + 1) * e)) for g in range(p // e)])
        edp = _subgroup([list(range(j, p, e)) for j in range(e)])
        edp_mesh = Mesh(edp, None, p // e, rank // e, 1)
        _expert_groups[e] = ExpertGroups(ep, edp, e, rank % e, p // e, rank // e, edp_mesh)
    return _expert_groups[e]


def forget() -> None:
    """Drop every group made here, after the default group is destroyed: the C++ groups
    are then freed at once, in the main thread, not when the interpreter tears down."""
    for cache in (_meshes, _across, _second, _partition, _expert_groups):
        cache.clear()
