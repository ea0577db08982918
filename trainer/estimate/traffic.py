"""Bytes each rank sends per step, by collective, inside a node and across nodes; and a
step time from a simple model of compute and links: [Note: traffic per rank] beside
`collectives`, [Note: step time model] beside `step_time`.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from trainer.comm import quantized
from trainer.estimate.layout import Plan
from trainer.observe.memory import bus_factor
from trainer.parallel.precision import Precision

# Phases a collective runs in, for the overlap model ([Note: step time model]).
FORWARD, BACKWARD, LAST_BACKWARD = "forward", "backward", "last_backward"
EXPOSED = "exposed"  # waited for before compute goes on: hidden behind nothing


@dataclass(frozen=True)
class Cluster:
    world_size: int
    ranks_per_node: int
    intra_Bps: float  # bytes/s a rank sends to a rank of its own node
    inter_Bps: float  # bytes/s a rank sends to another node
    peak_flops: float  # one device's peak for the compute dtype
    mfu: float  # fraction of the peak the model FLOPs reach
    # mode.offload=disk: bytes/s a rank reads from and writes to its offload file's disk
    disk_read_Bps: float = 2e9
    disk_write_Bps: float = 2e9
    # mode.offload=host: bytes/s between a device and host memory, each way (PCIe 4.0 x16
    # moves about 25 GB/s), and seconds the host's fused AdamW takes per parameter (about
    # 1 ns on one core, measured: scripts/benchmarks/bench_offload.py)
    host_link_Bps: float = 25e9
    host_step_s_per_param: float = 1e-9
    # ft.replica_groups > 1: bytes/s a rank sends to its peers of the other replica
    # groups, one way ([Note: traffic across replica groups] in replica_groups.py)
    across_Bps: float = 0.125e9


@dataclass
class Sent:
    """Bytes one rank sends per step for one collective of one group."""

    op: str
    nbytes: float
    group: list[int]  # the ranks of the group rank 0 is in (the busiest: see `_nodes`)
    phase: str


# [Note: traffic per rank]
# The ring model trainer/comm/ counts with: for a collective over a group of G ranks on
# a buffer of n bytes (the whole buffer: the input of a ReduceScatter, the output of an
# AllGather) each rank sends `memory.bus_factor(op, G)` x n: 2(G-1)/G for AllReduce,
# (G-1)/G for ReduceScatter and AllGather. Every collective the engines issue in a step is
# listed from the same flat buffers they build (layout.py), flags included, so the figure
# equals `comm.stats` after one step, to the byte:
#   ddp   one AllReduce per bucket (the last carries the used-flags), once per step;
#   zero  one ReduceScatter per bucket, once per step; one AllGather per bucket after the
#         optimizer step;
#   fsdp  per micro-batch, an AllGather of every unit before its forward and again before
#         its backward (once with reshard_after_forward=false), the root unit's once, and
#         one more for each later call of a unit called again after other units (`again`
#         of the plan, from the estimate's forward), and in backward one more for each
#         call's backward that finds such a unit freed beyond its first (`again_backward`,
#         the same forward replayed backwards); one ReduceScatter per buffer, once per
#         step.
#   With expert parallelism ([Note: expert parameters in every mode] in
#   parallel/experts.py) the experts' buffers are reduced (and gathered) the same way over
#   the P/E ranks of rank 0's expert-data-parallel group, 0, E, 2E, ...; the AllToAlls
#   of token dispatch depend on the routing and are apart (experts.all_to_all_bytes).
#   Buffers (BatchNorm statistics) are broadcast from rank 0 before every training forward
#   (rank 0's figure: the others send nothing); waited for at once.
# Left out, as comm.stats leaves them out of a step: the small AllReduces of control values
# (fp16's found-inf, the clipping norm, unused-parameter checks) and the reductions of
# metrics at logging steps.
# int8 on the wire ([Note: int8 on the wire] in parallel/precision.py): a ReduceScatter is
# an all-to-all of G packed rows (quantized.row_bytes: int8 values, fp32 scales, exact
# flags), of which a rank sends G-1; an AllReduce (ddp, across replicas) is that on
# chunks of ceil(n/G) values plus an int8 AllGather of one packed chunk; an int8
# AllGather sends this rank's packed slice to each of the G-1 others.
# With hybrid sharding ([Note: hybrid sharding] in comm/groups.py) AllGathers and
# ReduceScatters run over the S ranks of a shard group and each rank's reduced slice (its
# flags too) is then AllReduced across the R = P/S replicas: 2(R-1)/R x Ψr/S, what
# `comm.stats.bytes_across` counts.
#
# Inside a node / across nodes: ranks are numbered node by node (`--ranks-per-node` L).
# A ring over a group spanning N > 1 nodes has N of its G hops between nodes, so N/G of
# the bytes leave their node: per node, one ring's worth of the data, which NCCL spreads
# over the node's NICs (one ring per NIC rail), so each rank's NIC carries N/G of what the
# rank sends. A group inside one node sends nothing across.


def collectives(
    p: Plan, precision: Precision, world: int, micro_batches: int, buffer_bytes: int
) -> list[Sent]:
    """Every collective rank 0 issues in one step ([Note: traffic per rank])."""
    b, r = precision.param_dtype.itemsize, precision.reduce_dtype.itemsize
    block = precision.quant_block
    edp = list(range(0, world, p.expert_parallel))  # rank 0's expert-data-parallel group
    out: list[Sent] = []
    if buffer_bytes and world > 1:
        for _ in range(micro_batches):
            out.append(Sent("broadcast", buffer_bytes, list(range(world)), EXPOSED))
    if p.mode == "ddp":
        everyone = list(range(world))
        for f in p.flat_buffers:
            group = edp if f.expert else everyone
            if precision.reduce_int8:
                out += _all_reduce_int8(f.layout.numel, f.n_flags, group, block)
                continue
            n = (f.layout.numel + f.n_flags) * r
            ar = bus_factor("all_reduce", len(group)) * n
            out.append(Sent("all_reduce", ar, group, LAST_BACKWARD))
        return out
    for f in p.flat_buffers:
        s = p.shard_of(f)
        shard_group = edp if f.expert else list(range(s))
        replicas = [0] if f.expert else list(range(0, world, s))  # holding rank 0's shard
        size = f.layout.shard_size(s)
        rows = s * (size + f.n_flags) * r  # the ReduceScatter's input, flags included
        if precision.reduce_int8:  # one packed row per destination, the flags exact
            sent = (s - 1) * quantized.row_bytes(size, block, f.n_flags)
            out.append(Sent("all_to_all", sent, shard_group, LAST_BACKWARD))
        else:
            rs = bus_factor("reduce_scatter", s) * rows
            out.append(Sent("reduce_scatter", rs, shard_group, LAST_BACKWARD))
        if len(replicas) > 1 and precision.reduce_int8:
            out += _all_reduce_int8(size, f.n_flags, replicas, block)
        elif len(replicas) > 1:  # the reduced slice, flags included
            ar = bus_factor("all_reduce", len(replicas)) * (size + f.n_flags) * r
            out.append(Sent("all_reduce", ar, replicas, LAST_BACKWARD))
        gather = bus_factor("all_gather", s) * f.layout.padded_numel * b
        if precision.gather_int8:  # this rank's packed slice to each of the others
            gather = (s - 1) * quantized.row_bytes(size, block)
        if p.mode == "zero":
            out.append(Sent("all_gather", gather, shard_group, EXPOSED))
            continue
        twice = not f.root and p.options.get("reshard_after_forward", True)
        again = p.again.get(f.unit, 0) if twice else 0
        again_backward = p.again_backward.get(f.unit, 0) if twice else 0
        for _ in range(micro_batches):
            out += [Sent("all_gather", gather, shard_group, FORWARD)] * (1 + again)
            if twice:
                out += [Sent("all_gather", gather, shard_group, BACKWARD)] * (1 + again_backward)
    return out


def _all_reduce_int8(numel: int, flags: int, group: list[int], block: int) -> list[Sent]:
    """comm.all_reduce_int8 of `numel` values and `flags` exact ones over `group`: an
    all-to-all of one packed chunk per rank, then an int8 AllGather of the owner's sum."""
    g = len(group)
    if g == 1:
        return []
    chunk = quantized.chunk_of(numel, g)
    return [
        Sent(
            "all_to_all", (g - 1) * quantized.row_bytes(chunk, block, flags), group, LAST_BACKWARD
        ),
        Sent("all_gather", (g - 1) * quantized.row_bytes(chunk, block), group, LAST_BACKWARD),
    ]


