"""fsdp's order of collectives, the same on every rank.

[Note: one collective order on every rank]
Ranks may run different units (control flow that depends on the rank or its data:
a layer some ranks skip). Gathering and reducing units as they happen to run would
then give the ranks different sequences of collectives, which pair up wrongly
(equal-size units silently, others with a crash or a hang). So every collective
follows one schedule that all ranks share, the units in registration order:
  forward   each forward gathers every scheduled unit once, in order: a unit about
            to run first gathers the units before it not yet gathered (ones this
            rank skips), then itself, then prefetches the next; the root gathers
            the rest when the forward ends. Skipped units are freed again.
  backward  the same in reverse order: a unit's pre-backward hook gathers the units
            after it not yet gathered, itself and the one before it; the
            end-of-backward callback gathers those no hook reached.
  reduce    ReduceScatters strictly in reverse order, as ddp's buckets: a unit whose
            gradients are done waits for the units after it; those that get no
            gradient are reduced (zeros) from the callback; the root comes last.
A rank that skips a unit thus issues exactly the AllGathers and the ReduceScatters
of a rank that runs it, each kind in the same order (they run on two process groups,
since a skipping rank reduces later and so interleaves the two kinds differently),
and contributes zeros to its gradient, as torch DDP with unused parameters.
What it costs: a model whose forward order differs from registration order gathers
some units earlier than needed; a unit that no rank runs is still gathered. Not
covered: a unit called more often on some ranks than on others after being freed
in between (its extra gathers have no partner).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any


class Schedule:
    """The non-root units in registration order, with where this forward, this backward
    and this backward's reductions have got to. `unshard(unit)` launches a unit's
    AllGather unless it is gathered already."""

    def __init__(self, units: Sequence[Any], unshard: Callable[[Any], None]):
        self.units = list(units)
        self._unshard = unshard
        self._position = {id(u): i for i, u in enumerate(self.units)}
        self._fwd = 0  # next unit to gather in this forward
        self.reset_backward()

    def reset_backward(self) -> None:
        self._bwd = self._rs = len(self.units) - 1  # next to gather / reduce, backwards

    # -- forward: every unit gathered once, in order ----------------------------------------
    def start_forward(self) -> None:
        """The root's forward begins: prefetch the first unit."""
        self._fwd = 0
        self._gather_forward(0)

    def before_forward(self, u: Any) -> None:
        """`u` is about to run: the units before it not yet gathered, `u`, the next one."""
        self._gather_forward(self._position[id(u)] + 1)
        self._unshard(u)  # called again after it was freed

    def end_forward(self) -> None:
        """The root's forward ends: the units this rank skipped at the end."""
        self._gather_forward(len(self.units))

    def _gather_forward(self, upto: int) -> None:
        while self._fwd <= min(upto, len(self.units) - 1):
            self._unshard(self.units[self._fwd])
            self._fwd += 1

    # -- backward: the same in reverse ---------------------------------------------------------
    def start_backward(self) -> None:
        """The root's backward begins: prefetch the last unit."""
        self._gather_backward(len(self.units) - 1)

    def before_backward(self, u: Any) -> None:
        """`u`'s backward is about to run: the units after it not yet gathered, `u`, and
        the one before it."""
        self._gather_backward(self._position[id(u)] - 1)
        self._unshard(u)

    def end_backward(self) -> None:
        """The end-of-backward callback: the units no pre-backward hook reached."""
        self._gather_backward(0)

    def _gather_backward(self, downto: int) -> None:
        while self._bwd >= max(downto, 0):
            self._unshard(self.units[self._bwd])
            self._bwd -= 1

    # -- reductions: strictly in reverse order ----------------------------------------------
    def reducible(self) -> Iterator[Any]:
        """The units whose ReduceScatter may be launched now, in order: from the last
        unit down, while each one's gradients are done (`unit.done`)."""
        while self._rs >= 0 and self.units[self._rs].done:
            yield self.units[self._rs]
            self._rs -= 1
