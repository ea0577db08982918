"""Replica groups: what a run agrees on across them each step ([Note: fault-tolerant
replica groups]). Without `ft` a run is one group and every call here is a no-op; with
`ft.enabled` each group is its own torchrun launch, joined to the others through
torchft's Manager and a Lighthouse.

    plan = replicas.start_step(step)       # quorum; a group that is behind heals here
    ... forward and backward of plan.slots' data ...
    loss, correct = replicas.reduce(grads, loss, correct, len(plan.slots))
    if replicas.commit(): step the optimizer   # else: drop the gradients, redo the step
"""

from __future__ import annotations

import logging
import math
import os
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from trainer.checkpoint import faults
from trainer.comm.collectives import Handle, broadcast_object, stats
from trainer.errors import ConfigError, TrainingError, first_line

# [Note: fault-tolerant replica groups]
# With `ft.replica_groups=N` the run's replicate dimension is N replica groups, each a
# torchrun launch of P ranks that trains in its mode as a run of P ranks would (its own
# process group, its own collectives). Across groups, rank r of every group holds the same
# state (all of it in ddp, slice r in zero and fsdp), so what crosses is one AllReduce per
# step of what rank r holds of the gradients: the Manager's process group joins rank r of
# the groups in the current quorum (torchft reconfigures it when a group leaves or comes
# back). Each step:
#
# 1. `start_step`: the quorum (a blocking RPC to the Lighthouse through group rank 0's
#    ManagerServer). A group whose step is behind the quorum's newest heals there, before
#    its forward: rank r receives rank r's state from a live peer (torchft's HTTP
#    transport, `state_dict`/`load_state_dict` below), no checkpoint read. The quorum's
#    groups are known from the ranks the process group is configured with.
# 2. The global batch is cut into N x P slots of batch_size / (N P) samples, slot
#    g P + r belonging to rank r of group g. [Note: constant global batch]: the slots of
#    groups missing from the quorum are taken over by the groups present (missing group j
#    by the j-th present one, cyclically), as more micro-batches, so a step averages the
#    same samples whoever is alive.
# 3. `reduce`: each group's gradients (averaged over its own slots) are weighted by
#    slots / N and summed over the quorum: the mean over all N P slots. The step's loss and
#    correct count ride along in a second, float64, AllReduce, with one flag per optimizer
#    tensor ("has a gradient"): groups must agree on which parameters get one.
# 4. `commit`: torchft's should_commit. The optimizer steps, the schedule and the step
#    counter advance, and metrics count, only if it is True. Otherwise the gradients are
#    dropped and the same step is run again, with the quorum of that moment. should_commit
#    agrees only inside a group: a group that did not commit where another did is behind
#    at the next quorum, and heals from it (the same update, computed by the peer).
#
# Exact: every group present computes its slots as the uninterrupted run would, so the
# update equals the uninterrupted run's up to the order of the fp32 sums (a survivor sums
# two groups' micro-batches in backward where the uninterrupted run sums them in the
# AllReduce), with no sample lost or repeated. Not exact: a model that draws random
# numbers in its forward (dropout) draws them for the slots it took over in another order.