def _across(c: Sent, ranks_per_node: int) -> float:
    """The bytes of `c` that leave the node ([Note: traffic per rank]); an AllToAll
    sends an equal share to each other rank of its group: those off the node cross."""
    nodes = len({g // ranks_per_node for g in c.group})
    if nodes == 1:
        return 0.0
    if c.op == "all_to_all":
        near = sum(1 for g in c.group if g // ranks_per_node == c.group[0] // ranks_per_node)
        return c.nbytes * (len(c.group) - near) / (len(c.group) - 1)
    return c.nbytes * nodes / len(c.group)


def split(sent: list[Sent], ranks_per_node: int) -> dict[str, dict[str, float]]:
    """Bytes per step by collective: {op: {"inside_node": ..., "across_nodes": ...}}."""
    out: dict[str, dict[str, float]] = {}
    for c in sent:
        across = _across(c, ranks_per_node)
        op = out.setdefault(c.op, {"inside_node": 0.0, "across_nodes": 0.0})
        op["inside_node"] += c.nbytes - across
        op["across_nodes"] += across
    return out


def seconds(c: Sent, cluster: Cluster) -> float:
    """[Note: step time model]: the slower of the two links."""
    across = _across(c, cluster.ranks_per_node)
    return max((c.nbytes - across) / cluster.intra_Bps, across / cluster.inter_Bps)


# [Note: step time model]
# compute: 6Ψ FLOPs per prediction (2Ψ forward, 4Ψ backward; a prediction is a token of a
# language model, a sample of a classifier: for a CNN, whose weights are applied at every
# pixel, this undercounts, and the time is a lower bound), at `mfu` x `peak` FLOP/s;
# activation checkpointing adds a second forward (2Ψ) to every backward. For an MoE Ψ is
# the parameters a token's forward multiplies by (experts.active_params): the dense ones
# and top_k / n_experts of the experts. As in the usual 6Ψ, attention's own FLOPs (QKᵀ
# and AV: 12·T·C per token and layer) are left out and the embedding tables are counted,
# though a lookup costs none (tests/test_estimate.py counts both against torch's).
# With expert parallelism the AllToAlls of token dispatch are exposed: each is waited for
# before the experts run.
# communication: a collective takes the longer of its bytes inside the node over the
# intra-node bandwidth and its bytes across nodes over the inter-node bandwidth (both are
# per rank: NVLink, the rank's own NIC); collectives of a phase add up.
# overlap: communication launched during a pass hides behind that pass's compute, only the
# excess shows: ddp's AllReduce and zero's ReduceScatter behind the last micro-batch's
# backward; zero's AllGather after the optimizer step is not hidden (the next forward
# waits for it); fsdp's forward AllGathers behind each forward, its backward AllGathers
# (and, on the last micro-batch, its ReduceScatters) behind each backward; the cross-group
# AllReduce of hybrid sharding behind the last backward. The optimizer step, the time
# before the first collective can start and kernel launch gaps are not modelled.


def step_time(
    p: Plan,
    sent: list[Sent],
    cluster: Cluster,
    predictions: int,
    micro_batches: int,
    checkpointing: bool,
    flop_params: int | None = None,
) -> dict[str, float]:
    """Seconds per step ([Note: step time model]); `predictions` per micro-batch,
    `flop_params` the parameters a prediction's forward multiplies by (default Ψ)."""
    rate = cluster.mfu * cluster.peak_flops
    psi = p.psi if flop_params is None else flop_params
    fwd = 2 * psi * predictions / rate
    bwd = (4 + (2 if checkpointing else 0)) * psi * predictions / rate
    comm = defaultdict(float)
    for c in sent:
        comm[c.phase] += seconds(c, cluster)
    k = micro_batches
    per_fwd, per_bwd = comm[FORWARD] / k, comm[BACKWARD] / k
    step = (
        k * max(fwd, per_fwd)
        + (k - 1) * max(bwd, per_bwd)
        + max(bwd, per_bwd + comm[LAST_BACKWARD])
        + comm[EXPOSED]
    )
    compute = k * (fwd + bwd)
    return {"step_s": step, "compute_s": compute, "comm_s": sum(comm.values())}
