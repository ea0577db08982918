"""mode=zero (ZeRO-2): full parameters everywhere; gradients and optimizer state sharded.
What it holds and sends per step: the mode table in README.md (memory.py checks runs
against it).

Parameters are bucketed as in ddp ([Note: buckets in order] in buckets.py). Each bucket
keeps its parameters end to end in one flat buffer padded to a multiple of the world
size P, every parameter's `.data` being a view into it. Rank r owns the slice
[r*S, (r+1)*S) of each buffer; the optimizer steps one piece of that slice per parameter
([Note: per-parameter optimizer tensors] in pieces.py), so its state is 1/P of the
model's and padding belongs to no piece.

    backward   a post-accumulate-grad hook copies each gradient into its bucket's flat
               gradient buffer and drops autograd's `.grad`. Buckets are ReduceScattered
               (averaged) in order as they complete, overlapping the rest of backward;
               each rank keeps the (S,) mean of its slice and the full (padded,) buffer
               is freed ([Note: bounded buckets]). The last bucket's collective carries
               the used-flags ([Note: used flags] in used.py).
    step       the optimizer updates this rank's slice in place; an in-place AllGather
               per bucket then brings every rank's updated slice into the full
               parameters.

Mixed precision ([Note: master weights] in precision.py): the flat buffers hold the
parameters in `param_dtype` and each rank's slice has an fp32 master the pieces view;
after the step the master is cast into the slice and the AllGather moves `param_dtype`.
Gradients are reduced in `reduce_dtype` and kept in fp32 beside the masters.

With `shard_group_size=S` the buckets are cut into S slices, not P: the ranks of one
shard group split the state, the P/S groups hold replicas ([Note: hybrid sharding] in
comm_groups.py).

Build the engine after moving the model to its device: `.to()` would replace the views.
Parameters with different optimizer options (`param_options`) are bucketed apart, so a
bucket's pieces share one param group.

[Note: bounded buckets]
ZeRO-2 that keeps every full bucket until backward ends peaks at a full gradient copy and
saves nothing. Launching a bucket therefore first releases the oldest one if more than
`_MAX_IN_FLIGHT` are in flight: waits for its ReduceScatter and frees the full-size
input (a double buffer, so backward blocks only when communication falls two buckets
behind; on CUDA the compute stream waits, the CPU does not). Its reduced slice (1/S of
the bucket) is kept, and only the end-of-backward callback turns the slices into the
pieces' gradients, as FSDP2 keeps its ReduceScatter outputs until then
(`reduce_scatter_max_input_buffers` is its bound on inputs). With replicas ([Note:
hybrid sharding] in comm_groups.py) the release also starts the slice's AllReduce
across them, which overlaps the rest of backward and is waited for in the callback.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn

from trainer import comm
from trainer.comm import groups as comm_groups
from trainer.flat import FlatLayout, ScatterInput, bucketize
from trainer.parallel import pieces
from trainer.parallel.buckets import BucketQueue
from trainer.parallel.engine import (
    Engine,
    OptimizerFactory,
    ParamGroupFn,
    ShardGroup,
    optimizer_state_tensors,
    param_groups,
    split_by_options,
)
from trainer.parallel.used import UsedFlags
from trainer.precision import GradAccumulator, Precision
from trainer.scaling import LossScaler

_MAX_IN_FLIGHT = 2  # ReduceScatters allowed in flight before the oldest is waited for


class _Bucket:
    def __init__(
        self,
        index: int,
        named: Sequence[tuple[str, nn.Parameter]],
        flags: Sequence[int],
        world_size: int,
        rank: int,
        precision: Precision,
        options: dict,
    ):
        self.index = index
        self.options = options  # optimizer options of every parameter in it
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.layout = FlatLayout.of(self.params, world_size)
        p0 = self.params[0]
        # (padded,) the full parameters; zero padding at the end.
        self.flat = torch.zeros(self.layout.padded_numel, dtype=p0.dtype, device=p0.device)
        with torch.no_grad():
            self.layout.copy_in(self.flat, self.params)
        n = self.layout.shard_size(world_size)
        # (S,) the values the optimizer steps: an fp32 master of this rank's slice when
        # mixed (then the buffer is cast), else the slice itself (no extra copy).
        self.shard = self.flat[rank * n : (rank + 1) * n]
        if precision.mixed:
            self.shard = self.shard.float().clone()
            self.flat = self.flat.to(precision.param_dtype)
        for p, view in zip(self.params, self.layout.views(self.flat), strict=True):
            p.data = view  # the AllGather after the step writes the parameters in place
        self.shard_data = self.flat[rank * n : (rank + 1) * n]  # (S,) this rank's slice
        self.pieces = pieces.cut(self.names, flags, self.layout, self.shard, rank)
        self.reduce_dtype = precision.reduce_dtype
        self.world_size = world_size
        self.slot = {id(p): i for i, p in enumerate(self.params)}
        self.grad: ScatterInput | None = None  # (P, S + extra) filled in backward, then freed
        self.extra = 0  # control elements each row carries (the last bucket's used-flags)
        self.reduced: torch.Tensor | None = None  # (S + extra,) ReduceScatter output
        self.shard_grad: torch.Tensor | None = None  # (S,) fp32, the pieces' gradients
        self.handle: comm.Handle | None = None

    def write_grad(self, p: nn.Parameter, grad: torch.Tensor | None) -> None:
        """`p`'s gradient (or zeros) into its slot of the flat gradient buffer."""
        if self.grad is None:
            # Slots are all written (a gradient, or zeros for a parameter that got none):
            # only the padding is zeroed, so no memset of the whole buffer.
            self.grad = ScatterInput(
                self.layout, self.world_size, self.extra, self.reduce_dtype, self.flat.device
            )
        if grad is None:
            self.grad.zero(self.slot[id(p)])
        else:
            self.grad.write(self.slot[id(p)], grad)


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
    ):
        super().__init__(module, precision, scaler)
        self.mesh = comm_groups.mesh(shard_group_size)  # [Note: hybrid sharding]
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self._names = {id(p): n for n, p in named}
        self._used = UsedFlags([p for _, p in named])  # [Note: used flags]
        # Buckets never mix optimizer groups (a bucket's pieces share a param group): each
        # group is bucketed on its own, so a second group's buckets (e.g. no weight decay:
        # biases and norms of every layer) fill, and launch, only as backward ends.
        grouped = [
            (opts, ps)
            for opts, pairs in split_by_options(named, param_options)
            for ps in bucketize([p for _, p in pairs], int(bucket_mb * 2**20))
        ]
        self.buckets = [
            _Bucket(
                i,
                [(self._names[id(p)], p) for p in ps],
                [self._used.index[id(p)] for p in ps],
                self.mesh.size,
                self.mesh.rank,
                self.precision,
                opts,
            )
            for i, (opts, ps) in enumerate(grouped)
        ]
        self.buckets[-1].extra = len(self._used)  # the last bucket carries the flags
        if self.precision.mixed:  # buffers and frozen parameters; bucketed ones are cast
            self._cast_module()
        self._queue = BucketQueue(self.buckets, self._names, self._launch, self.name)
        self._in_flight: list[_Bucket] = []  # ReduceScatters launched, in launch order
        self._reduced: list[_Bucket] = []  # inputs freed; results (or AllReduces) pending
        self._flags: torch.Tensor | None = None  # reduced used-flags of this step
        self._sums = GradAccumulator()  # no_sync gradients of low-precision parameters
        for b in self.buckets:
            for p in b.params:
                p.register_post_accumulate_grad_hook(self._hook(b))
        self.optimizer = optimizer(
            param_groups(
                (b.options, t)
                for b in self.buckets
                for t in pieces.optimizer_tensors(b.pieces, b.shard)
            )
        )

    # -- backward: gradients into buckets, buckets ReduceScattered into shards -------------
    def _hook(self, bucket: _Bucket):
        def on_grad_ready(p: nn.Parameter) -> None:
            self._begin_backward()
            self._used.mark(p)
            if not self._sync:
                # no_sync: the full gradient accumulates in p.grad (autograd), or in the
                # reduce dtype when p computes in a lower one
                self._sums.add(p, bucket.reduce_dtype)
                return
            bucket.write_grad(p, self._sums.take(p))  # frees autograd's full-size gradient
            self._queue.ready(bucket, p)

        return on_grad_ready

    def _launch(self, b: _Bucket) -> None:
        for p in b.params:
            if not self._queue.has_gradient(p):
                # No gradient in this backward: reduce what no_sync accumulated, or zero.
                b.write_grad(p, self._sums.take(p))
        if b.extra:  # the last bucket, launched last: every parameter's use is known
            self._used.fill(b.grad.control)
        b.reduced = torch.empty(b.grad.shard + b.extra, dtype=b.reduce_dtype, device=b.flat.device)
        b.handle = comm.reduce_scatter(
            b.reduced, b.grad.input, average=True, tag=f"bucket{b.index}", group=self.mesh.shard
        )
        self._in_flight.append(b)
        if len(self._in_flight) > _MAX_IN_FLIGHT:  # [Note: bounded buckets]
            self._release(self._in_flight.pop(0))

    def _release(self, b: _Bucket) -> None:
        """Wait for `b`'s ReduceScatter and free its full-size input; with replicas, start
        averaging the reduced slice across them ([Note: hybrid sharding])."""
        b.handle.wait()
        # Dropping the handle too: an in-flight op may hold references to its buffers.
        b.grad = b.handle = None
        if self.mesh.replicate is not None:
            b.handle = comm.all_reduce(
                b.reduced, average=True, tag=f"bucket{b.index}", group=self.mesh.replicate
            )
        self._reduced.append(b)

    def _collect(self, b: _Bucket) -> None:
        """`b`'s averaged slice into the gradient the pieces see."""
        if b.handle is not None:
            b.handle.wait()
        s = b.reduced.numel() - b.extra
        reduced = b.reduced[:s].float()  # the masters' dtype; no copy when already fp32
        if b.extra:
            self._flags = b.reduced[s:]
        if b.shard_grad is None:
            b.shard_grad = reduced
        else:  # several synced backwards before a step accumulate, as in torch
            b.shard_grad.add_(reduced)
        b.reduced = b.handle = None

    def _finish_backward(self) -> None:
        if not self._sync:
            return
        # Buckets still pending hold parameters that got no gradient in this backward.
        self._queue.launch(force=True)
        self._queue.reset()
        while self._in_flight:
            self._release(self._in_flight.pop(0))
        while self._reduced:
            self._collect(self._reduced.pop(0))
        unused = self._used.unused_everywhere(self._flags)
        for b in self.buckets:
            pieces.hand_out(b.pieces, b.shard_grad, unused)
        self._flags = None

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the first backward outside reduces them.

        Memory cost: while inside, autograd keeps a full-size `.grad` on every parameter
        (4Ψ bytes in fp32, as in ddp; with bf16 parameters a sum in the fp32 reduce dtype,
        as FSDP2 keeps) on top of the sharded state, until the next synced backward
        copies each into its bucket and frees it.
        """
        with super().no_sync():
            yield

    # -- step: update the shards, AllGather them into the full parameters ------------------
    @torch.no_grad()
    def _params_from_masters(self) -> None:
        if self.precision.mixed:
            for b in self.buckets:
                b.shard_data.copy_(b.shard)  # rounds this rank's slice to param_dtype
        # Launch all, then wait all: the AllGathers overlap each other. Each rank's input
        # is its own slice of the output buffer, so the gather runs in place.
        handles = [
            comm.all_gather(b.flat, b.shard_data, tag=f"bucket{b.index}", group=self.mesh.shard)
            for b in self.buckets
        ]
        comm.wait_all(handles)

    def grad_tensors(self) -> tuple[list[torch.Tensor], bool]:
        # This rank's (S,) slice of each bucket's averaged gradient; padding is zero, and
        # so are the slots of parameters that no rank used.
        return [b.shard_grad for b in self.buckets if b.shard_grad is not None], True

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        for b in self.buckets:
            b.shard_grad = None
        for p in self.module.parameters():
            p.grad = None  # left by a no_sync backward that was never synced
        self._sums.clear()
        self._used.clear()

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """Params are the flat buffers (model params and shards are views of them); grads
        are the shard grads, live bucket buffers and any `.grad` left by no_sync."""
        in_buckets = {id(p) for b in self.buckets for p in b.params}
        model = list(self.module.parameters())
        frozen = [p for p in model if id(p) not in in_buckets]
        shard_grads = [b.shard_grad for b in self.buckets if b.shard_grad is not None]
        bucket_grads = [b.grad.rows for b in self.buckets if b.grad is not None]
        local_grads = [p.grad for p in model if p.grad is not None]
        return {
            "params": [b.flat for b in self.buckets] + frozen,
            # fp32 masters when mixed; otherwise views of `flat`, counted there already
            "master": [b.shard for b in self.buckets] + [*self._frozen.values()],
            "grads": shard_grads + bucket_grads + local_grads + self._sums.tensors(),
            "optimizer": optimizer_state_tensors(self.optimizer),
            "comm": [b.reduced for b in self.buckets if b.reduced is not None],
        }

    def shard_groups(self) -> list[ShardGroup]:
        # Rank r's slice of each bucket; the optimizer steps its pieces.
        return [ShardGroup(b.names, b.layout, b.shard, b.pieces, True) for b in self.buckets]