# [Note: a Lighthouse outage]
# torchft's start_quorum submits Manager._async_quorum to a one-thread pool and (sync
# quorum) waits on that future; _async_quorum's ManagerClient._quorum is an RPC to the
# group's ManagerServer (Rust, on group rank 0), which asks the Lighthouse. That RPC's
# timeout is the quorum's (ft.quorum_timeout_s, 60 s). When the Lighthouse dies, the
# ManagerServer's request to it fails at once (connection reset or refused), but by
# default (quorum_retries=0) the ManagerServer then gives up without answering the ranks
# waiting on it: they wait out the whole quorum timeout and raise. So an outage of 3 s,
# wherever in the step it landed, cost 60 s.
# With quorum_retries the ManagerServer retries the failed request itself, inside the
# same RPC: 100 ms later, on a new connection it makes with torchft's backoff (100 ms,
# x1.5 a try, jittered, started afresh every ft.connect_timeout_s). The quorum returns
# once the Lighthouse is back: the outage costs its own length, plus the backoff's last
# wait (up to about half the outage, at most about 4 s with ft.connect_timeout_s=10),
# plus the step. `_quorum_retries` makes the retries outlast any one quorum's wait (each
# try takes at least 100 ms). The Lighthouse comes back knowing no group: the first to
# ask forms a quorum with those whose heartbeat already reached it, and a group later
# than that heals at the next quorum, one step behind (measured: docs/fault_tolerance.md,
# "A Lighthouse outage").
# An outage longer than ft.stall_timeout_s still stops the run: each quorum waits at most
# what is left of that budget since the last commit (`_quorum_wait`), then the
# TimeoutError it raises is forgotten (below) and `_stalled` stops the run with a
# checkpoint. A ManagerServer still retrying a quorum the ranks gave up on joins the next
# quorum with the same step: nothing was committed in between.


@dataclass(frozen=True)
class StepPlan:
    """What this group computes at a step: `step` (later than asked after a heal) and the
    groups whose data slots it takes, its own first."""

    step: int
    slots: tuple[int, ...]


def slots_of(me: int, present: list[int], groups: int) -> tuple[int, ...]:
    """The groups whose slots group `me` computes when the groups `present` (sorted) are in
    the quorum: its own, then missing group j's for the j-th missing one it is dealt
    ([Note: constant global batch])."""
    missing = [g for g in range(groups) if g not in present]
    extra = [g for j, g in enumerate(missing) if present[j % len(present)] == me]
    return (me, *extra)


class Replicas:
    """One replica group: nothing to agree on (ft off)."""

    groups = 1  # N
    index = 0  # this group's index

    def start_step(self, step: int) -> StepPlan:
        return StepPlan(step, (0,))

    def reduce(
        self, engine: Any, loss: torch.Tensor, correct: torch.Tensor, slots: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's gradients (`engine.grad_tensors()`), loss and correct count summed
        over the groups; one group: as they are."""
        return loss, correct

    def commit(self, step: int) -> bool:
        return True

    def counted(self, slots: int) -> int:
        """The data slots the loss and count `reduce` returned are of, when this group
        computed `slots` of them: one of every group's (ft.semi_sync: its own)."""
        return self.groups

    def after_step(self, step: int) -> int:
        """After the optimizer step of `step` (ft.semi_sync: a fragment's sync); returns
        the step this group is at (later where it healed)."""
        return step

    def figures(self) -> dict[str, float]:
        """What to log beside the step's metrics (ft/wait_ms_per_step), since the last
        call."""
        return {}

    def global_copy(self) -> AbstractContextManager:
        """The model as the groups agree on it, inside the block (an evaluation):
        between DiLoCo's syncs its global copy, otherwise the model as it is."""
        return nullcontext()

    def writes_checkpoints(self) -> bool:
        return True

    def checkpointed(self) -> dict[str, Any]:
        """Statefuls a checkpoint keeps for the replica groups, by name."""
        return {}

    def load_step(self, step: int) -> None:
        """The step a checkpoint resumed at (the Manager counts committed steps)."""

    def close(self) -> None:
        pass


# [Note: a group's origin]
# Every replica group's model descends from one fresh start: its origin, the time (rank 0's
# clock) at which a group built it from the seed at step 0. A heal hands the peer's origin
# on, a checkpoint keeps it (one written before origins were kept, or without ft, counts as
# the oldest: 0). Two origins meet when every group of a run was down and one of them came
# back with no checkpoint of its own (only the lowest group writes them), started afresh
# and trained alone, before another came back from the run's checkpoint. torchft heals
# every group from one at the highest step, however it got there: the fresh group's steps,
# if more, would overwrite the run's progress in every group, without a word. Instead:
# - a group that has trained steps does not load a heal of a younger origin (`_heal`);
# - at a quorum whose groups changed, the groups compare origins in the AllReduce that
#   checks their configs (`_same_run`). Where two groups that have trained steps are of
#   different origins, the quorum commits nothing; each group of a younger origin says in
#   one line that it drops its steps (the checkpoints it wrote stay on disk), counts itself
#   at step 0, and takes no step until it has healed from a group of the oldest origin.
#   So a group that is behind, or started afresh, never becomes the source of a heal for
#   the run's groups, and never sends its pseudo-gradient into their global copy.
# - groups still at step 0 (a fresh run's, started moments apart from the same seeded
#   weights) take the oldest origin without a word.
# Clocks of different hosts only need to agree to within the time between the run's start
# and a fresh start after every group was down.


class Origin:
    """When this group's model was first built from the seed (seconds since the epoch, 0:
    unknown, the oldest): [Note: a group's origin]. A stateful of the checkpoint."""

    def __init__(self, born: float) -> None:
        self.born, self.loaded = born, False

    def state_dict(self) -> dict[str, float]:
        return {"born": self.born}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.born, self.loaded = float(state["born"]), True

    def describe(self) -> str:
        if self.born == 0:
            return "of a checkpoint from before origins were kept"
        return "started afresh at " + time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.born))


