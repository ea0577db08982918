"""fsdp's record of the units each forward calls and of the gradients its outputs lead to,
and the check that the ranks' AllGathers paired up when a unit was gathered again ([Note:
a unit called again after another]).
"""

from __future__ import annotations

import contextlib
import hashlib
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from trainer import comm
from trainer.errors import ConfigError, PeerError, is_collective_timeout
from trainer.observe import host

# [Note: a unit called again after another]
# Weight sharing calls one unit several times in a forward with other units in between
# (ALBERT, looped models: `for o in others: x = o(shared(x))`). With
# reshard_after_forward=true the unit was freed when the next unit started, so each later
# call gathers it again, as FSDP2 does. These AllGathers run on a group of their own (a
# third twin of the shard group, comm/groups.py): ranks that skip different units issue
# the schedule's AllGathers at other points between them, so on one group the two kinds
# would pair with each other. Backward mirrors it, as FSDP2's pre-backward hook fires per
# call: such a unit leaves the schedule's order for that backward (schedule.py); each
# call's backward gathers it on the same group of its own unless it is still gathered,
# and it is freed when another unit's backward starts, as in forward ([Note: freeing
# after forward] in fsdp.py). Its gradients need no unit kept: autograd sums a
# parameter's gradient over all its uses before it accumulates it, so they arrive once,
# after the last call's backward; the unit is reduced once, after the other units and
# before the root (a place every rank agrees on, whatever units each skipped), so its
# traffic stays one ReduceScatter. A backward thus holds one such unit's parameters at a
# time (two in a recomputed region holding both) and their summed gradients, not every
# unit between its calls (`working_set_bytes`). Its first AllGather of a backward is the
# one the traffic formula counts per unit; every other one is counted beyond it
# (`sent_again`).
# Gathering per call in backward needs the ranks' backwards alike: a rank that skips a
# unit its peers run goes ahead in the one order and may wait there (to free a unit it
# gathered only for the order, or for an older ReduceScatter) for a collective that a
# peer issues only after its next such AllGather, which waits for that rank: a deadlock
# (tests/test_control_flow.py's random draws found it). So at the start of a backward
# after forwards that gathered a unit again, the ranks compare a hash of every call
# those forwards made (unit, with or without grad) and of how many gradients each unit
# of the order expects (one AllReduce of 64 bits over the shard group, one host read).
# Where they differ, the units stay in the order for that backward, as the order needs:
# gathered once at their turn and kept across their calls' backwards, so every unit
# between the calls may be gathered with them (the price of calls that differ).
# The ranks' AllGathers pair up only if every rank gathers the same units again in the
# same order, in forward and in backward. When the ranks' calls differ, they need not:
#   - a rank that gathers again more often than its peers waits for an AllGather that no
#     peer issues: every rank then hangs until the collective timeout (dist.timeout_s),
#     and the rank that gathered again says so in one line (`timeouts`);
#   - ranks that gather again as often but other units, or in another order, pair wrong
#     buffers: of different sizes, Gloo aborts the process; of equal sizes the values mix
#     silently. So each rank hashes the sequence of units it gathered again (forward and
#     backward ones told apart), and after a backward (or a forward without grad) in
#     which it did, it compares the hash with its peers' in one small AllReduce of its
#     64 bits, before any gradient reaches the
#     optimizer: a mismatch is refused in one line on every rank, with each rank's count.
#     A rank that gathered nothing again issues no such AllReduce and needs none: then no
#     peer did either, or every rank is already hanging (above).
# The check rides on no collective of the step: on the root's ReduceScatter it would add
# its 64 columns to every fsdp step and mix the shard groups' hashes under hybrid
# sharding, where only a shard group's ranks pair up (the AllReduce runs over the shard
# group). Steps that gather nothing again cost nothing; one that does costs two such
# AllReduces and two host reads (the calls compared at the start of backward, the units
# gathered again after it).

SIGNATURE_BITS = 64


