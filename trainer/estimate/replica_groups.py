"""What crosses between replica groups (`ft.enabled`, `ft.replica_groups` N > 1): the bytes
a rank sends to its peers of the other groups, every step (`ft.semi_sync=null`) or at the
fragment syncs of DiLoCo and local SGD, and the time a step waits for them on the link
between groups: [Note: traffic across replica groups].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import DictConfig

from trainer.comm import quantized
from trainer.comm.diloco import BLOCK, fragments_for
from trainer.errors import ConfigError
from trainer.estimate.layout import Plan
from trainer.observe.memory import bus_factor
from trainer.parallel import pieces

# [Note: traffic across replica groups]
# Rank r of each group talks to rank r of the others only, so each rank has a link of its
# own to the other groups (`--across-gbps`, one way), and the bytes are counted as the
# run counts them (comm.stats' "ft_across_replica_groups", the figure final_metrics.json
# and TensorBoard show as comm/bytes_per_step/ft_across_replica_groups):
#   every step (comm/replicas.py `reduce`): an AllReduce over the N groups of an fp32 copy
#     of what `engine.grad_tensors()` holds: ddp the whole gradient, zero and fsdp the
#     rank's slice of each flat buffer, padding included (every parameter given a
#     gradient: ddp leaves out one no sample used): 2(N-1)/N x 4 bytes a value. The
#     float64 AllReduce of the loss and the used-flags beside it is not counted (a few
#     bytes). Waited for at once: the optimizer steps on its result.
#   ft.semi_sync (comm/diloco.py `_send`): every H/F steps one fragment (the model's
#     units dealt strided, `fragments_of`) sends the pseudo-gradient of what the inner
#     optimizer steps of it on this rank (zero, fsdp: the pieces of the rank's slices, no
#     padding), each split over the R ranks that hold it alike ([Note: a group's ranks
#     split what they all hold]: ddp's n values of a fragment over its P ranks, a hybrid
#     rank's over its replica group of P / S; experts whole). fp32 wire: an
#     AllReduce of those values and one float64 weight, 2(N-1)/N x (4 n + 8); bf16 wire:
#     an AllGather of one row of 2 n + 4 bytes per group; int8 wire: one packed row
#     (`quantized.row_bytes`, blocks of diloco.BLOCK, the weight exact); a rank sends its
#     row to the N - 1 others.
#     Averaged over a sync period (H steps: each fragment once) and at most per sync.
#     The run's last step syncs again every fragment not synced at that step
#     (`run_syncs`): a short run's average differs from the period's.
# Ranks of zero and fsdp hold different parts of each fragment: the figures are those of
# the rank that sends the most in a period (the lowest of a tie, rank 0 as a rule).
# Time: a sync takes its bytes over the link (latency and the quorum's RPCs left out).
# Every step: all of it exposed. A fragment sync with ft.fragment_sync_delay tau >= 1 is
# waited for tau inner steps after it is sent: it hides behind them up to tau x the step
# time, only the excess shows; with tau = 0 it is waited for at once. Spread over the
# period: seconds per step. Heals, retries of failed syncs and quorums are not counted.


@dataclass(frozen=True)
class Schedule:
    """When and how the groups sync, from the config's `ft`."""

    groups: int  # N
    semi_sync: str | None  # None: every step; "diloco" or "local_sgd"
    every: int  # steps between two syncs: 1, or H / F
    fragments: int  # F (1 for the per-step sync)
    delay: int  # tau: inner steps a fragment sync overlaps before it is applied
    wire: str  # the pseudo-gradient's dtype on the wire: fp32, bf16, int8


def groups_of(cfg: DictConfig) -> int:
    """N: the replica groups the global batch is cut over (1 without ft)."""
    ft = cfg.get("ft")
    return int(ft.replica_groups) if ft and ft.enabled else 1


def schedule_of(cfg: DictConfig) -> Schedule | None:
    """The sync across replica groups `cfg` runs; None with one group (nothing crosses)."""
    n = groups_of(cfg)
    if n == 1:
        return None
    ft = cfg.ft
    if ft.semi_sync is None:
        return Schedule(n, None, 1, 1, 0, "fp32")
    f = int(ft.fragments)
    return Schedule(
        n, str(ft.semi_sync), int(ft.sync_steps) // f, f, int(ft.fragment_sync_delay),
        str(ft.pseudo_grad_dtype),
    )  # fmt: skip


def outer_bytes_per_value(cfg: DictConfig) -> int:
    """Bytes the outer state of `ft.semi_sync` adds to each value of the optimizer's
    state ([Note: outer state in the optimizer's state] in comm/diloco.py): the global
    copy, the outer momentum (diloco with an outer momentum above 0), the error
    feedback of a lossy wire and, with a delay, the pseudo-gradient in flight ([Note: a
    checkpoint with a sync in flight]), fp32 each. Also with one group: the run keeps
    them."""
    ft = cfg.get("ft")
    if not ft or not ft.enabled or ft.get("semi_sync") is None:
        return 0
    momentum = ft.semi_sync == "diloco" and float(ft.outer_momentum) > 0
    lossy = str(ft.pseudo_grad_dtype) != "fp32"
    delayed = int(ft.fragment_sync_delay) > 0
    return 4 * (1 + int(momentum) + int(lossy) + int(delayed))


def fragments(cfg: DictConfig, model: torch.nn.Module | None, p: Plan) -> dict[str, int] | None:
    """Parameter name -> fragment, as the run cuts them (diloco.fragments_for); None for
    the per-step sync. A bare parameter count has no units: one fragment only."""
    s = schedule_of(cfg)
    if s is None or s.semi_sync is None:
        return None
    if model is not None:
        return fragments_for(cfg, model)
    if s.fragments > 1:
        raise ConfigError(
            f"ft.fragments={s.fragments}: a bare --params count has no units to cut into "
            "fragments; estimate the model itself, or use ft.fragments=1"
        )
    return {n: 0 for f in p.flat_buffers for n in f.names}


