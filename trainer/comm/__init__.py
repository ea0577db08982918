"""Communication: every collective the trainer launches, and the groups it launches them in.

    from trainer import comm
    comm.reduce_scatter(out, flat, average=True, group=mesh.shard).wait()

- collectives.py: the collectives, their `Handle`, byte and time accounting (`comm.stats`),
  the CUDA comm streams and the test hooks (`tracing()`, `delayed()`, `p2p()`). Start here.
- sendrecv.py: reduce-scatter and all-gather from point-to-point sends, the Gloo fast path.
- groups.py: shard and replica groups for hybrid sharding ([Note: hybrid sharding]),
  expert-parallel and expert-data-parallel groups ([Note: expert parallel groups]).
- all_to_all.py: scatter and the all-to-alls; expert parallelism's token dispatch uses
  the uneven `all_to_all` (re-exported here).
- quantized.py: AllGather, ReduceScatter and AllReduce that send int8 blocks with fp32
  scales ([Note: int8 blocks]), on top of the collectives above.

This package re-exports collectives.py's public names, so `comm.all_gather` is the
function the engines call.
"""

from trainer.comm import groups
from trainer.comm.all_to_all import all_to_all
from trainer.comm.collectives import (
    AveragePlan,
    CommStats,
    Handle,
    all_gather,
    all_gather_object,
    all_reduce,
    average_plan,
    barrier,
    broadcast,
    broadcast_object,
    chain,
    delayed,
    free_storage,
    gather,
    membership,
    p2p,
    p2p_enabled,
    rank,
    record,
    reduce,
    reduce_scatter,
    simulated_link,
    stats,
    tracing,
    unaccounted,
    wait_all,
    world_size,
)
from trainer.comm.quantized import all_gather_int8, all_reduce_int8, reduce_scatter_int8

__all__ = [
    "AveragePlan",
    "CommStats",
    "Handle",
    "all_gather",
    "all_gather_int8",
    "all_gather_object",
    "all_reduce",
    "all_reduce_int8",
    "all_to_all",
    "average_plan",
    "barrier",
    "broadcast",
    "broadcast_object",
    "chain",
    "delayed",
    "free_storage",
    "gather",
    "groups",
    "membership",
    "p2p",
    "p2p_enabled",
    "rank",
    "record",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_int8",
    "simulated_link",
    "stats",
    "tracing",
    "unaccounted",
    "wait_all",
    "world_size",
]
