"""mode=zero (ZeRO-2): full parameters on every rank; gradients and optimizer state
sharded. Each bucket of parameters is one ShardedBuffer (sharded.py) whose `full` buffer
the module's parameters are views of; rank r steps slice r of it.

    backward  each gradient into its bucket's input -> ReduceScatter(average) per bucket,
              in order, as buckets complete (overlapping backward) -> rank r keeps the
              (S,) mean of slice r
    step      optimizer on slice r -> cast into `full` (mixed precision) ->
              AllGather(slice r of every rank) into `full`: the updated parameters

What each rank holds and sends: the mode table in README.md (memory.py checks runs
against it). Read next: sharded.py (the buffer and its reduce pipeline), buckets.py (the
launch order), engine.py (what every mode shares).

With `shard_group_size=S` buckets are cut into S slices, not P, and replicas average the
slices across groups ([Note: hybrid sharding] in comm/groups.py). Build the engine after
moving the model to its device: `.to()` would replace the views.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainer import comm
from trainer.comm import groups as comm_groups
from trainer.comm.groups import Mesh
from trainer.offload.host import HostOffload
from trainer.offload.state import OffloadedState
from trainer.parallel.buckets import BucketQueue
from trainer.parallel.engine import Engine, OptimizerFactory, ParamGroupFn, optimizer_state_tensors
from trainer.parallel.experts import ExpertPlan
from trainer.parallel.flat import bucketize
from trainer.parallel.local_grads import LocalGrads
from trainer.parallel.pieces import ShardGroup, split_by_options
from trainer.parallel.precision import Precision
from trainer.parallel.scaling import LossScaler
from trainer.parallel.sharded import Reducer, ShardedBuffer, build_optimizer
from trainer.parallel.used import UsedFlags

# [Note: bounded buckets]
# ZeRO-2 that keeps every full bucket until backward ends peaks at a full gradient copy
# and saves nothing. Launching a bucket therefore first releases the oldest one when more
# than BUCKETS_IN_FLIGHT are in flight: waits for its ReduceScatter and frees the
# full-size input. A double buffer: backward blocks only when communication falls two
# buckets behind (on CUDA the compute stream waits, the host does not). The reduced slice
# (1/S of the bucket) is kept until the end-of-backward callback turns the slices into the
# pieces' gradients, as FSDP2 keeps its ReduceScatter outputs until then.
BUCKETS_IN_FLIGHT = 2


class ZeroEngine(Engine):
    name = "zero"
    shards_parameters = True
    sharded_kinds = frozenset({"master", "grads", "optimizer"})
    grads_sent, params_sent = 1.0, 1.0  # ReduceScatter, AllGather

    def __init__(
        self,
        module: nn.Module,
        optimizer: OptimizerFactory,
        bucket_mb: float = 25.0,
        precision: Precision | None = None,
        scaler: LossScaler | None = None,
        param_options: ParamGroupFn | None = None,
        shard_group_size: int | None = None,
        experts: ExpertPlan | None = None,
    ):
        super().__init__(module, precision, scaler, experts=experts)
        self.mesh = comm_groups.mesh(shard_group_size)  # [Note: hybrid sharding]
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        names = {id(p): n for n, p in named}
        self._used = UsedFlags([p for _, p in named])  # [Note: used flags] in used.py

        # Buckets never mix optimizer groups (a bucket's pieces share a param group): each
        # group is bucketed on its own, so a second group's buckets (e.g. no weight decay:
        # biases and norms of every layer) fill, and launch, only as backward ends.
        def buckets_of(pairs: list[tuple[str, nn.Parameter]], mesh: Mesh) -> list:
            return [
                (opts, ps, mesh)
                for opts, group in split_by_options(pairs, param_options)
                for ps in bucketize([p for _, p in group], int(bucket_mb * 2**20))
            ]

        # Expert parameters ([Note: expert parameters in every mode] in experts.py) are
        # bucketed apart and sharded over the EDP group; their buckets launch before the
        # last dense one, which carries the used-flags over all ranks.
        is_expert = experts.holds if experts is not None else lambda p: False
        dense = buckets_of([(n, p) for n, p in named if not is_expert(p)], self.mesh)
        expert = []
        if experts is not None:
            expert_named = [(n, p) for n, p in named if is_expert(p)]
            expert = buckets_of(expert_named, experts.groups.edp_mesh)
        grouped = dense[:-1] + expert + dense[-1:]
        self.buckets = []
        for i, (opts, ps, mesh) in enumerate(grouped):
            named_ps = [(names[id(p)], p) for p in ps]
            flags = [self._used.index[id(p)] for p in ps]
            b = ShardedBuffer(f"bucket{i}", named_ps, flags, opts, mesh, self.precision, True)
            # The parameters become views of `full` (the AllGather after each step writes
            # them) at once: their own storages go bucket by bucket, so building never
            # holds a second copy of the model.
            for p, view in zip(b.params, b.layout.views(b.full), strict=True):
                p.data = view
            self.buckets.append(b)
        self.buckets[-1].n_flags = len(self._used)  # launched last: every use is known
        if self.precision.mixed:  # buffers and frozen parameters; bucketed ones are cast
            self.frozen.cast(self.module, self.precision.param_dtype)
        self._queue = BucketQueue(self.buckets, names, self._launch, self.name)
        self._reducer = Reducer(self._used, self.across_now)
        # [Note: across replica groups during backward]: fp32 slices, sent as they come
        mp = self.precision
        self.across_ok = not mp.reduce_int8 and mp.reduce_dtype == torch.float32
        self._local_grads = LocalGrads()  # full gradients until reduced; no_sync's sums
        for b in self.buckets:
            for p in b.params:
                p.register_post_accumulate_grad_hook(self._hook(b))
        self.optimizer = build_optimizer(optimizer, self.buckets)

    # -- backward: gradients into buckets, buckets ReduceScattered into slices -------------
    def _hook(self, bucket: ShardedBuffer):
        def on_grad_ready(p: nn.Parameter) -> None:
            self._begin_backward()
            self._used.mark(p)
            if not self._sync:
                # no_sync: the full gradient accumulates in p.grad (autograd), or in the
                # reduce dtype when p computes in a lower one
                self._local_grads.add(p, bucket.reduce_dtype)
                return
            bucket.write_grad(p, self._local_grads.take(p))  # frees autograd's full-size gradient
            self._queue.ready(bucket, p)

        return on_grad_ready

    def _launch(self, b: ShardedBuffer) -> None:
        for p in b.params:
            if not self._queue.has_gradient(p):
                # No gradient in this backward: reduce what no_sync accumulated, or zero.
                b.write_grad(p, self._local_grads.take(p))
        self._reducer.launch(b)
        self._reducer.release_beyond(BUCKETS_IN_FLIGHT)  # [Note: bounded buckets]

    def _finish_backward(self) -> None:
        if not self._sync:
            return
        # Buckets still pending hold parameters that got no gradient in this backward.
        self._queue.launch(force=True)
        self._queue.reset()
        unused = self._used.unused_everywhere(self._reducer.finish())
        self.sent_across = self.across_now() is not None
        for b in self.buckets:
            b.hand_out(unused)

    # -- step: update this rank's slices, then AllGather them into the full parameters -----
    @torch.no_grad()
    def _step(self) -> None:
        if self.offload is None:
            self.optimizer.step()  # the pieces: views of each bucket's master slice
            for b in self.buckets:
                self._cast_master(b)
        else:  # bucket by bucket, each cast while its master is read back
            self.offload.step(self._cast_master)  # [Note: offloaded state]
        self.zero_grad()
        self._all_gather_params()

    @torch.no_grad()
    def params_from_masters(self) -> None:
        """The masters into the full parameters: cast (host offload: copied up), then
        AllGather."""
        if isinstance(self.offload, HostOffload):
            self.offload.copy_all_up()
        else:
            for i, b in enumerate(self.buckets):
                with self._masters_in_memory(i):
                    self._cast_master(b)
        self._all_gather_params()

    def _cast_master(self, b: ShardedBuffer) -> None:
        """Mixed precision ([Note: master weights] in precision.py): the fp32 master
        slice rounded into this rank's slice of `full`. In fp32 they are one tensor.
        With host offload the step copies the master up itself ([Note: host offload])."""
        if self.precision.mixed and not self.precision.gather_int8:  # int8: from the master
            b.param_shard.copy_(b.master)

    def offload_state(self, path: Path) -> None:
        # The masters move where they are tensors of their own that only the step reads
        # (mixed precision); in fp32 they are the parameters, and an int8 AllGather
        # quantizes them after the step.
        move = self.precision.mixed and not self.precision.gather_int8
        self.offload = OffloadedState(self.optimizer, self.buckets, move, path)

    def offload_to_host(self) -> None:
        # Each bucket's master goes to the host, in fp32 too (where it was a view of the
        # parameters): the step runs there and copies it up into the slice of `full`.
        targets = [b.param_shard for b in self.buckets]
        self.offload = HostOffload(self.optimizer, self.buckets, targets)

    def _all_gather_params(self) -> None:
        # Launch all, then wait all: the AllGathers overlap each other. Each rank's input
        # is its own slice of the output buffer, so the gather runs in place (with
        # gather_dtype=int8 it is the fp32 master, quantized: [Note: int8 on the wire]).
        handles = [b.gather_full(b.param_shard, b.mesh.shard) for b in self.buckets]
        comm.wait_all(handles)

    def grad_tensors(self) -> tuple[list[torch.Tensor], bool]:
        # This rank's (S,) slice of each bucket's averaged gradient; padding is zero, and
        # so are the slots of parameters that no rank used.
        return [b.grad_shard for b in self.buckets if b.grad_shard is not None], True

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        for b in self.buckets:
            b.grad_shard = None
        for p in self.module.parameters():
            p.grad = None  # left by a no_sync backward that was never synced
        self._local_grads.clear()
        self._used.clear()

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """Params are the full buffers (the module's parameters are views of them);
        grads are the gradient slices, bucket inputs being filled or reduced and any
        `.grad` left by no_sync."""
        in_buckets = {id(p) for b in self.buckets for p in b.params}
        model = list(self.module.parameters())
        frozen = [p for p in model if id(p) not in in_buckets]
        grad_shards = [b.grad_shard for b in self.buckets if b.grad_shard is not None]
        inputs = [b.grad_input.rows for b in self.buckets if b.grad_input is not None]
        local_grads = [p.grad for p in model if p.grad is not None]
        return {
            "params": [b.full for b in self.buckets] + frozen,
            # fp32 copies when mixed or gathered as int8; else views of `full`, counted there
            "master": [b.master for b in self.buckets] + self.frozen.tensors(),
            "grads": grad_shards
            + inputs
            + local_grads
            + self._local_grads.tensors()
            + [b.error for b in self.buckets if b.error is not None],  # error feedback
            "optimizer": optimizer_state_tensors(self.optimizer),
            "comm": [b.reduced for b in self.buckets if b.reduced is not None],
        }

    def feedback_owners(self) -> list[ShardedBuffer]:
        return list(self.buckets) if self.precision.error_feedback else []

    def _expert_group(self, b: ShardedBuffer) -> Any:
        """An expert buffer's EDP group (pieces.ShardGroup.group); None for the others,
        sharded over the mode's own shard group."""
        return b.mesh.shard if b.mesh is not self.mesh else None

    def shard_groups(self) -> list[ShardGroup]:
        # Rank r's slice of each bucket; the optimizer steps its pieces.
        return [
            ShardGroup(b.names, b.layout, b.master, b.pieces, True, self._expert_group(b))
            for b in self.buckets
        ]