class CallRecord:
    """The units a forward ran (`ran`, `calls`, `opaque`: what fsdp.py's hooks consult),
    and since the last check, the calls that gathered a unit again, in order."""

    def __init__(self, units: Sequence[Any], group: Any, rank: int):
        self._position = {id(u): i for i, u in enumerate(units)}  # the root is 0
        self._group, self._rank = group, rank
        self._peers = comm.world_size(group) > 1  # one rank alone pairs with nobody
        self.again: dict[int, Any] = {}  # units ever gathered again, by id
        self._one_gather: dict[int, float] = {}  # bytes one AllGather of such a unit sends
        self.sent_again = 0.0  # bytes beyond the formula's since the last step
        self.sent_again_last_step = 0.0
        self.start()
        self._reset_check()
        self.forget_forwards()

    def start(self) -> None:
        """A new forward's record (a root forward, or one below it with no backward due)."""
        self.ran: set[int] = set()  # units that ran in this forward
        self.calls: Counter[int] = Counter()  # calls of each unit in this forward
        self.opaque: list[Any] = []  # units that ran without grad in this forward

    def call(self, u: Any) -> None:
        """`u` runs (again) in this forward."""
        self.ran.add(id(u))
        self.calls[id(u)] += 1
        grad = torch.is_grad_enabled()
        self._all_calls.update((2 * self._position[id(u)] + grad).to_bytes(4, "little"))
        if not torch.is_grad_enabled():  # maybe inside a reentrant checkpoint, whose
            self.opaque.append(u)  # recomputation in backward gives it gradients

    # -- AllGathers again, and the check ---------------------------------------------------
    def _reset_check(self) -> None:
        self._hash = hashlib.blake2b(digest_size=SIGNATURE_BITS // 8)
        self.regathered: list[tuple[str, str]] = []  # (unit, which call) gathered again

    def gather_again(self, u: Any, unshard: Callable[[], None], backward: bool) -> None:
        """Gather `u` again (`unshard` launches its AllGathers on the group of their own):
        for its current call in this forward, or (`backward`) for a call's backward."""
        before = sum(comm.stats.bytes_sent.values())
        unshard()
        sent = sum(comm.stats.bytes_sent.values()) - before
        where = "a call's backward" if backward else f"call {self.calls[id(u)]} in a forward"
        self.regathered.append((u.name, where))
        self._hash.update((2 * self._position[id(u)] + backward).to_bytes(4, "little"))
        self.again[id(u)] = u
        self._one_gather[id(u)] = sent
        if not backward:
            self.apart[id(u)] = u
        self.sent_again += sent

    def begin_backward(self, expected: Sequence[int], device: torch.device) -> set[int]:
        """The units (by id) this backward gathers per call, apart from the schedule's
        order: those gathered again in a forward since the last backward, when every rank
        made the same calls in those forwards and expects gradients (`expected`: how
        many, per unit of the order) for the same units; none otherwise. The formula
        counts one AllGather of each in a backward: not beyond it."""
        if not self.apart:
            return set()
        if self._peers:
            for n in expected:
                self._all_calls.update(n.to_bytes(8, "little"))
            if not self._agree(self._all_calls, "fsdp call check", device):
                return set()
        for key in self.apart:
            self.sent_again -= self._one_gather[key]
        return set(self.apart)

    def forget_forwards(self) -> None:
        """A backward ended, or a forward without grad with none due: no unit apart, no
        call recorded."""
        self.apart: dict[int, Any] = {}  # gathered again in a forward since the last backward
        self._all_calls = hashlib.blake2b(digest_size=SIGNATURE_BITS // 8)  # every call

    def end_step(self) -> None:
        self.sent_again_last_step, self.sent_again = self.sent_again, 0.0

    def check(self, device: torch.device) -> None:
        """After a backward, or a forward without grad: refuse on every rank if the units
        the ranks gathered again since the last check differ. Free when none was."""
        if not self.regathered or not self._peers:
            self._reset_check()
            return
        agree = self._agree(self._hash, "fsdp gather check", device)
        mine = self.regathered
        self._reset_check()
        if agree:
            return
        raise ConfigError(_mismatch(comm.all_gather_object(mine, group=self._group)))

    def _agree(self, signature: Any, what: str, device: torch.device) -> bool:
        """Whether every rank's `signature` (a blake2b hash) is the same: one AllReduce of
        its bits over the shard group and one host read."""
        digest = int.from_bytes(signature.digest(), "little")
        bits = torch.tensor([(digest >> i) & 1 for i in range(SIGNATURE_BITS)], dtype=torch.float32)
        bits = bits.to(device)
        comm.all_reduce(bits, tag="gather_check", account=False, group=self._group).wait()
        n = comm.world_size(self._group)
        # every bit summed over the ranks is 0 or n exactly when all hashes agree
        return bool(host.item(((bits == 0) | (bits == n)).all(), what))

    @contextlib.contextmanager
    def timeouts(self) -> Iterator[None]:
        """A collective that times out after this rank gathered a unit again: say why."""
        try:
            yield
        except RuntimeError as e:
            if not self.regathered or not is_collective_timeout(e):
                raise
            unit, where = self.regathered[-1]
            raise PeerError(
                f"fsdp: rank {self._rank} gathered unit {unit!r} again ({where}) and no "
                "peer answered within dist.timeout_s: a rank that calls "
                "weight-shared units more often than its peers under "
                "reshard_after_forward=true waits so (unless a peer stopped). Call them "
                "alike on every rank, or set mode.reshard_after_forward=false"
            ) from e


def reached_leaves(outputs: Sequence[torch.Tensor]) -> set[int]:
    """The leaves (by id) whose gradients `outputs` lead to through the autograd graph:
    what torch DDP's find_unused_parameters walks, from the outputs."""
    reached = {id(t) for t in outputs if t.grad_fn is None}  # leaves themselves
    seen: set[Any] = set()
    stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        leaf = getattr(node, "variable", None)  # AccumulateGrad: a leaf's gradient
        if leaf is not None:
            reached.add(id(leaf))
            continue
        stack.extend(n for n, _ in node.next_functions if n is not None)
    return reached


def _mismatch(everyone: list[list[tuple[str, str]]]) -> str:
    """One line: the first unit gathered again a different number of times on some ranks
    (or, as often everywhere, in another order), and each rank's count."""
    counts = [Counter(u for u, _ in calls) for calls in everyone]
    units = list(dict.fromkeys(u for calls in everyone for u, _ in calls))
    unit = next((u for u in units if len({c[u] for c in counts}) > 1), units[0])
    said = ", ".join(f"rank {r}: {c[unit]}" for r, c in enumerate(counts))
    if all(len({c[u] for c in counts}) == 1 for u in units):
        said += ", in another order"
    return (
        f"fsdp: the ranks gathered units again differently in this step (unit {unit!r}: "
        f"{said}): they called weight-shared units differently under "
        "reshard_after_forward=true, so their AllGathers paired up wrongly; nothing was "
        "stepped. Call them alike on every rank, or set mode.reshard_after_forward=false"
    )


def gathered_again(
    calls: Sequence[tuple[str, str]], units: Sequence[str], gathers: set[int]
) -> dict[int, int]:
    """AllGathers again, by unit index, that fsdp's forward hooks (`FSDPEngine._pre_forward`,
    `_post_forward`, reshard_after_forward=true) issue in a root forward making `calls`
    (("pre" | "post", module name), in order): the estimate's count of them. `units`:
    unit names in `plan_units` order (the root first); `gathers`: the indices of units
    with parameters to gather. [Note: freeing after forward] in fsdp.py: a unit is freed
    when the next unit with parameters to gather starts."""
    index = {name: i for i, name in enumerate(units) if i and i in gathers}
    ran: set[int] = set()
    full: set[int] = set()
    pending: int | None = None  # ran last, freed when another unit starts
    again: Counter[int] = Counter()
    for event, name in calls:
        i = index.get(name)
        if i is None:
            continue
        if pending not in (None, i):
            full.discard(pending)
            pending = None
        if event == "post":
            pending = i
            continue
        if i in ran and i not in full:
            again[i] += 1
        ran.add(i)
        full.add(i)
    return dict(again)


def gathered_again_in_backward(
    calls: Sequence[tuple[str, str]], units: Sequence[str], gathers: set[int]
) -> dict[int, int]:
    """AllGathers beyond the formula's one per unit, by unit index, that the backward of a
    root forward making `calls` issues (as `gathered_again`, whose units it gathers per
    call): each call's backward, in the reverse order of the calls' outputs, gathers such
    a unit unless it is still gathered, that is unless no other unit with parameters to
    gather started its backward since its last call's. Every call is taken to have a
    backward (a call under no_grad has none: the run then gathers less)."""
    apart = gathered_again(calls, units, gathers)
    index = {name: i for i, name in enumerate(units) if i and i in gathers}
    order = [index[name] for event, name in reversed(calls) if event == "post" and name in index]
    gathered: Counter[int] = Counter()
    previous = None
    for i in order:
        if i in apart and i != previous:
            gathered[i] += 1
        previous = i
    return {i: n - 1 for i, n in gathered.items() if n > 1}