def values_per_sync(
    p: Plan, s: Schedule, fragment_of: dict[str, int] | None, rank: int, ranks: int = 1
) -> list[int]:
    """The values `rank` of a group of `ranks` sends at each sync ([Note: traffic across
    replica groups]): [what grad_tensors() holds] every step, else one count per fragment
    (0 where a fragment holds nothing on `rank`: its sync sends the weight alone)."""
    if s.semi_sync is None:
        return [
            sum(
                f.layout.shard_size(p.shard_of(f)) if p.sharded else f.layout.numel
                for f in p.flat_buffers
            )
        ]
    out = [0] * s.fragments
    # the dense values R ranks hold alike, split over them (diloco.py's _Share): ddp's
    # whole model over the P ranks, a hybrid slice over its replica group of P / S
    alike = [0] * s.fragments
    holders, place = (ranks, rank) if not p.sharded else (ranks // p.shard, rank // p.shard)
    for f in p.flat_buffers:
        into = out if f.expert else alike
        if not p.sharded:  # one optimizer tensor per parameter, whole
            for name, shape in zip(f.names, f.layout.shapes, strict=True):
                into[fragment_of[name]] += shape.numel()
            continue
        shard = torch.empty(f.layout.shard_size(p.shard_of(f)), device="meta")
        cut = pieces.cut(f.names, range(len(f.names)), f.layout, shard, p.group_rank(f, rank))
        for c in cut:
            into[fragment_of[c.name]] += c.end - c.start
    for i, n in enumerate(alike):  # the place-th ceil(n / R) slice
        chunk = -(-n // max(holders, 1))
        out[i] += min(n, (place + 1) * chunk) - min(n, place * chunk)
    return out


def sync_bytes(values: int, s: Schedule) -> float:
    """Bytes a rank sends across groups for one sync of `values` values, as counted."""
    n = s.groups
    if s.semi_sync is None:
        return bus_factor("all_reduce", n) * values * 4
    if s.wire == "fp32":  # the values and one float64 weight
        return bus_factor("all_reduce", n) * (values * 4 + 8)
    if s.wire == "bf16":  # one row per group: bf16 values and the fp32 weight
        return (n - 1) * (2 * values + 4)
    return (n - 1) * quantized.row_bytes(values, BLOCK, tail=1)


def run_syncs(steps: int, s: Schedule) -> list[int]:
    """The fragments synced over a run of `steps` steps, in order ([Note: the fragment
    schedule] in comm/diloco.py): sync k of fragment (k - 1) mod F sent after step
    k H/F - tau; at the last step, every fragment whose sync was not applied then."""
    if s.semi_sync is None:
        return [0] * steps
    out, applied_last = [], set()
    for step in range(1, steps + 1):
        k, rest = divmod(step + s.delay, s.every)
        if rest == 0 and k >= 1:
            out.append((k - 1) % s.fragments)
            if step + s.delay >= steps:  # in flight at the last step: applied there
                applied_last.add(out[-1])
    return out + [f for f in range(s.fragments) if f not in applied_last]


def figures(
    p: Plan,
    s: Schedule,
    fragment_of: dict[str, int] | None,
    steps: int,
    link_Bps: float,
    world: int = 1,
) -> dict[str, Any]:
    """The busiest rank's bytes across groups and the link's seconds per sync ([Note:
    traffic across replica groups]), for groups of `world` ranks; `steps`: the run's,
    for its own average."""
    # ranks alike every step; fragment syncs differ by shard and by slice ([Note: a
    # group's ranks split what they all hold])
    ranks = range(max(world, p.shard)) if s.semi_sync is not None else [0]
    busiest: tuple[int, list[float]] | None = None
    for r in ranks:
        values = values_per_sync(p, s, fragment_of, r, world)
        sizes = [sync_bytes(v, s) for v in values]
        if busiest is None or sum(sizes) > sum(busiest[1]):
            busiest = (r, sizes)
    rank, sizes = busiest
    return {
        "replica_groups": s.groups,
        "sync": s.semi_sync or "every_step",
        "wire": s.wire,
        "sync_every_steps": s.every,
        "fragments": s.fragments,
        "fragment_sync_delay": s.delay,
        "rank": rank,
        "bytes_per_sync": sizes,  # by fragment
        "bytes_per_step": sum(sizes) / (s.every * len(sizes)),  # over a sync period
        "peak_bytes_per_sync": max(sizes),
        # over the configured run, its last step's syncs included: what the run's counter
        # averages to when one logging interval spans the run
        "bytes_per_step_over_run": sum(sizes[f] for f in run_syncs(steps, s)) / steps,
        "link_Bps": link_Bps,
        "link_s_per_sync": max(sizes) / link_Bps,
        "exposed_s_per_step": exposed_s_per_step(sizes, s, link_Bps, None),
    }


def exposed_s_per_step(
    sizes: list[float], s: Schedule, link_Bps: float, step_s: float | None
) -> float | None:
    """Seconds per step a step waits on the link, for the bytes of each sync of a period
    and the inner step's time (None: unknown, for a sync hidden behind steps)."""
    waits = [b / link_Bps for b in sizes]
    if s.delay == 0:  # waited for at once (every step: the optimizer needs it)
        return sum(waits) / (s.every * len(waits))
    if step_s is None:
        return None
    hidden = s.delay * step_s  # behind tau inner steps
    return sum(max(0.0, w - hidden) for w in waits) / (s.every * len(waits))
