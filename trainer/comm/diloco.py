"""Semi-synchronous training across replica groups (`ft.semi_sync=diloco|local_sgd`):
each group trains H steps alone, then the groups average what they learnt ([Note: DiLoCo
across replica groups]). Streaming: the model is cut into F fragments along its units,
each synced every H steps, one every H/F steps, its AllReduce waited for tau steps after
it was sent ([Note: the fragment schedule]).

    replicas = SemiSyncReplicas(...)       # replicas.py's interface, plus after_step
    plan = replicas.start_step(step)       # a quorum only at the first step (or a heal)
    ... the group's ordinary step: no traffic across groups ...
    replicas.after_step(step)              # a fragment's sync is sent / waited for here

Rank r of every group holds the same shard of the parameters (all of them in ddp), so
the global copy, the pseudo-gradient, its AllReduce and the outer momentum are all per
shard: what the inner optimizer steps (`engine.shard_groups()`'s pieces). Both outer
tensors ride in the inner optimizer's state ([Note: outer state in the optimizer's
state]): checkpoints, re-cutting and heals carry them as they carry the moments.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.distributed_c10d import AllgatherOptions

from trainer.checkpoint import faults
from trainer.comm import quantized
from trainer.comm.collectives import all_gather, stats
from trainer.comm.replicas import FaultTolerantReplicas, StepPlan
from trainer.errors import ConfigError, first_line
from trainer.parallel.units import DEFAULT_UNIT_CLASSES, plan_units

# [Note: DiLoCo across replica groups]
# A round of a fragment: every group starts from the global copy θ of its parameters,
# takes H inner steps of its own (the run's optimizer, mode and data slots, no traffic
# across groups), then sends its pseudo-gradient Δ_g = θ - θ_g. The groups in the
# quorum AllReduce Σ w_g Δ_g and Σ w_g, w_g the data slots group g trained in the round
# (a group healed in the round has trained none: it sends zeros, weight 0); the mean
# Δ is the gradient of an outer SGD on θ (diloco: Nesterov momentum, ft.outer_lr and
# ft.outer_momentum; local_sgd: lr 1 and no momentum, which is plain averaging of the
# groups' parameters). Each group then takes θ (ft.fragment_update_alpha=a: a θ_g +
# (1 - a) θ) and the compute copy follows (`engine.params_from_masters()`: zero gathers
# it inside the group, ddp casts it, fsdp gathers each unit as it runs anyway).
# With inner SGD without momentum, H = 1, lr 1 and no momentum this is the per-step
# sync's update: Δ_g = lr g_g, θ - mean Δ = θ - lr mean g (up to rounding).
# A sync whose AllReduce or commit fails is sent again with the quorum of that moment;
# no inner step is dropped. The run's last step syncs every fragment and takes θ, so
# every group ends with the same (global) model, which is the final model.

# [Note: outer state in the optimizer's state]
# The global copy and the outer momentum of an optimizer tensor t are
# `optimizer.state[t]["outer_global"]` and `["outer_momentum"]` (diloco with an outer
# momentum above 0; and `["outer_error"]` with a lossy wire): per-element fp32 tensors
# shaped like t, so the checkpoint code saves and re-cuts them by ranges, a heal sends
# them with the rest of the optimizer's state, the memory monitor counts them and the
# estimator plans them (`replica_groups.outer_bytes_per_value`). They are put there
# after t's first inner step (torch's optimizers build their own state when it is
# empty); until then they are kept aside. After any load (a resume, a heal) they are
# bound again (`OuterState.bind`). With tau > 0 a fourth rides along: [Note: a
# checkpoint with a sync in flight].
# [Note: a group's ranks split what they all hold]
# zero and fsdp give rank r a shard of its own; ddp gives every rank of a group the whole
# model. Synced as it is, each of a ddp group's P ranks would send the whole pseudo-
# gradient across (P Ψ a group per sync over the one link between sites) and step the
# same outer SGD; so would the R ranks of a replica group under hybrid sharding (each
# holding the same slice). Instead, of each fragment's dense values that R ranks hold alike
# (ddp: all P; hybrid: the replica group; not the experts'), laid end to end, the j-th of
# them sends and steps slice j only (`_Share`, ceil(n / R) values): Ψ / P values across
# per rank, as in zero and fsdp. After its outer step the group's ranks AllGather
# their slices of the global copy (and of the outer momentum and the error feedback), so
# every rank holds all of them whole, as a checkpoint and a heal expect (ddp's rank 0
# writes them); the outer step is elementwise, so it is the same arithmetic as stepping
# it whole. Expert parameters (their own groups) are sent whole by their holders.
# [Note: a checkpoint with a sync in flight]
# With tau > 0 a fragment's sync is in flight for tau steps, and a checkpoint may fall
# among them. The pseudo-gradient it sent cannot be computed again from what the
# checkpoint holds (the local copy has moved on), so with tau > 0 it is kept as one
# more per-element tensor, `["outer_in_flight"]` (4 bytes a value; a ddp group's ranks
# AllGather their slices of it at the send, as rank 0 writes the optimizer's state).
# The error feedback is written at the apply, not the send, so that a checkpoint holds
# the error before the send; and the sync itself (fragment, step due, weight, mix) and
# each fragment's slots trained since its send are a stateful of the checkpoint
# (`Flight`). A resumed group sends the kept sync again at its first quorum: the same
# bytes, so one group resumed ends bitwise where the uninterrupted run does (a group
# healing there joins it with nothing, as at any sync). A checkpoint written by a stall
# inside a sync holds it too, sent again and applied at once on resume.
GLOBAL, MOMENTUM, ERROR = "outer_global", "outer_momentum", "outer_error"
IN_FLIGHT = "outer_in_flight"
BLOCK = 256  # values per int8 block (one fp32 scale each), as the in-group int8 wire


def fragments_of(
    model: nn.Module,
    fragments: int,
    unit_classes: list[str] | None = None,
    min_unit_params: int = 100_000,
    repeated_children: bool = True,
) -> dict[str, int]:
    """Parameter name -> fragment: the model's units (units.py, as fsdp cuts them) dealt
    strided, unit i to fragment i mod F, the root's parameters (embeddings, head) with
    fragment 0. Refuses a model of fewer units than fragments."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    if fragments == 1:
        return dict.fromkeys(names, 0)
    classes = DEFAULT_UNIT_CLASSES if unit_classes is None else tuple(unit_classes)
    plans = plan_units(model, classes, min_unit_params, repeated_children)
    units = plans[1:]
    if len(units) < fragments:
        raise ConfigError(
            f"ft.fragments={fragments}: the model has {len(units)} unit(s) to cut into "
            f"fragments (blocks, as mode=fsdp cuts it); use ft.fragments <= {max(len(units), 1)}"
        )
    where = {n: 0 for n, _ in plans[0].params}
    for i, u in enumerate(units):
        where.update({n: i % fragments for n, _ in u.params})
    return {n: where[n] for n in names}


