"""fsdp's order of collectives, the same on every rank, whatever units each rank runs:
[Note: one collective order on every rank], beside `Schedule`.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any

# [Note: one collective order on every rank]
# Ranks may run different units (control flow that depends on the rank or its data: a
# layer some ranks skip, an output some ranks leave out of the loss). Gathering and
# reducing units as they happen to run would give the ranks different sequences of
# collectives, which pair up wrongly (equal-size units silently, others with a crash or a
# hang). So every collective follows one schedule that all ranks share, the units in
# registration order:
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
# A prefetch that the order does not allow yet is simply issued later. A unit whose
# parameters are needed before its turn (`need`: an activation-checkpointed region
# recomputing several units at once) is gathered at once; the same model does the same on
# every rank, so the order stays common.
# What it costs: a model whose forward order differs from registration order gathers
# some units earlier than needed; a unit that no rank runs is still gathered.


class Schedule:
    """The non-root units in registration order, with where this forward and this
    backward have got to. `unshard(unit)` launches a unit's AllGather unless it is
    gathered already; `reduce(unit)` is the unit's turn to be reduced (or freed)."""

    def __init__(
        self,
        units: Sequence[Any],
        unshard: Callable[[Any], None],
        reduce: Callable[[Any], None],
    ):
        self.units = list(units)
        self._unshard, self._reduce = unshard, reduce
        self._position = {id(u): i for i, u in enumerate(self.units)}
        self._fwd = 0  # next unit to gather in this forward
        self.reset_backward()

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
