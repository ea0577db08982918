"""fsdp's order of collectives, the same on every rank, whatever units each rank runs:
[Note: one collective order on every rank], beside `Schedule`; the order of the units it
follows: [Note: the order of the calls], beside `agreed_order`.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Collection, Sequence
from typing import Any

from trainer import comm
from trainer.observe import host

# [Note: one collective order on every rank]
# Ranks may run different units (control flow that depends on the rank or its data: a
# layer some ranks skip, an output some ranks leave out of the loss). Gathering and
# reducing units as they happen to run would give the ranks different sequences of
# collectives, which pair up wrongly (equal-size units silently, others with a crash or a
# hang). So every collective follows one schedule that all ranks share, the units in one
# order: registration order until the first forward from the root ends, the order of its
# calls from then on ([Note: the order of the calls]):
#   forward   every scheduled unit is gathered once, in order: a unit about to run first
#             gathers the units before it not yet gathered (ones this rank skips, freed
#             when the forward ends), then itself, then prefetches the next; the root
#             gathers the rest when the forward ends.
#   backward  one sequence of events, in reverse order, that a rank running every unit
#             produces: AllGather(n-1), then for k = n-1 .. 0: AllGather(k-1),
#             ReduceScatter(k). A rank issues an event only in that order, and a
#             ReduceScatter only once the unit's gradients are done; a unit this rank
#             gives no gradient is done from the start of backward (the engine knows which
#             from the forward's autograd graph) and is reduced as zeros at its turn.
#             Units gathered again in a forward (weight sharing) are left out of this
#             order: each call's backward gathers them on a group of their own, and they
#             are reduced after the others, before the root ([Note: a unit called again
#             after another] in calls.py).
# Waiting is then safe: every rank waits only for collectives it issued itself, and all
# ranks issue the same collectives in the same order, so the oldest collective that any
# rank waits for has been issued by every rank. In particular fsdp's bounded number of
# ReduceScatters in flight (the wait for the oldest one, to free its input) can never wait
# for a ReduceScatter that another rank would issue only after an AllGather this rank has
# not issued yet: the order puts that ReduceScatter first on every rank.
# That holds while every rank's backward meets its units in the order's reverse, skipping
# some. Otherwise, with reshard_after_forward=true and ranks that differ (calls that
# conflict between ranks; calls in another order than the schedule's, some ranks
# skipping a unit), a rank may wait for a ReduceScatter that a peer can issue only late
# in its backward, while the peer waits for an AllGather that the first holds back (a
# prefetch not yet allowed) until its wait ends. Two ranks, six units, one calling them
# first to last and the other last to first, hang so until the collective timeout.
# A prefetch that the order does not allow yet is simply issued later. A unit whose
# parameters are needed before its turn (`need`: an activation-checkpointed region
# recomputing several units at once) is gathered at once; the same model does the same on
# every rank, so the order stays common.
# What it costs: a forward that calls units in another order than the schedule's gathers
# some units earlier than needed (the first forward, when the calls differ from
# registration order; later ones, when they differ from the first); a unit that no rank
# runs is still gathered.
#
# [Note: the order of the calls]
# A unit registered after others but called before them (a weight-shared block assigned
# after the blocks it runs between: `self.others = ...; self.shared = ...`, then
# `for o in self.others: x = o(self.shared(x))`) would, in registration order, make its
# first call gather every unit before it at once, each kept until it runs: the forward
# then holds the whole model. So when the first forward from the root ends, the schedule
# takes the order of the calls, as FSDP2's backward prefetch follows the forward's: the
# ranks exchange the units each called, at its first call (one all_gather_object over
# all ranks, hybrid sharding too: the replicas' AllReduces follow the order), and every
# rank takes the one order that all those calls follow (ties in registration order); a
# unit that no rank called goes right after the first of its registration neighbours
# there, where a layer skipped in that forward would run.
# When the ranks' calls conflict (one calls a before b, another b before a), no order
# fits them all and registration order stays. Once per engine; steps after the first
# cost nothing. Later forwards that call units in another order still pair up: they
# only gather some units early. The first forward itself cannot follow calls not yet
# made: with such a unit it holds what registration order gathers.


def agreed_order(units: Sequence[Any], called: Sequence[int]) -> list[Any]:
    """`units` in the order that every rank's calls follow (`called`: units by id, at
    their first call in a forward, this rank's), or as they are when the ranks' calls
    conflict: [Note: the order of the calls]. A collective over all ranks; each must
    call it at the same point."""
    index = {id(u): i for i, u in enumerate(units)}
    mine = [index[k] for k in called if k in index]
    everyone = comm.all_gather_object(mine) if comm.world_size() > 1 else [mine]
    host.count_read("fsdp unit order")  # on a GPU, the objects travel through the device
    later: list[set[int]] = [set() for _ in units]  # units called right after each
    before = [0] * len(units)  # how many units must come before each
    for calls in everyone:
        for a, b in itertools.pairwise(calls):
            if b not in later[a]:
                later[a].add(b)
                before[b] += 1
    reached = {i for calls in everyone for i in calls}
    ready = sorted(i for i in reached if before[i] == 0)  # a heap: the lowest index first
    order: list[int] = []
    while ready:
        i = heapq.heappop(ready)
        order.append(i)
        for j in later[i]:
            before[j] -= 1
            if before[j] == 0:
                heapq.heappush(ready, j)
    if len(order) < len(reached):  # a cycle: one rank calls a before b, another b before a
        return list(units)
    for i in range(len(units)):  # no rank called it: where a skipped layer would run
        if i not in reached:
            beside = [order.index(j) for j in (i - 1, i + 1) if j in order]
            order.insert(min(beside) + 1 if beside else len(order), i)
    return [units[i] for i in order]


class Schedule:
    """The non-root units in one order (`units`: registration order until `follow`), with
    where this forward and this backward have got to. `unshard(unit)` launches a unit's
    AllGather unless it is gathered already; `reduce(unit)` is the unit's turn to be
    reduced (or freed)."""

    def __init__(
        self,
        units: Sequence[Any],
        unshard: Callable[[Any], None],
        reduce: Callable[[Any], None],
    ):
        self._unshard, self._reduce = unshard, reduce
        self.settled = False  # the order of the calls taken (or registration order kept)
        self._take(units)

    def _take(self, units: Sequence[Any]) -> None:
        self.units = list(units)
        self._position = {id(u): i for i, u in enumerate(self.units)}
        self._fwd = 0  # next unit to gather in this forward
        self.reset_backward()

    def follow(self, units: Sequence[Any]) -> None:
        """From now on, the order of the calls (`agreed_order`): between a forward's end
        and the next forward or backward, with no event of the order pending."""
        self.settled = True
        self._take(units)

    def reset_backward(self, apart: Collection[int] = ()) -> None:
        """The next backward's order: every unit but those in `apart` (by id), which the
        engine gathers for each call and reduces after the others ([Note: a unit called
        again after another] in calls.py). The ranks leave out the same units: those they
        gathered again in forward, which they compare."""
        self._back = [u for u in self.units if id(u) not in apart]
        self._back_position = {id(u): i for i, u in enumerate(self._back)}
        last = len(self._back) - 1
        self._bwd = last  # next unit to gather, backwards
        self._rs = last  # next unit to reduce, backwards
        self._want = last + 1  # gather down to this unit when the order allows

    # -- forward: every unit gathered once, in order ----------------------------------------
    def start_forward(self) -> None:
        """The root's forward begins: prefetch the first unit."""
        self._fwd = 0
        self._gather_forward(0)

    def before_forward(self, u: Any) -> None:
        """`u` is about to run: gather the units before it not yet gathered (skipped here,
        kept until the forward ends), `u`, and the next one."""
        self._gather_forward(self._position[id(u)] + 1)

    def end_forward(self) -> None:
        """The root's forward ends: gather the units this rank skipped at the end."""
        self._gather_forward(len(self.units))

    def _gather_forward(self, upto: int) -> None:
        while self._fwd <= min(upto, len(self.units) - 1):
            self._unshard(self.units[self._fwd])
            self._fwd += 1

    # -- backward: one sequence of events ------------------------------------------------------
    def start_backward(self) -> None:
        """The root's backward begins: prefetch the last unit."""
        self._want = min(self._want, len(self._back) - 1)
        self.advance()

    def before_backward(self, u: Any) -> None:
        """`u`'s backward (or its recomputation) is about to run: `u` is needed now, the
        unit before it is prefetched."""
        i = self._back_position[id(u)]
        self._want = min(self._want, i - 1)
        self.advance(need=i)

    def end_backward(self) -> None:
        """The end-of-backward callback, every unit done: the events left, in order."""
        self._want = 0
        self.advance(need=0)

    def advance(self, need: int | None = None) -> None:
        """Issue the events that are due, in order: each unit's ReduceScatter once its
        gradients are done and the AllGather before it is out; AllGathers down to the
        wanted unit, each after the ReduceScatter two units later (the order of a rank
        that runs every unit); and down to `need` whatever the order."""
        while True:
            k = self._rs
            if k >= 0 and self._back[k].done and (k == 0 or self._bwd < k - 1):
                self._reduce(self._back[k])
                self._rs -= 1
                continue
            j = self._bwd
            forced = need is not None and j >= need
            due = j >= self._want and (j >= len(self._back) - 2 or self._rs <= j + 1)
            if j >= 0 and (forced or due):
                self._unshard(self._back[j])
                self._bwd -= 1
                continue
            return