def fragments_for(cfg: Any, model: nn.Module) -> dict[str, int] | None:
    """`fragments_of` as the config asks (the mode's unit options); None without
    ft.semi_sync. Called before the engine is built: fsdp empties the parameters."""
    ft = cfg.get("ft")
    if not ft or not ft.enabled or ft.semi_sync is None:
        return None
    mode = cfg.mode
    return fragments_of(
        model,
        int(ft.fragments),
        mode.get("unit_classes"),
        mode.get("min_unit_params", 100_000),
        mode.get("repeated_children", True),
    )


def join_groups(
    cfg: Any,
    rank: int,
    world_size: int,
    device: torch.device,
    fingerprint: int,
    state_dict: Callable[[], dict[str, Any]],
    load_state_dict: Callable[[dict[str, Any]], None],
    engine: Any,
    fragment_of: dict[str, int] | None,
) -> FaultTolerantReplicas:
    """This launch as replica group ft.replica_group of the run: synced every step, or
    (ft.semi_sync) at its fragments' syncs only."""
    args = (cfg.ft, rank, world_size, device, fingerprint, state_dict, load_state_dict)
    if fragment_of is None:
        return FaultTolerantReplicas(*args, engine)
    return SemiSyncReplicas(*args, engine, fragment_of, int(cfg.train.steps))


