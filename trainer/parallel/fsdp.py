"""mode=fsdp (ZeRO-3): each rank stores 1/P of every unit's parameters, gradients and
optimizer state; a unit's full parameters exist only while it runs.

The model is cut into units (units.py: one per transformer block, residual block or
large submodule; the root unit holds the rest). Each unit's parameters are one buffer
per optimizer param group (fsdp_units.py: a ShardedBuffer of sharded.py whose full
parameters are allocated only while gathered); rank r keeps slice r.

    forward of unit i   AllGather(unit i) -> compute -> free   (unit i+1 already gathering)
    backward of unit i  AllGather(unit i) -> compute -> ReduceScatter(average) its
                        gradients into slice r -> free         (unit i-1 already gathering)

What each rank holds and sends: the mode table in README.md (memory.py checks runs
against it; `working_set_bytes` is the transient part). Read next: fsdp_units.py and
sharded.py (the buffer and its reduce pipeline), units.py (the cut), schedule.py (the one
order of collectives, in the order of the calls), calls.py (the record of a forward's
calls; weight sharing), engine.py (what every mode shares).

`engine.full_state_dict()` is a collective. Between steps the module's parameters are
empty tensors: count them before building the engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_leaves

from trainer import comm
from trainer.comm import groups as comm_groups
from trainer.models.materialize import Source
from trainer.offload.host import HostOffload
from trainer.offload.state import OffloadedState
from trainer.parallel.calls import CallRecord, reached_leaves
from trainer.parallel.engine import Engine, OptimizerFactory, ParamGroupFn, optimizer_state_tensors
from trainer.parallel.experts import ExpertPlan
from trainer.parallel.fsdp_units import Unit, UnitBuffer
from trainer.parallel.local_grads import LocalGrads
from trainer.parallel.pieces import ShardGroup
from trainer.parallel.precision import Precision
from trainer.parallel.scaling import LossScaler
from trainer.parallel.schedule import Schedule, agreed_order
from trainer.parallel.sharded import Reducer, ShardedBuffer, build_optimizer
from trainer.parallel.units import DEFAULT_UNIT_CLASSES, plan_units
from trainer.parallel.used import Arrivals, UsedFlags


class FSDPEngine(Engine):
    """The root unit, like FSDP2's, stays gathered from forward through backward: it runs
    first and last, so freeing it in between would only gather it again.
    `reshard_after_forward=False` keeps every unit gathered from its forward until its
    backward. `no_sync()` keeps each unit's full gradients on its module parameters until
    the synced backward reduces them. Buffers and frozen parameters stay whole on every
    rank and follow rank 0, as in ddp; tied parameters live in the unit enclosing all
    their uses (units.py). With `shard_group_size=S` units are cut into S slices and
    replicas average them ([Note: hybrid sharding] in comm/groups.py). The end of
    backward runs from autograd's callback ([Note: end of backward] in engine.py)."""

    name = "fsdp"
    shards_parameters = True
    builds_from_meta = True  # [Note: building on meta] in parallel/__init__.py
    sharded_kinds = frozenset({"params", "grads", "optimizer"})
    masters_are_params = True
    grads_sent, params_sent = 1.0, 2.0  # ReduceScatter, AllGather before forward and backward

    def __init__(
        self,
        module: nn.Module,
        optimizer: OptimizerFactory,
        reshard_after_forward: bool = True,
        unit_classes: Sequence[str] | None = None,
        min_unit_params: int = 100_000,
        repeated_children: bool = True,
        bucket_mb: float = 25.0,  # accepted so all modes take one config; fsdp sends per unit
        precision: Precision | None = None,
        scaler: LossScaler | None = None,
        param_options: ParamGroupFn | None = None,
        shard_group_size: int | None = None,
        source: Source | None = None,
        device: torch.device | None = None,
        experts: ExpertPlan | None = None,
    ):
        # rank 0's initial values reach every rank before sharding (a model built on meta:
        # every rank reads or draws the same values from `source`)
        super().__init__(module, precision, scaler, device, experts=experts)
        self.mesh = comm_groups.mesh(shard_group_size)  # [Note: hybrid sharding]
        self.reshard_after_forward = reshard_after_forward
        classes = DEFAULT_UNIT_CLASSES if unit_classes is None else tuple(unit_classes)
        plans = plan_units(module, classes, min_unit_params, repeated_children)
        for plan in plans:  # frozen parameters stay whole on every rank, like buffers
            plan.params = [(n, p) for n, p in plan.params if p.requires_grad]
        tags = ["root"] + [f"unit{i}" for i in range(len(plans) - 1)]
        self._used = UsedFlags([p for u in plans for _, p in u.params])  # [Note: used flags]
        self.units = []
        for tag, plan in zip(tags, plans, strict=True):  # one unit allocated at a time
            unit = Unit(
                tag, plan, self._used, self.mesh, self.precision, param_options, self.device,
                experts,
            )  # fmt: skip
            if source is not None:  # built on meta: this rank's slices, nothing more
                # (expert parameters got their rows before the engine was built)
                on_meta = [b for b in unit.flat_buffers if b.params[0].is_meta]
                requests = [r for b in on_meta for r in b.slice_requests()]
                source.fill(module, [], requests, self.device)
            for b in unit.flat_buffers:
                b.free()
            self.units.append(unit)
        if self.precision.mixed:  # buffers (parameters already point at cast buffers)
            self.frozen.cast(self.module, self.precision.param_dtype)
        self.root = self.units[0]
        # The root is reduced last, from the end-of-backward callback; its first buffer
        # over all ranks carries the used-flags (a root without one sends them in one
        # small AllReduce of their own).
        self._flags_buffer = next((b for b in self.root.flat_buffers if b.mesh is self.mesh), None)
        if self._flags_buffer is not None:
            self._flags_buffer.n_flags = len(self._used)
        # [Note: one collective order on every rank] in schedule.py; registration order
        # until the first forward ends, then its calls' ([Note: the order of the calls])
        self._schedule = Schedule(self.units[1:], self._unshard, self._turn)
        # what each forward ran; the check of forward AllGathers ([Note: a unit called
        # again after another] in calls.py)
        self._record = CallRecord(self.units, self.mesh.shard, self.rank)
        self._top: Unit | None = None  # the unit whose forward runs outermost, if any
        self._pending: Unit | None = None  # ran last, freed when another unit starts
        # gathered per call in this backward, by id; the one of them whose call's backward
        # ran last, freed when another unit's starts ([Note: a unit called again after
        # another] in calls.py)
        self._apart: list[Unit] = []
        self._back_pending: Unit | None = None
        # Parameters the forward's outputs reach since the last backward (by id)
        self._expected: set[int] = set()
        self._expect_fresh = True
        self._names = {id(p): n for u in plans for n, p in u.params}
        self._arrived = Arrivals(self._names, self.name)  # gradients of this backward
        # AllGathers on a group of their own: a rank that skips a unit reduces it later in
        # backward than the others, so AllGathers and ReduceScatters interleave
        # differently across ranks, while each kind alone keeps one order.
        # And a third for the AllGathers of units called again after other units ([Note:
        # a unit called again after another] in calls.py), which only that can need.
        meshes = {id(self.mesh): self.mesh}
        if experts is not None:
            meshes[id(experts.groups.edp_mesh)] = experts.groups.edp_mesh
        gather, again = {}, {}
        for key, m in meshes.items():
            gather[key] = comm_groups.gather_group(m.shard)
            if reshard_after_forward:
                again[key] = comm_groups.gather_group(m.shard, "again")
        for buf in self._buffers():
            buf.gather_group, buf.again_group = gather[id(buf.mesh)], again.get(id(buf.mesh))
        self._reducer = Reducer(self._used, self.across_now)
        # [Note: across replica groups during backward]: fp32 slices, sent as they come
        mp = self.precision
        self.across_ok = not mp.reduce_int8 and mp.reduce_dtype == torch.float32
        self._local_grads = LocalGrads()  # full gradients until reduced; no_sync's sums
        for u in self.units:
            u.module.register_forward_pre_hook(lambda m, args, u=u: self._pre_forward(u))
            u.module.register_forward_hook(lambda m, args, out, u=u: self._post_forward(u, out))
            for p in u.params:
                p.register_post_accumulate_grad_hook(lambda p, u=u: self._on_grad(u, p))
        self.optimizer = build_optimizer(optimizer, self._buffers())

    # -- unshard / reshard ---------------------------------------------------------------
    # How a unit's parameters are freed and gathered again: [Note: parameters as views of
    # one storage] in fsdp_units.py.
    def _unshard(self, u: Unit, again: bool = False) -> None:
        """Launch the AllGathers of `u`'s full parameters, unless they are there already."""
        for buf in u.flat_buffers:
            buf.unshard(again)

    def _wait(self, u: Unit) -> None:
        with self._record.timeouts():
            for buf in u.flat_buffers:
                buf.wait()

    def _reshard(self, u: Unit) -> None:
        with self._record.timeouts():
            for buf in u.flat_buffers:
                buf.free()

    def _gather_again(self, u: Unit, backward: bool) -> None:
        """Gather `u` on the group of its own unless it is gathered: for a later call in
        a forward, or a call's backward ([Note: a unit called again after another])."""
        if not u.is_full:
            self._record.gather_again(u, lambda: self._unshard(u, again=True), backward)

    # -- forward ---------------------------------------------------------------------------
    # [Note: freeing after forward]
    # With reshard_after_forward a unit is freed once another unit with parameters to
    # gather starts (or the forward ends), not the moment its own forward returns: a unit
    # called again at once (`x = layer(layer(x))`, a shared layer applied N times, calls
    # with and without grad) then reuses its gathered parameters on whichever rank does
    # so, and no rank issues an AllGather the others do not. A unit that gathers nothing
    # (all its parameters frozen) frees nothing when it runs. A unit called again after
    # another such unit ran in between is gathered again, as FSDP2 does ([Note: a unit
    # called again after another] in calls.py: what that takes when ranks call it
    # differently).
    # With reshard_after_forward=false a unit stays gathered from its first call until
    # its turn in backward, whether its calls ran with grad or not: any number of calls,
    # in any order. Only a forward that runs wholly without grad (no backward follows)
    # frees every unit at its end. Freeing a unit that ran only under no_grad earlier
    # would save memory, but whether it is gathered again in backward would then depend
    # on the rank's calls, and the backward's AllGathers would pair up wrongly.
    #
    # [Note: a forward that starts below the root]
    # `engine.module[0](x)` runs a unit (or a module enclosing units) without the root:
    # FSDP2 trains it. The record of this forward (`_record`, the forward order) starts
    # anew there when no backward is pending, as it does at every root forward; while one
    # is pending (a forward with grad since the last backward) the call adds to the
    # record, as a second root forward before one backward adds to the expected
    # gradients. The outermost unit's forward ends the call: its outputs
    # say which gradients come (`_expect`), and it is freed as a unit it encloses would
    # be. Units it did not run stay as they are until the backward; the root, which did
    # not run, is reduced last as always and its unused parameters keep no gradient.
    # Such calls keep the ranks paired when every rank makes them alike, as FSDP2 needs:
    # the one order of the schedule starts at the root.
    def _pre_forward(self, u: Unit) -> None:
        # [Note: activation checkpointing]
        # torch.utils.checkpoint (non-reentrant) reruns a checkpointed unit's forward in
        # backward, hooks included, when autograd first needs one of its activations. That
        # rerun is not a new forward: it must not gather the unit a second time, prefetch,
        # record the forward order, register backward hooks, or free what its backward is
        # about to use. It is recognised by the engine's own state, as FSDP2's training
        # state does: a forward while this engine's backward is under way. It only makes
        # sure the unit is gathered: usually its pre-backward hook did that already; when
        # the checkpointed region ends after the unit (the recomputation then comes before
        # the gradient reaches the unit) this is the unit's one AllGather of the backward.
        if self._in_backward:
            if u.done and u.params and u is not self.root:  # a backward nested in this one
                name = self._names[id(u.params[0])]
                raise RuntimeError(
                    f"parameter {name!r} would receive its gradient twice in one backward "
                    f"(unit {u.name!r} recomputed after its gradients were reduced: reentrant "
                    "checkpointing?); fsdp needs use_reentrant=False"
                )
            if u in self._apart:
                self._gather_again(u, backward=True)  # unless its pre-backward gathered it
            elif u is not self.root:
                self._schedule.before_backward(u)  # a no-op when its pre-backward gathered it
            self._wait(u)
            comm.record("recompute_begin", u.tag)
            return
        outermost = self._top is None or u is self.root
        if outermost:
            self._top = u
        if u is self.root or (outermost and self._expect_fresh):  # a new record
            self._record.start()
            if u is self.root:
                self._unshard(u)
            self._schedule.start_forward()  # prefetches the first unit
        if u is not self.root:
            if u.flat_buffers and self._pending not in (None, u):  # [Note: freeing after forward]
                self._reshard(self._pending)
                self._pending = None
            again = id(u) in self._record.ran
            self._record.call(u)
            if again:  # freed since its last call: [Note: a unit called again after another]
                self._gather_again(u, backward=False)
            self._schedule.before_forward(u)  # catch up, u, prefetch
        self._wait(u)
        comm.record("forward_begin", u.tag)

    def _post_forward(self, u: Unit, output: Any) -> None:
        if self._in_backward:  # its backward needs the parameters next: keep them, add no hook
            comm.record("recompute_end", u.tag)
            return
        comm.record("forward_end", u.tag)
        grad = torch.is_grad_enabled()
        outs = []
        if grad:
            outs = [
                t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad
            ]
            if outs:  # fires once, when the first gradient w.r.t. the unit's outputs exists
                register_multi_grad_hook(outs, lambda g, u=u: self._pre_backward(u), mode="any")
        if u is not self._top:  # inside another unit's forward
            if u.flat_buffers and self.reshard_after_forward:  # [Note: freeing after forward]
                if self._pending not in (None, u):
                    self._reshard(self._pending)
                self._pending = u  # freed when another unit starts, or the forward ends
            return
        self._top = None
        if u is self.root:
            self._schedule.end_forward()  # units this rank skipped at the end
            if not self._schedule.settled:  # [Note: the order of the calls]
                order = agreed_order(self._schedule.units, list(self._record.calls))
                self._schedule.follow(order)
        elif self.reshard_after_forward:  # [Note: a forward that starts below the root]
            self._reshard(u)
        if self._pending is not None:
            self._reshard(self._pending)
            self._pending = None
        if not grad:
            if u is self.root or self._expect_fresh:  # no backward needs them: free all now
                for v in self.units:
                    self._reshard(v)
                if self._expect_fresh:
                    self._record.forget_forwards()
                self._record.check(self.device)  # no backward follows to check after
            return
        if self.reshard_after_forward and u is self.root:  # skipped: freed as the ranks
            for v in self._schedule.units:  # that ran them freed them
                if id(v) not in self._record.ran:
                    self._reshard(v)
        self._expect(outs)

    def _expect(self, outputs: list[torch.Tensor]) -> None:
        """Record which parameters this forward's outputs reach through the autograd graph:
        those, and only those, get a gradient on this rank in the backward that follows
        ([Note: one collective order on every rank] in schedule.py). As torch DDP's
        find_unused_parameters, from the outputs; several forwards before one backward add
        up."""
        if self._expect_fresh:
            self._expected.clear()
            self._expect_fresh = False
        if self.world_size == 1:  # no peer to keep in step with: expect every gradient
            self._expected.update(id(p) for u in self.units for p in u.params)
            return
        self._expected.update(reached_leaves(outputs))
        # Units that ran without grad inside a forward with grad: a reentrant checkpoint
        # hides them from the graph until its recomputation. Expect all their gradients.
        self._expected.update(id(p) for v in self._record.opaque for p in v.params)

    # -- backward --------------------------------------------------------------------------
    def _begin_backward(self) -> None:
        if not self._in_backward:
            # Units that get no gradient on this rank are done from the start: each is
            # reduced (zeros, or what no_sync kept) at its turn in the one order.
            for v in self._schedule.units:
                v.expected = sum(id(p) in self._expected for p in v.params)
                v.done = v.expected == 0
            self.root.expected = len(self.root.params)
            # Units gathered again in forward are gathered per call, apart from the order,
            # when the ranks' calls agree ([Note: a unit called again after another]).
            expected = [v.expected for v in self._schedule.units]
            apart = self._record.begin_backward(expected, self.device)
            self._apart = [v for v in self._schedule.units if id(v) in apart]
            self._schedule.reset_backward(apart)
        super()._begin_backward()

    def _pre_backward(self, u: Unit) -> None:
        self._begin_backward()
        comm.record("backward_begin", u.tag)
        if u.flat_buffers and self._back_pending not in (None, u):  # its call's backward ran
            self._reshard(self._back_pending)
            self._back_pending = None
        if u is self.root:
            self._schedule.start_backward()  # prefetches the last unit
        elif u in self._apart:  # [Note: a unit called again after another] in calls.py
            self._gather_again(u, backward=True)
            self._back_pending = u
        else:
            self._schedule.before_backward(u)  # catch up, u, prefetch
        self._wait(u)

    def _on_grad(self, u: Unit, p: nn.Parameter) -> None:
        self._begin_backward()
        self._used.mark(p)
        self._arrived.add(p)  # refuses a second arrival
        if u.done and u is not self.root:
            # Its turn in the one order may have passed: the gradient would be lost.
            raise RuntimeError(
                f"parameter {self._names[id(p)]!r} received a gradient that the forward's "
                "outputs do not lead to (used outside the model's forward, or reentrant "
                "checkpointing?); fsdp reduces each unit once, at its turn"
            )
        if id(p) in self._expected or u is self.root:
            u.ready += 1
        # The root is reduced from the end-of-backward callback, last.
        if u.ready == u.expected and u is not self.root:
            self._grads_done(u)

    def _grads_done(self, u: Unit) -> None:
        """All of `u`'s gradients exist (or none will come): free its parameters, keep its
        gradients under no_sync, and let the one order go on (which reduces it at its
        turn)."""
        u.done = True
        comm.record("grads_ready", u.tag)
        self._reshard(u)  # first: the full parameters are gone before its gradient buffer
        if self._back_pending is u:
            self._back_pending = None
        if not self._sync:
            # no_sync: full gradients stay on the module parameters and keep accumulating
            # over micro-batches (in the reduce dtype when the parameters compute in a
            # lower one); the next synced backward reduces the sum.
            for buf in u.flat_buffers:
                for p in buf.params:
                    self._local_grads.add(p, buf.reduce_dtype)
        if u is not self.root:
            self._schedule.advance()

    def _turn(self, u: Unit) -> None:
        """`u`'s turn in the backward order: free it if this rank gathered it only to keep
        the order (a unit it gave no gradient), then ReduceScatter its gradients."""
        if u.is_full:
            self._reshard(u)
        if self._sync:
            self._reduce(u)

    def _reduce(self, u: Unit) -> None:
        """ReduceScatter (average) `u`'s gradients into its slices' gradients."""
        for buf in u.flat_buffers:
            for p in buf.params:
                buf.write_grad(p, self._local_grads.take(p))
            self._reducer.launch(buf)
        # Earlier ReduceScatters ran while this unit computed: free their inputs. Safe to
        # wait for: every rank issued them before anything this rank issued since
        # ([Note: one collective order on every rank]).
        self._reducer.release_beyond(len(u.flat_buffers))

    def _finish_backward(self) -> None:
        # [Note: one collective order on every rank]: units whose gradients did not all
        # come are done now; the order's remaining events follow, and the root (which
        # carries the used-flags) last, so every rank issues the same collectives.
        for u in self._schedule.units + [self.root]:
            if not u.done:
                self._grads_done(u)
        self._schedule.end_backward()
        for u in reversed(self._apart):  # after the others, on every rank alike
            self._turn(u)
        if self._sync:
            self._reduce(self.root)
        flags = self._reducer.finish()
        if self._sync:
            self.sent_across = self.across_now() is not None
            if self._flags_buffer is None and self.world_size > 1:  # no root buffer to ride on
                flags = self._flags_alone()
            unused = self._used.unused_everywhere(flags)
            for buf in self._buffers():
                buf.hand_out(unused)
        for u in self.units:
            self._reshard(u)
            u.ready, u.done = 0, False
        self._arrived.clear()
        self._expect_fresh = True  # the next forward's graph says what the next backward gets
        self._top = None
        self._apart, self._back_pending = [], None
        self._record.forget_forwards()
        self._schedule.reset_backward()
        self._record.check(self.device)  # before any gradient reaches the optimizer

    def _flags_alone(self) -> torch.Tensor:
        flags = torch.empty(len(self._used), device=self.device)
        self._used.fill(flags)
        comm.all_reduce(flags, tag="used_flags", account=False).wait()
        return flags

    def _buffers(self) -> list[UnitBuffer]:
        return [buf for u in self.units for buf in u.flat_buffers]

    def working_set_bytes(self) -> int:
        """Full params (their dtype) and grads (reduce dtype) of the root unit, gathered
        from forward through backward; of the two largest other units' params and grads
        (one computing, one prefetched or being reduced); and for the units gathered
        again for a later call so far ([Note: a unit called again after another] in
        calls.py), the full params of the two largest (one at a time, two in a
        recomputed region holding both) and every one's grads, reduced after the others
        (ranks whose calls differ keep them gathered across their calls' backwards, and
        may hold more)."""

        def full(u: Unit) -> tuple[int, int]:  # bytes of its full params, of its grads
            params = sum(b.layout.padded_numel * b.full.element_size() for b in u.flat_buffers)
            grads = sum(b.layout.padded_numel * b.reduce_dtype.itemsize for b in u.flat_buffers)
            return params, grads

        again = self._record.again
        shared = sorted((full(u) for u in again.values()), reverse=True)
        others = sorted((sum(full(u)) for u in self.units[1:] if id(u) not in again), reverse=True)
        shared_params = sum(sorted((params for params, _ in shared), reverse=True)[:2])
        return sum(full(self.root)) + shared_params + sum(g for _, g in shared) + sum(others[:2])

    def traffic_beyond_formula(self) -> float:
        return self._record.sent_again_last_step  # the last step's extra AllGathers

    def grad_tensors(self) -> tuple[list[torch.Tensor], bool]:
        # This rank's (S,) slice of each flat buffer's averaged gradient; padding is zero,
        # and so are the slots of parameters that no rank used.
        return [b.grad_shard for b in self._buffers() if b.grad_shard is not None], True

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        for u in self.units:
            for buf in u.flat_buffers:
                buf.grad_shard = None
            for p in u.params:  # full gradients kept by no_sync
                p.grad = None
        self._local_grads.clear()
        self._used.clear()
        self._record.end_step()

    # -- state -----------------------------------------------------------------------------
    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        module_grads = [p.grad for u in self.units for p in u.params if p.grad is not None]
        bufs = self._buffers()
        return {
            # fp32 slices (the masters too, in mixed precision) and gathered full buffers
            "params": [b.master for b in bufs]
            + [b.device_shard for b in bufs if b.device_shard is not None]  # host offload
            + [b.full for b in bufs if b.is_full]
            + [p for p in self.module.parameters() if not p.requires_grad],
            "grads": [b.grad_shard for b in bufs if b.grad_shard is not None]
            + module_grads
            + self._local_grads.tensors()
            + [b.error for b in bufs if b.error is not None],  # error feedback
            "optimizer": optimizer_state_tensors(self.optimizer),
            "comm": [b.grad_input.rows for b in bufs if b.grad_input is not None]
            + [b.reduced for b in bufs if b.reduced is not None],
        }

    def feedback_owners(self) -> list[UnitBuffer]:
        return self._buffers() if self.precision.error_feedback else []

    def offload_state(self, path: Path) -> None:
        # The masters stay: every unshard gathers a unit from them, in forward and again
        # in backward, so moving them would read each twice a step to save 4 bytes a value.
        self.offload = OffloadedState(self.optimizer, self._buffers(), False, path)

    def offload_to_host(self) -> None:
        # The master goes to the host; each unit gathers from a copy in the compute dtype
        # that the step copies up, instead of casting the master at each unshard.
        bufs = self._buffers()
        for b in bufs:
            b.device_shard = torch.empty_like(b.master, dtype=b.full.dtype).copy_(b.master)
        self.offload = HostOffload(self.optimizer, bufs, [b.device_shard for b in bufs])

    def params_from_masters(self) -> None:
        if isinstance(self.offload, HostOffload):  # a loaded checkpoint's masters, up
            self.offload.copy_all_up()

    def _expert_group(self, b: ShardedBuffer) -> Any:
        """An expert buffer's EDP group (pieces.ShardGroup.group); None for the others,
        sharded over the mode's own shard group."""
        return b.mesh.shard if b.mesh is not self.mesh else None

    def shard_groups(self) -> list[ShardGroup]:
        # Rank r's slice of each buffer; the optimizer steps its pieces.
        return [
            ShardGroup(b.names, b.layout, b.master, b.pieces, True, self._expert_group(b))
            for b in self._buffers()
        ]