def _membership_pg(base: type) -> type:
    """torchft's reconfigurable process group, remembering which groups the quorum
    configured it with (`global_ranks` are g * P + r for each group g present)."""

    class Membership(base):
        present: list[int] = []
        changed = False

        def configure(self, store_addr, replica_id, rank, world_size, quorum_id=None,
                      group_rank=None, group_world_size=None, global_ranks=None):  # fmt: skip
            if global_ranks is not None and group_world_size:
                self.present = sorted(r // group_world_size for r in global_ranks)
            self.changed = True
            super().configure(store_addr, replica_id, rank, world_size, quorum_id,
                              group_rank, group_world_size, global_ranks)  # fmt: skip

    return Membership


class FaultTolerantReplicas(Replicas):
    """N replica groups under torchft ([Note: fault-tolerant replica groups]).

    `state_dict()` returns this rank's whole training state as CPU tensors (what a peer
    heals from) and `load_state_dict(state)` takes it; both run on the main thread
    (the quorum is synchronous)."""

    def __init__(
        self,
        ft: Any,
        rank: int,
        world_size: int,
        device: torch.device,
        fingerprint: int,
        state_dict: Callable[[], dict[str, Any]],
        load_state_dict: Callable[[dict[str, Any]], None],
        engine: Any = None,
    ) -> None:
        self.engine = engine  # sends its gradients across during backward, if it can
        # torchft logs every quorum and commit at INFO (Rust and Python): warnings only,
        # unless the user asked for more (RUST_LOG, or the loggers' levels set first)
        os.environ.setdefault("RUST_LOG", "warn")
        # torchft logs a failed AllReduce with its traceback: this module names it in
        # one line instead (`commit`)
        for name in ("torchft", "torchft_quorums", "torchft_commits", "torchft_errors"):
            if logging.getLogger(name).level == logging.NOTSET:
                logging.getLogger(name).setLevel(logging.CRITICAL)
        # torch's own deserializer, as torchft's HTTP transport calls it
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        from torchft import Manager
        from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

        from trainer.comm import addresses

        self.groups, self.index = int(ft.replica_groups), int(ft.replica_group)
        self.rank, self.world_size, self.device = rank, world_size, device
        self.min_groups = int(ft.min_groups)
        self.stall_s = float(ft.stall_timeout_s)
        self.quorum_s = float(ft.quorum_timeout_s)
        self.fingerprint = fingerprint
        self._state_dict, self._load_state_dict = state_dict, load_state_dict
        timeout = timedelta(seconds=float(ft.timeout_s))
        lighthouse = ft.lighthouse or os.environ["TORCHFT_LIGHTHOUSE"]  # checks.py: one of them
        self.lighthouse = lighthouse
        # what the other groups connect to: [Note: the addresses a group advertises]
        host = addresses.advertised_host(ft.advertise_host, lighthouse)
        base = ProcessGroupNCCL if device.type == "cuda" else ProcessGroupGloo
        pg_class = _membership_pg(base)
        if base is ProcessGroupGloo:
            pg_class = addresses.bound_to(host, pg_class)
        self.pg = pg_class(timeout=timeout)
        store_addr, store_port = _group_store(rank, host)
        try:
            self.manager = Manager(
                pg=self.pg,
                load_state_dict=self._heal,
                state_dict=self._live_state,
                min_replica_size=self.min_groups,
                use_async_quorum=False,  # heal before the forward, take part in the step
                timeout=timeout,
                quorum_timeout=timedelta(seconds=self.quorum_s),
                connect_timeout=timedelta(seconds=float(ft.connect_timeout_s)),
                rank=rank,
                world_size=world_size,
                store_addr=store_addr,
                store_port=store_port,
                lighthouse_addr=lighthouse,
                hostname=addresses.in_url(host),  # the ManagerServer's
                checkpoint_transport=addresses.AdvertisedHTTPTransport(host, timeout),
                # torchft reads the group's index from the id's trailing digits
                replica_id=f"shardtrain_{fingerprint:x}_{self.index}",
                heartbeat_interval=timedelta(milliseconds=int(ft.heartbeat_ms)),
                # retried at once when the Lighthouse is lost: [Note: a Lighthouse outage]
                quorum_retries=_quorum_retries(self.quorum_s),
                init_sync=False,  # every group builds the same weights from the seed
            )
        except Exception as e:
            raise ConfigError(
                f"ft.lighthouse={lighthouse}: no Lighthouse answers there within "
                f"ft.connect_timeout_s={ft.connect_timeout_s} ({first_line(e)}); start "
                "one with `torchft_lighthouse --min_replicas 1 --bind [::]:29510`"
            ) from None
        self.teardown = Teardown(f"ft: group {self.index} rank {rank}")
        self.started = self.last_commit = time.monotonic()
        self.join_s = float(ft.join_timeout_s)
        self.announced: list[int] = list(range(self.groups))  # the groups last named
        self.healed_at: int | None = None  # the step a heal brought this group to
        # a step that commits later than this after the one before is named (a stall)
        self.slow_s = 0.5
        # [Note: a group's origin]: rank 0's clock, the same in every rank of the group
        born = [time.time()]
        broadcast_object(born)
        self.origin = Origin(born[0])
        self.asked = 0  # the step this group counted itself at in the last quorum
        self.dropped = False  # its steps were of a younger origin: it takes none until healed
        self.refused = False  # it did not load a heal of a younger origin this quorum

    # -- heal ------------------------------------------------------------------------
    def _live_state(self) -> dict[str, Any]:
        return {"fingerprint": self.fingerprint, "origin": self.origin.born,
                "state": self._state_dict()}  # fmt: skip

    def _heal(self, sent: dict[str, Any]) -> None:
        if sent["fingerprint"] != self.fingerprint:
            raise ConfigError(
                f"ft: replica group {self.index} was sent the state of a run of another "
                f"config (fingerprint {sent['fingerprint']:x}, this one {self.fingerprint:x}): "
                "every group of a run needs the same config and ranks per group"
            )
        born = float(sent.get("origin", 0.0))
        if born > self.origin.born and self.asked > 0 and not self.dropped:
            # [Note: a group's origin]: the peer's steps are not this run's model. Not
            # loaded; this group stays at its step, and the origins are compared below.
            self.manager.load_state_dict({"step": self.asked, "batches_committed": 0})
            self.refused = True
            peer = Origin(born)
            self._say(f"not healed from a group at step {sent['state']['step']} "
                      f"({peer.describe()}): this group's model is older "
                      f"({self.origin.describe()}, step {self.asked})")  # fmt: skip
            return
        self._load_state_dict(sent["state"])
        self.healed_at = int(sent["state"]["step"])
        self.origin.born = born

    def checkpointed(self) -> dict[str, Any]:
        return {"ft_origin": self.origin}  # [Note: a group's origin]

    def load_step(self, step: int) -> None:
        if step > 0 and not self.origin.loaded:  # resumed from a checkpoint without one
            self.origin.born = 0.0  # [Note: a group's origin]: the oldest
        self.manager.load_state_dict({"step": step, "batches_committed": 0})

    # -- each step ---------------------------------------------------------------------
    def start_step(self, step: int) -> StepPlan:
        with self.teardown.waiting("the quorum"):
            plan = self._start_step(step)
        if self.engine is not None:  # [Note: across replica groups during backward]
            self.engine.across = _Across(self, len(plan.slots) / self.groups)
        return plan

    def _start_step(self, step: int) -> StepPlan:
        while True:
            self.healed_at, self.refused = None, False
            self.asked = self.manager.current_step()
            asked = time.monotonic()
            try:
                # a heal loads the peer's state in here
                self.manager.start_quorum(timeout=self._quorum_wait())
            except ConfigError:
                raise
            except Exception as e:  # no quorum within its wait
                # torchft 0.2.0 keeps the failed quorum and raises it again at every later
                # start_quorum: forgotten, so that the next one can succeed
                self.manager._quorum_future = None
                why = "timed out" if isinstance(e, TimeoutError) else first_line(e)
                self._stalled(f"no quorum from the Lighthouse at {self.lighthouse} ({why})")
                time.sleep(0.1)
                continue
            if self.healed_at is not None:
                step = self.healed_at + 1
                self.dropped = False
                self._say(
                    f"healed from a live peer at step {self.healed_at} in "
                    f"{time.monotonic() - asked:.2f} s (quorum, state sent and loaded)"
                )
            present = self.pg.present or [self.index]
            if self.pg.changed or self.refused:  # a group joined or left: the same run?
                same = self._same_run(step - 1)
                if same is None:
                    continue  # the check's AllReduce failed: checked at the next quorum
                self.pg.changed = False
                if not same:  # two origins: [Note: a group's origin]
                    self._skip("replica groups of two origins")
                    continue
            if self.dropped:  # not healed yet: it has no step of this run to take
                self._stalled("waiting to heal from a group of the run's origin")
                self._skip("a group waits to heal")
                continue
            if len(present) < self.min_groups:
                self._stalled(f"{len(present)} of {self.groups} replica groups alive")
                self._skip("too few replica groups")
                continue
            waited = time.monotonic() - self.started
            if step == 1 and len(present) < self.groups and waited < self.join_s:
                self._skip("a fresh run waits for every group")  # ft.join_timeout_s
                continue
            plan = StepPlan(step, slots_of(self.index, present, self.groups))
            if present != self.announced:  # a group left or came back: said once
                self.announced = present
                extra = (
                    f"; takes the slots of group(s) {list(plan.slots[1:])}"
                    if plan.slots[1:]
                    else ""
                )
                self._say(
                    f"step {step}: {len(present)} of {self.groups} replica groups {present}{extra}"
                )
            return plan

    def _quorum_wait(self) -> timedelta:
        """ft.quorum_timeout_s, or what is left of ft.stall_timeout_s since the last commit
        if less ([Note: a Lighthouse outage]): a Lighthouse gone for good stops the run
        after the stall budget, not after the next whole quorum timeout."""
        left = self.stall_s - (time.monotonic() - self.last_commit)
        return timedelta(seconds=min(self.quorum_s, max(left, QUORUM_WAIT_MIN_S)))

    def _skip(self, why: str) -> None:
        """This quorum commits no step (every group present skips it alike)."""
        self.manager.report_error(RuntimeError(why))
        self.manager.should_commit()
        time.sleep(0.05)  # the next quorum: not a busy loop of RPCs

    def _same_run(self, done: int) -> bool | None:
        """Whether the groups in the quorum are of one run: every one has this group's
        fingerprint (else refused), and those that have trained share one origin ([Note: a
        group's origin]; False: a group of a younger origin drops its steps, here, and
        waits to heal). `done`: the step this group is at. None: the check's AllReduce
        failed, the quorum is tried again."""
        fp = float(self.fingerprint % (1 << 40))
        born, trained = self.origin.born, done > 0 and not self.dropped
        inf = math.inf
        # one AllReduce of MIN: the fingerprints' least and greatest, the least origin of
        # the groups that trained, their greatest, and the least of all
        figures = torch.tensor(
            [fp, -fp, born if trained else inf, -born if trained else inf, born],
            dtype=torch.float64, device=self.device,
        )  # fmt: skip
        self.manager.allreduce(figures, reduce_op=dist.ReduceOp.MIN).wait()
        if self.manager.errored() is not None:
            return None
        least, greatest, oldest, youngest, first = figures.tolist()
        if least != fp or -greatest != fp:
            raise ConfigError(
                f"ft: a replica group of another config or run joined the quorum of "
                f"{self.manager.num_participants()} groups (this group's fingerprint "
                f"{self.fingerprint:x}): every group of a run needs the same config and ranks "
                "per group, and each run its own Lighthouse"
            )
        if oldest == inf:  # nobody trained yet: every group takes the first start
            self.origin.born = first
            return True
        if not trained:  # healed from the oldest below, or about to be
            return oldest == -youngest
        if born > oldest:  # a younger origin than a group that trained: drop, heal
            self._say(f"its model ({self.origin.describe()}, step {done}) is not the run's: "
                      f"a group of an older one ({Origin(oldest).describe()}) is back. Its "
                      f"{done} steps are dropped (checkpoints it wrote stay where they are) "
                      "and it heals from that group")  # fmt: skip
            self.dropped = True
            self.manager.load_state_dict({"step": 0, "batches_committed": 0})
        return oldest == -youngest

    def _stalled(self, why: str) -> None:
        waited = time.monotonic() - self.last_commit
        if waited > self.stall_s:
            raise TooFewGroups(
                f"ft: {why} for {waited:.0f} s, longer than ft.stall_timeout_s={self.stall_s:g} "
                f"(ft.min_groups={self.min_groups}): stopping"
            )

    def reduce(
        self, engine: Any, loss: torch.Tensor, correct: torch.Tensor, slots: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sum over the quorum of each group's gradients weighted by slots / N, in place;
        returns this rank position's loss and correct count over all N slots. Refuses
        gradients that some groups have and others not."""
        weight = slots / self.groups
        # sent during backward already: [Note: across replica groups during backward]
        sent = getattr(engine, "sent_across", False)
        engine.across, engine.sent_across = None, False
        grads = [] if sent else engine.grad_tensors()[0]
        flat = torch.cat([g.reshape(-1).float() for g in grads]) if grads else None
        stepped = [p for g in engine.optimizer.param_groups for p in g["params"]]
        has_grad = torch.tensor([p.grad is not None for p in stepped], dtype=torch.float64)
        figures = torch.cat(
            [torch.stack([loss.detach().double() * weight, correct.detach().double()]),
             has_grad.to(loss.device)]
        )  # fmt: skip
        works = []
        if flat is not None:
            flat.mul_(weight)
            works.append(self.manager.allreduce(flat, reduce_op=dist.ReduceOp.SUM))
            # comm/bytes_per_step/ft_across_replica_groups in TensorBoard
            stats.bytes_sent["ft_across_replica_groups"] += _ring_bytes(flat, self.manager)
        works.append(self.manager.allreduce(figures, reduce_op=dist.ReduceOp.SUM))
        with self.teardown.waiting("the cross-group AllReduce"):
            for w in works:
                w.wait()
        if self.manager.errored() is not None:
            return loss, correct  # should_commit says False: the step is redone
        if flat is not None:
            offset = 0
            for g in grads:
                n = g.numel()
                g.copy_(flat[offset : offset + n].view_as(g))
                offset += n
        # A tensor stepped in some groups and not in others (a parameter used in one
        # group's batches only) would leave the groups' models different: refused.
        counts = figures[2:].cpu()
        n = self.manager.num_participants()
        split = ((counts != 0) & (counts != n)).nonzero()
        if len(split):
            raise TrainingError(
                f"ft: {len(split)} optimizer tensor(s) (the first #{int(split[0])}) got a "
                f"gradient in some replica groups only this step: a parameter no sample of a "
                f"group's batch used; ft needs every group to use the same parameters"
            )
        return figures[0].to(loss.dtype), figures[1].to(correct.dtype)

    def commit(self, step: int) -> bool:
        if faults.fault("commit", step):  # [Note: fault injection]: `nocommit`
            self.manager.report_error(RuntimeError(f"{faults.FAULT_ENV}: nocommit at step {step}"))
        error = self.manager.errored()
        with self.teardown.waiting("the commit"):
            committed = self.manager.should_commit()
        now = time.monotonic()
        if not committed:
            why = first_line(error.original_exception) if error is not None else "another rank"
            self._say(f"step {step} did not commit ({why}): redone")
            self._stalled(f"no step committed ({why})")
        elif now - self.last_commit > self.slow_s:
            n = self.manager.num_participants()
            self._say(
                f"step {step} committed {now - self.last_commit:.1f} s after the last, with "
                f"{n} of {self.groups} replica groups"
            )
        if committed:
            self.last_commit = now
        return committed

    def _say(self, line: str) -> None:
        """One line on stderr, from rank 0 of the group."""
        if self.rank == 0:
            print(f"ft: group {self.index}: {line}", file=sys.stderr, flush=True)

    def writes_checkpoints(self) -> bool:
        """The lowest group of the quorum writes the run's checkpoints."""
        return self.index == min(self.pg.present or [self.index])

    def close(self) -> None:
        self.teardown.close()
        self.manager.shutdown(wait=False)


# [Note: a group torn down while it waits]
# When one rank of a replica group dies, torchrun sends SIGTERM to the group's other ranks
# and SIGKILLs them 30 s later. A rank waiting on its group's peers in torchft (the
# quorum, the commit: RPCs that wait for every rank of the group) never gets to the step
# boundary where the SIGTERM flag is read ([Note: stopping on SIGTERM]), and while rank 0
# lives its ManagerServer goes on telling the Lighthouse that the group is alive: the
# other groups' next quorum waits for it, 30 s instead of a heartbeat. Python runs signal
# handlers only between bytecodes, which a rank blocked in torchft's Rust RPCs does not
# reach, so a thread watches the signal's wakeup fd instead: a SIGTERM that finds the rank
# in such a wait which is still the same wait TEARDOWN_S later ends the process there,
# with one line. A preemption of every group, whose waits end in milliseconds, stops as
# any run does, at its next check step with a checkpoint.
TEARDOWN_S = 2.0


# [Note: across replica groups during backward]
# A group's own reduction runs bucket by bucket during backward (ddp: each bucket's
# AllReduce as soon as its gradients are in). The per-step sync across groups follows it
# there: `start_step` hands the engine an `_Across` for the step, and where the group's
# reduction yields fp32 (ddp's buckets reduced over all of the group's ranks, zero's and
# fsdp's reduced slices, after the hybrid AllReduce where there is one) each result's
# cross-group AllReduce is chained on the reduction that makes it (collectives.py
# `chain`: launched from the continuation thread once the result is in, in launch order,
# the same order in every group), weighted by slots / N in place. Backward's end waits
# for both; `reduce` then sends only the loss, the correct count and the has-gradient
# flags. Elsewhere (bf16 or int8 reductions, ddp's expert buckets) `reduce` sends the
# gradients after backward, as one flat fp32 AllReduce. Nothing else launches on the
# Manager's process group while backward runs: the quorum comes before it and the
# figures after its end.


class _Across:
    """One step's cross-group AllReduce of a bucket of gradients, weighted by slots / N."""

    def __init__(self, replicas: FaultTolerantReplicas, weight: float) -> None:
        self.replicas, self.weight = replicas, weight

    def send(self, grad: torch.Tensor) -> Any:
        manager = self.replicas.manager
        grad.mul_(self.weight)
        work = manager.allreduce(grad, reduce_op=dist.ReduceOp.SUM)
        stats.bytes_sent["ft_across_replica_groups"] += _ring_bytes(grad, manager)
        return Handle(work)

    def waiting(self) -> AbstractContextManager:
        return self.replicas.teardown.waiting("the cross-group AllReduce")


class Teardown:
    """[Note: a group torn down while it waits]."""

    def __init__(self, who: str) -> None:
        self.who = who
        self.since: float | None = None  # when the current wait began
        self.what = ""
        self.read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        try:  # the main thread only; elsewhere (tests) nothing is watched
            self.previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        except ValueError:
            os.close(self.read_fd)
            os.close(write_fd)
            self.read_fd = None
            return
        self.write_fd = write_fd
        threading.Thread(target=self._watch, name="ft-teardown", daemon=True).start()

    @contextmanager
    def waiting(self, what: str) -> Iterator[None]:
        self.since, self.what = time.monotonic(), what
        try:
            yield
        finally:
            self.since = None

    def _watch(self) -> None:
        while True:
            try:
                got = os.read(self.read_fd, 64)
            except OSError:
                return  # closed
            if not got:
                return
            if signal.SIGTERM not in got:
                continue
            signalled = time.monotonic()
            time.sleep(TEARDOWN_S)
            since = self.since
            if since is not None and since <= signalled:
                print(
                    f"error: {self.who}: SIGTERM while waiting {time.monotonic() - since:.0f} s "
                    f"for {self.what} with the rest of its group: the group is being torn down "
                    "(one of its ranks ended); the other replica groups go on",
                    file=sys.stderr,
                    flush=True,
                )
                os._exit(1)

    def close(self) -> None:
        if self.read_fd is None:
            return
        signal.set_wakeup_fd(self.previous)
        os.close(self.write_fd)  # the watching thread reads the end of the pipe and returns
        os.close(self.read_fd)
        self.read_fd = None


class TooFewGroups(TrainingError):
    """Fewer than ft.min_groups replica groups for longer than ft.stall_timeout_s."""


# The shortest wait a quorum is given ([Note: a Lighthouse outage]): a stall budget nearly
# spent still leaves a quorum of groups that are all there (a few ms) time to form.
QUORUM_WAIT_MIN_S = 1.0
# torchft's ManagerServer waits at least 100 ms between two tries of a failed quorum.
RETRY_MIN_S = 0.1


def _quorum_retries(quorum_timeout_s: float) -> int:
    """Tries enough to span one quorum's whole wait ([Note: a Lighthouse outage])."""
    return max(1, math.ceil(quorum_timeout_s / RETRY_MIN_S))


def _ring_bytes(t: torch.Tensor, manager: Any) -> float:
    n = max(manager.num_participants(), 1)
    return 2 * (n - 1) / n * t.numel() * t.element_size()


def _group_store(rank: int, host: str) -> tuple[str, int]:
    """A TCPStore of the group's own for its Managers, hosted by rank 0 and new with each
    launch. Not torchrun's: its store outlives a restart of the group's workers
    (`--max-restarts`), and a restarted rank could read the dead attempt's ManagerServer
    address there before rank 0 replaced it, and fail to connect. Every rank calls it.
    Advertised at rank 0's `host`: the other groups meet in it too ([Note: the addresses a
    group advertises])."""
    global _own_store
    where: list[Any] = [None]
    if rank == 0:
        _own_store = dist.TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False)
        where = [(host, _own_store.port)]
    broadcast_object(where)
    return where[0]


_own_store: dist.TCPStore | None = None