def _flat(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    return torch.cat(tensors) if tensors else torch.zeros(0, device=device)


class OuterState:
    """Per fragment: the optimizer tensors it holds (this rank's shard), their global
    copies and the outer SGD that steps them ([Note: outer state in the optimizer's
    state])."""

    def __init__(
        self,
        engine: Any,
        fragment_of: dict[str, int],
        fragments: int,
        lr: float,
        momentum: float,
        lossy: bool,
        keeps_sent: bool = False,
    ) -> None:
        self.engine, self.fragments, self.lr, self.momentum = engine, fragments, lr, momentum
        self.lossy = lossy  # error feedback for a bf16 or int8 wire
        # [Note: a checkpoint with a sync in flight]: the pseudo-gradient sent (tau > 0)
        self.keeps_sent = keeps_sent
        self.local: list[list[torch.Tensor]] = [[] for _ in range(fragments)]
        # [Note: a group's ranks split what they all hold]: the dense optimizer tensors
        # (the mode's own groups, not the experts') and the ranks holding each the same
        held_alike: set[int] = set()
        for g in engine.shard_groups():
            for piece in g.pieces:
                self.local[fragment_of[piece.name]].append(piece.tensor)
                if g.group is None:
                    held_alike.add(id(piece.tensor))
        holders = _holders(engine)
        self.shares = [_Share([t for t in ts if id(t) in held_alike], holders) for ts in self.local]
        # A fragment may hold nothing on this rank (zero cuts its buckets into contiguous
        # slices): rank r of every group holds the same, so each sends its empty Δ alike.
        self.device = engine.device
        # outer tensors of optimizer tensors with no optimizer state yet, by id
        self.aside: dict[int, dict[str, torch.Tensor]] = {}
        self.globals: list[list[torch.Tensor]] = []  # whole, as the optimizer's state holds them
        self.sent: list[list[tuple[torch.Tensor, slice]]] = []  # (local, this rank's range)
        self.stepped: list[list[torch.Tensor]] = []  # the outer SGD's: views of the globals
        self.states: list[list[dict[str, torch.Tensor]]] = []
        self.errors: list[list[torch.Tensor]] = []  # views: this rank's range of each
        self.in_flight: list[list[torch.Tensor]] = []  # views: this rank's range of each
        self.outer: list[torch.optim.SGD] = []

    def _state(self, t: torch.Tensor) -> dict[str, torch.Tensor]:
        optimizer = self.engine.optimizer
        state = optimizer.state.get(t)
        if not state and _builds_no_state(optimizer, t):  # ours is all there is
            state = optimizer.state[t]
            state.update(self.aside.pop(id(t), None) or self._fresh(t))
            return state
        if state:  # the optimizer built its own state: ours rides along
            if GLOBAL not in state:
                state.update(self.aside.pop(id(t), None) or self._fresh(t))
            elif any(k not in state for k in self._kinds()):  # a checkpoint without one
                for k, v in self._fresh(t).items():
                    state.setdefault(k, v)
            return state
        return self.aside.setdefault(id(t), self._fresh(t))

    def _fresh(self, t: torch.Tensor) -> dict[str, torch.Tensor]:
        fresh = {GLOBAL: t.detach().clone()}
        if self.momentum > 0:  # local_sgd and an outer momentum of 0 keep no buffer
            fresh[MOMENTUM] = torch.zeros_like(t)
        if self.lossy:
            fresh[ERROR] = torch.zeros_like(t)
        if self.keeps_sent:
            fresh[IN_FLIGHT] = torch.zeros_like(t)
        return fresh

    def _kinds(self) -> list[str]:
        return (
            [GLOBAL]
            + [MOMENTUM] * (self.momentum > 0)
            + [ERROR] * self.lossy
            + [IN_FLIGHT] * self.keeps_sent
        )

    def bind(self, fresh: bool = False) -> None:
        """(Re)build the outer optimizers on the outer tensors where they now live (after
        a resume or a heal loaded the optimizer's state); `fresh`: what was kept aside is
        dropped and taken anew from the parameters as they are now."""
        if fresh:
            self.aside.clear()
        self.globals, self.errors, self.in_flight, self.outer = [], [], [], []
        self.sent, self.stepped, self.states = [], [], []
        for f in range(self.fragments):
            states = [self._state(t) for t in self.local[f]]
            ranges = [self.shares[f].range_of(t) for t in self.local[f]]
            sent = [(i, r) for i, r in enumerate(ranges) if r.stop > r.start]
            stepped = [states[i][GLOBAL].view(-1)[r] for i, r in sent]
            # where the fragment holds nothing on this rank, an empty stand-in (torch's
            # SGD takes no empty list): it never has a gradient, so it never moves
            sgd = torch.optim.SGD(
                stepped or [torch.zeros(0)], lr=self.lr, momentum=self.momentum,
                nesterov=self.momentum > 0,
            )  # fmt: skip
            if self.momentum > 0:  # torch's first step sets the buffer to the gradient:
                for g, (i, r) in zip(stepped, sent, strict=True):  # 0.9 * 0 + g, the same
                    sgd.state[g]["momentum_buffer"] = states[i][MOMENTUM].view(-1)[r]
            self.globals.append([s[GLOBAL] for s in states])
            self.sent.append([(self.local[f][i], r) for i, r in sent])
            self.stepped.append(stepped)
            self.states.append(states)
            errors = [states[i][ERROR].view(-1)[r] for i, r in sent] if self.lossy else []
            self.errors.append(errors)
            kept = [states[i][IN_FLIGHT].view(-1)[r] for i, r in sent] if self.keeps_sent else []
            self.in_flight.append(kept)
            self.outer.append(sgd)

    def settle(self) -> None:
        """Outer tensors kept aside go into the optimizer's state once it has built its
        own (after the first inner step that gave a tensor a gradient)."""
        state = self.engine.optimizer.state
        if self.aside and any(state.get(t) for ts in self.local for t in ts if id(t) in self.aside):
            self.bind()

    def pseudo_gradient(self, f: int) -> torch.Tensor:
        """Δ = θ - θ_g of what this rank sends of fragment f, flat (fp32)."""
        return _flat(
            [g - t.view(-1)[r] for g, (t, r) in zip(self.stepped[f], self.sent[f], strict=True)],
            self.device,
        )

    def error(self, f: int) -> torch.Tensor:
        return _flat([e.reshape(-1) for e in self.errors[f]], self.device)

    @torch.no_grad()
    def keep_sent(self, f: int, delta: torch.Tensor) -> None:
        """Keep the pseudo-gradient fragment f sends until it is applied ([Note: a
        checkpoint with a sync in flight]); every rank of a group that splits it holds
        the whole."""
        if not self.keeps_sent:
            return
        offset = 0
        for kept in self.in_flight[f]:
            kept.copy_(delta[offset : offset + kept.numel()])
            offset += kept.numel()
        self.shares[f].gather(self.states[f], self.local[f], [IN_FLIGHT])

    def kept_sent(self, f: int) -> torch.Tensor:
        """The pseudo-gradient `keep_sent` kept of fragment f, flat (a new tensor)."""
        return _flat([k.reshape(-1) for k in self.in_flight[f]], self.device).clone()

    @torch.no_grad()  # views of state a checkpoint's load made without grad mode
    def set_error(self, f: int, flat: torch.Tensor) -> None:
        offset = 0
        for e in self.errors[f]:
            e.copy_(flat[offset : offset + e.numel()].view_as(e))
            offset += e.numel()

    @torch.no_grad()
    def apply(self, f: int, mean: torch.Tensor, alpha: float) -> None:
        """The outer step of fragment f with `mean` Δ as its gradient; the local copy
        takes the global one (mixed with alpha)."""
        offset = 0
        for g in self.stepped[f]:
            g.grad = mean[offset : offset + g.numel()].view_as(g)
            offset += g.numel()
        self.outer[f].step()
        for g in self.stepped[f]:
            g.grad = None
        kinds = [GLOBAL] + [MOMENTUM] * (self.momentum > 0) + [ERROR] * self.lossy
        self.shares[f].gather(self.states[f], self.local[f], kinds)
        for g, t in zip(self.globals[f], self.local[f], strict=True):
            if alpha == 0:
                t.copy_(g)
            else:  # a θ_g + (1 - a) θ
                t.lerp_(g, 1.0 - alpha)

    @torch.no_grad()
    def take_global(self, fragment: int | None = None) -> None:
        """The local copy := the global copy, of one fragment or of all (a group that
        joins by a heal: its error feedback, the peer's, is dropped too)."""
        for f in range(self.fragments) if fragment is None else [fragment]:
            for g, t in zip(self.globals[f], self.local[f], strict=True):
                t.copy_(g)
            if fragment is None and self.lossy:
                for state in self.states[f]:
                    state[ERROR].zero_()


def _holders(engine: Any) -> tuple[Any, int, int]:
    """(process group, its size, this rank's place in it) of the ranks of this group that
    hold what this rank holds of the dense parameters: all of them in ddp, the replica
    group of hybrid sharding ([Note: hybrid sharding] in groups.py), this rank alone where
    each rank holds a slice of its own."""
    if not dist.is_initialized():
        return None, 1, 0
    if not getattr(engine, "shards_parameters", True):  # ddp: every rank holds it all
        return None, dist.get_world_size(), dist.get_rank()
    mesh = getattr(engine, "mesh", None)
    if mesh is None or mesh.replicate is None:
        return None, 1, 0
    return mesh.replicate, mesh.replicas, dist.get_rank(mesh.replicate)


class _Share:
    """Rank `rank`'s slice of `held` (the optimizer tensors of a fragment every one of the
    group's `ranks` ranks holds), laid end to end: [Note: a group's ranks split what they
    all hold]."""

    def __init__(self, held: list[torch.Tensor], holders: tuple[Any, int, int]) -> None:
        self.group, ranks, rank = holders
        self.ranks, self.offsets = ranks, {}
        total = 0
        for t in held:
            self.offsets[id(t)] = total
            total += t.numel()
        self.held, self.total = held, total
        self.chunk = -(-total // ranks) if ranks > 1 else total
        self.lo, self.hi = min(rank * self.chunk, total), min((rank + 1) * self.chunk, total)

    def range_of(self, t: torch.Tensor) -> slice:
        """The range of `t`'s values this rank sends and steps: all of a tensor of its own."""
        if self.ranks == 1 or id(t) not in self.offsets:
            return slice(0, t.numel())
        o = self.offsets[id(t)]
        return slice(min(max(self.lo - o, 0), t.numel()), max(min(self.hi - o, t.numel()), 0))

    def gather(self, states: list[dict], local: list[torch.Tensor], kinds: list[str]) -> None:
        """Every rank's slice of each outer tensor in `kinds` into every rank's whole one
        (one AllGather inside the group)."""
        if self.ranks == 1 or not self.held or not kinds:
            return
        by_id = {id(t): s for t, s in zip(local, states, strict=True)}
        mine = torch.zeros(len(kinds), self.chunk, device=self.held[0].device)
        for t in self.held:
            r, o = self.range_of(t), self.offsets[id(t)] - self.lo
            for k, kind in enumerate(kinds):
                mine[k, o + r.start : o + r.stop] = by_id[id(t)][kind].view(-1)[r]
        every = torch.empty(self.ranks, len(kinds), self.chunk, device=mine.device)
        all_gather(every.view(-1), mine.view(-1), tag="diloco_share", group=self.group).wait()
        whole = every.transpose(0, 1).reshape(len(kinds), -1)
        for t in self.held:
            o = self.offsets[id(t)]
            for k, kind in enumerate(kinds):
                by_id[id(t)][kind].view(-1).copy_(whole[k, o : o + t.numel()])


def _builds_no_state(optimizer: torch.optim.Optimizer, t: torch.Tensor) -> bool:
    """Whether `optimizer` never keeps state of its own for `t`: torch's SGD without
    momentum. Its state then holds the outer tensors from the start (else they would stay
    aside: out of checkpoints and heals); others build theirs at their first step of t,
    from an empty state ([Note: outer state in the optimizer's state])."""
    if type(optimizer) is not torch.optim.SGD:
        return False
    group = next(g for g in optimizer.param_groups if any(p is t for p in g["params"]))
    return group["momentum"] == 0


# [Note: the fragment schedule]
# Syncs happen every H/F steps; sync k (k = 1, 2, ...) is of fragment (k - 1) mod F, its
# pseudo-gradient sent after step k H/F - tau and its result waited for and applied after
# step k H/F (tau = ft.fragment_sync_delay; tau = 0: sent and waited at once). A quorum is
# held before each send: groups meet only there. The steps are the run's step numbers, so
# a resumed or healed group is at the same place in the schedule as its peers.


class SemiSyncReplicas(FaultTolerantReplicas):
    """N replica groups that meet only at fragment syncs ([Note: DiLoCo across replica
    groups]). `after_step(step)` sends and applies the syncs; between them replicas.py's
    interface carries nothing across groups."""

    def __init__(
        self,
        ft: Any,
        rank: int,
        world_size: int,
        device: torch.device,
        fingerprint: int,
        state_dict: Callable[[], dict[str, Any]],
        load_state_dict: Callable[[dict[str, Any]], None],
        engine: Any,
        fragment_of: dict[str, int],
        steps: int,
    ) -> None:
        super().__init__(ft, rank, world_size, device, fingerprint, state_dict, load_state_dict)
        self.engine, self.steps = engine, steps
        self.fragments = int(ft.fragments)
        self.every = int(ft.sync_steps) // self.fragments  # H / F
        self.delay = int(ft.fragment_sync_delay)  # tau
        self.alpha = float(ft.fragment_update_alpha)
        self.wire = str(ft.pseudo_grad_dtype)
        if ft.semi_sync == "local_sgd":  # the mean of the groups' parameters
            lr, momentum = 1.0, 0.0
        else:
            lr, momentum = float(ft.outer_lr), float(ft.outer_momentum)
        self.outer = OuterState(
            engine, fragment_of, self.fragments, lr, momentum, lossy=self.wire != "fp32",
            keeps_sent=self.delay > 0,
        )  # fmt: skip
        self.slots: tuple[int, ...] | None = None  # dealt at the last quorum
        # slots trained since each fragment's last send, and the sync in flight: a
        # stateful of the checkpoint ([Note: a checkpoint with a sync in flight])
        self.flight = Flight([0] * self.fragments)
        self.in_flight: _Sync | None = None
        self.applied: tuple[int, set[int]] = (0, set())  # (step, fragments applied then)
        # the sync this group is about to send (fragment, step due), sent with a heal: a
        # group that heals at that quorum joins it
        self.next: tuple[int, int] | None = None
        self.joins: tuple[int, int] | None = None  # the peer's `next`, from a heal
        self.moved_to: int | None = None  # the step a heal brought this group to
        self.wait_s, self.steps_seen = 0.0, 0  # waited on the link, since the last log

    def checkpointed(self) -> dict[str, Any]:
        return {**super().checkpointed(), "ft_in_flight": self.flight}

    def figures(self) -> dict[str, float]:
        per_step = 1e3 * self.wait_s / max(self.steps_seen, 1)
        self.wait_s, self.steps_seen = 0.0, 0
        return {"ft/wait_ms_per_step": per_step}

    # -- replicas.py's interface --------------------------------------------------------
    def start_step(self, step: int) -> StepPlan:
        if self.slots is None:  # this process's first step: join the groups
            self.outer.bind(fresh=True)  # a resumed checkpoint's outer state, if it has one
            if not self.flight.loaded:  # a start, or a checkpoint without them
                self.flight.trained = [self._since_send(f, step - 1) for f in range(self.fragments)]
            # [Note: a checkpoint with a sync in flight]: announced, so that a group
            # healing at this quorum joins it
            kept, self.flight.sync = self.flight.sync, None
            if kept is not None and not self.outer.keeps_sent:  # tau = 0: a stall inside
                self.flight.trained[kept["fragment"]] += int(kept["weight"])  # a sync left
                kept = None  # it, and kept nothing to send again: it goes with the next
            self.next = None if kept is None else (kept["fragment"], kept["due"])
            if not self._quorum(step - 1) and kept is not None:
                self._send(step - 1, kept["fragment"], kept["due"], kept["alpha"], kept)
                if self.in_flight.due <= step - 1:  # written by a stall inside the sync
                    self._finish(step - 1)
            if self.moved_to is not None:
                step = self.moved_to + 1
        return StepPlan(step, self.slots)

    def reduce(
        self, engine: Any, loss: torch.Tensor, correct: torch.Tensor, slots: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return loss, correct  # an inner step: this group's own

    def counted(self, slots: int) -> int:
        return slots  # the loss and correct count are of this group's slots only

    def commit(self, step: int) -> bool:
        return True  # nothing crossed groups: nothing to agree on

    @contextmanager
    def global_copy(self) -> Iterator[None]:
        """The model holds the global copy inside the block (an evaluation between syncs),
        its local copy again after it."""
        local = [[t.detach().clone() for t in ts] for ts in self.outer.local]
        with torch.no_grad():
            for globals_, ts in zip(self.outer.globals, self.outer.local, strict=True):
                for g, t in zip(globals_, ts, strict=True):
                    t.copy_(g)
        self.engine.params_from_masters()
        try:
            yield
        finally:
            with torch.no_grad():
                for saved, ts in zip(local, self.outer.local, strict=True):
                    for s, t in zip(saved, ts, strict=True):
                        t.copy_(s)
            self.engine.params_from_masters()

    def after_step(self, step: int) -> int:
        """[Note: the fragment schedule], after the optimizer step of `step`. Returns the
        step this group is at: a later one where it was behind and healed."""
        self.moved_to = None
        self.steps_seen += 1
        self.outer.settle()
        for f in range(self.fragments):
            self.flight.trained[f] += len(self.slots)
        k, rest = divmod(step + self.delay, self.every)
        if rest == 0 and k >= 1:
            self._sync(step, (k - 1) % self.fragments, step + self.delay)
        if self.moved_to is not None:  # healed: on from the peer's step, on its schedule
            return self.moved_to
        if self.in_flight is not None and self.in_flight.due <= step:
            self._finish(step)
        if step == self.steps:  # every fragment, and every group takes the global copy
            self._finish(step)
            done_now = self.applied[1] if self.applied[0] == step else set()
            for f in range(self.fragments):
                if f not in done_now:
                    self._sync(step, f, step, alpha=0.0)
                    self._finish(step)
                elif self.alpha:
                    self.outer.take_global(f)
            self.engine.params_from_masters()
        return step if self.moved_to is None else self.moved_to

    def _since_send(self, f: int, done: int) -> int:
        """Slots fragment f trained since its last send, for a group resumed at step
        `done` from a checkpoint that did not count them (`Flight`): one a step."""
        first = (f + 1) * self.every - self.delay  # sends: first, first + H, ...
        if done < first:
            return done
        return (done - first) % (self.every * self.fragments)

    # -- a sync --------------------------------------------------------------------------
    def _sync(self, step: int, f: int, due: int, alpha: float | None = None) -> None:
        self.next = (f, due)
        if not self._quorum(step):  # else it healed and joined the sync its peers send
            self._send(step, f, due, alpha)

    def _quorum(self, done: int) -> bool:
        """A quorum after step `done`: who takes part in the next sync, and whose data
        slots each group takes until the next quorum. A group behind the others heals
        here (the peer's step, inner and outer state), takes the global copy and joins
        the sync its peers are about to send, with nothing trained; True where it healed
        (its own sync, if one was due, is not sent). A group that drops its steps ([Note:
        a group's origin]) heals here too, back to its peer's step."""
        self.manager.load_state_dict({"step": done, "batches_committed": 0})
        self.last_commit = time.monotonic()  # a stall is counted from here
        plan = self._start_step(done + 1)
        self.slots = plan.slots
        if self.healed_at is None:
            return False
        self.moved_to = self.healed_at
        self.outer.bind()  # the peer's outer tensors, loaded with the optimizer's state
        self.outer.take_global()
        self.flight.trained = [0] * self.fragments
        self.in_flight = self.flight.sync = None  # its own, behind its peers': theirs holds it
        self.engine.params_from_masters()
        self.next = self.joins
        if self.joins is None:  # the peers are not about to send (a start, a resume):
            return True  # nor is this group, at its peer's step now
        self._send(self.healed_at, *self.joins)
        if self.in_flight.due <= self.healed_at:
            self._finish(self.healed_at)
        return True

    def _live_state(self) -> dict[str, Any]:
        return {**super()._live_state(), "joins": self.next}

    def _heal(self, sent: dict[str, Any]) -> None:
        super()._heal(sent)
        if not self.refused:  # [Note: a group's origin]: a younger peer's was not loaded
            self.joins = sent.get("joins")

    def _send(
        self, step: int, f: int, due: int, alpha: float | None = None, kept: dict | None = None
    ) -> None:
        """Launch the sync of fragment f: Σ w Δ and Σ w over the quorum; `kept`: the one
        a checkpoint held in flight, sent again ([Note: a checkpoint with a sync in
        flight])."""
        if kept is None:
            weight = float(self.flight.trained[f])
            delta = self.outer.pseudo_gradient(f)
            self.outer.keep_sent(f, delta)
        else:
            weight, delta = float(kept["weight"]), self.outer.kept_sent(f)
        self.flight.sync = {"fragment": f, "due": due, "weight": weight, "alpha": alpha}
        n = self.manager.num_participants()
        error = None  # a lossy wire's error feedback after this send, written at the apply
        if self.wire == "fp32":
            delta.mul_(weight)
            weights = torch.tensor([weight], dtype=torch.float64, device=delta.device)
            works = [self.manager.allreduce(weights, reduce_op=dist.ReduceOp.SUM)]
            if delta.numel():  # else this rank holds nothing of the fragment (nor its peers)
                works.append(self.manager.allreduce(delta, reduce_op=dist.ReduceOp.SUM))
            ring = 2 * (n - 1) / max(n, 1)
            stats.bytes_sent["ft_across_replica_groups"] += ring * (delta.numel() * 4 + 8)
            gathered = None
        else:
            row, error = self._packed(f, delta, weight)
            gathered = [torch.empty_like(row) for _ in range(n)]
            works = []
            if self.manager.errored() is None:
                try:
                    works = [self.pg.allgather([gathered], [row], AllgatherOptions())]
                except RuntimeError as e:  # the quorum's group is gone: the commit fails
                    self.manager.report_error(e)
            stats.bytes_sent["ft_across_replica_groups"] += (n - 1) * row.numel()
            weights = None
        self.in_flight = _Sync(f, due, weight, alpha, delta, weights, works, gathered, error)
        if kept is None:
            self.flight.trained[f] = 0
        faults.fault("sync", step)  # [Note: fault injection]: kill_in_sync

    def _packed(
        self, f: int, delta: torch.Tensor, weight: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One row of uint8: Δ on the lossy wire, error feedback carried across syncs,
        and the weight exact; and the error this send leaves. bf16 travels as its 2 bytes
        a value, int8 as blocks with a scale each ([Note: int8 blocks] in quantized.py)."""
        error = self.outer.error(f)  # a new tensor: the state keeps the error before
        tail = torch.tensor([weight], dtype=torch.float32, device=delta.device)
        if self.wire == "bf16":
            x = delta + error
            sent = x.to(torch.bfloat16)
            return torch.cat([sent.view(torch.uint8), tail.view(torch.uint8)]), x - sent.float()
        error = error.view(1, -1)
        row = quantized.pack(delta.view(1, -1), BLOCK, tail.view(1, 1), error)
        return row[0], error.view(-1)

    def _finish(self, step: int) -> None:
        """Wait for the sync in flight and apply it; one that fails is sent again with
        the quorum of this moment until it commits (no inner step is dropped)."""
        while self.in_flight is not None:
            sync, self.in_flight = self.in_flight, None
            if faults.fault("commit", step):  # [Note: fault injection]: `nocommit`
                self.manager.report_error(RuntimeError(f"{faults.FAULT_ENV}: nocommit"))
            waited = time.monotonic()
            with self.teardown.waiting("a fragment sync across replica groups"):
                for w in sync.works:
                    try:
                        w.wait()
                    except RuntimeError as e:  # noqa: PERF203 - named in the commit below
                        self.manager.report_error(e)
                error = self.manager.errored()
                committed = self.manager.should_commit()
            self.wait_s += time.monotonic() - waited
            if committed:
                self._apply(step, sync)
                return
            why = first_line(error.original_exception) if error is not None else "a peer"
            self._say(f"step {step}: the sync of fragment {sync.fragment} did not commit "
                      f"({why}): sent again")  # fmt: skip
            self._stalled(f"no fragment sync committed ({why})")
            self.flight.trained[sync.fragment] += int(sync.weight)
            self._sync(step, sync.fragment, step, sync.alpha)  # in flight again

    def _apply(self, step: int, sync: _Sync) -> None:
        mean = self._mean(sync)
        self.flight.sync = None
        if mean is not None:  # None: no group of the quorum trained it (all just healed)
            if sync.error is not None:  # gathered in the group by `apply`
                self.outer.set_error(sync.fragment, sync.error)
            alpha = self.alpha if sync.alpha is None else sync.alpha
            self.outer.apply(sync.fragment, mean, alpha)
            self.engine.params_from_masters()
        done = self.applied[1] if self.applied[0] == step else set()
        self.applied = (step, done | {sync.fragment})

    def _mean(self, sync: _Sync) -> torch.Tensor | None:
        """Σ w Δ / Σ w of the quorum; with a lossy wire summed here from every group's
        row, in group order, so that every group gets the same values."""
        if sync.gathered is None:
            total = float(sync.weights[0])
            return sync.delta.div_(total) if total > 0 else None
        n = sync.delta.numel()
        out = torch.zeros_like(sync.delta)
        total = 0.0
        for row in sync.gathered:
            values, weight = self._unpacked(row, n)
            if weight > 0:
                out.add_(values, alpha=weight)
                total += weight
        return out.div_(total) if total > 0 else None

    def _unpacked(self, row: torch.Tensor, n: int) -> tuple[torch.Tensor, float]:
        if self.wire == "bf16":
            values = row[: 2 * n].view(torch.bfloat16).float()
            return values, float(row[2 * n :].view(torch.float32)[0])
        values, tail = quantized.unpack(row.view(1, -1), n, BLOCK, tail=1)
        return values[0], float(tail[0, 0])


@dataclass
class _Sync:
    """A fragment's sync in flight."""

    fragment: int
    due: int  # the step after which it is waited for and applied
    weight: float  # the slots it carries
    alpha: float | None  # the mix it is applied with (None: ft.fragment_update_alpha)
    delta: torch.Tensor  # fp32 wire: Σ w Δ lands here; lossy: this group's Δ
    weights: torch.Tensor | None  # fp32 wire: Σ w lands here
    works: list[Any]
    gathered: list[torch.Tensor] | None  # lossy wire: every group's row
    error: torch.Tensor | None  # lossy wire: the error feedback this send leaves


class Flight:
    """Each fragment's slots trained since its last send and the sync in flight
    ({fragment, due, weight, alpha}, or None): a stateful of the checkpoint ([Note: a
    checkpoint with a sync in flight])."""

    def __init__(self, trained: list[int]) -> None:
        self.trained, self.sync, self.loaded = trained, None, False

    def state_dict(self) -> dict[str, Any]:
        sync = None if self.sync is None else dict(self.sync)
        return {"trained": list(self.trained), "sync": sync}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if len(state["trained"]) != len(self.trained):
            return  # another ft.fragments: counted afresh (`_since_send`)
        self.trained, self.sync, self.loaded = list(state["trained"]), state["sync"], True
