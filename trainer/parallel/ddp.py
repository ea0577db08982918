"""mode=ddp: every rank keeps everything; gradient buckets are AllReduced during backward.

Each bucket is one flat tensor and every parameter's `.grad` is a view into it, so the
AllReduce works on the gradients in place, with no copies. A post-accumulate-grad hook
reports each parameter's gradient to the bucket queue, which launches a complete
bucket's AllReduce asynchronously, strictly in bucket order ([Note: buckets in order] in
buckets.py), while backward carries on with earlier layers. All handles are waited for
in one place, the end of backward, which also launches the buckets still pending; it runs
from autograd's end-of-backward callback ([Note: end of backward] in engine.py), so a
plain `loss.backward()` works.

Parameters no rank used get no gradient, as in torch DDP: the last bucket carries one
used-flag per parameter ([Note: used flags] in used.py). Buckets in another dtype than the
parameters (mixed precision, int8): [Note: ddp's reduce dtype], beside `DDPEngine`.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn

from trainer import comm
from trainer.comm.quantized import chunk_of, prepare_all_reduce_int8
from trainer.parallel.buckets import BucketQueue
from trainer.parallel.engine import Engine, OptimizerFactory, ParamGroupFn, ShardGroup
from trainer.parallel.experts import ExpertPlan
from trainer.parallel.flat import FlatLayout, bucketize
from trainer.parallel.pieces import Piece, param_groups
from trainer.parallel.precision import Precision
from trainer.parallel.scaling import LossScaler
from trainer.parallel.used import UsedFlags


class _Bucket:
    def __init__(
        self,
        index: int,
        params: Sequence[nn.Parameter],
        dtype: torch.dtype,
        extra: int = 0,
        group: Any = None,
    ):
        self.index = index
        self.group = group  # AllReduced over it: None for all ranks, the EDP group for experts
        self.params = list(params)
        self.layout = FlatLayout.of(self.params)
        p0 = self.params[0]
        # (numel + extra,): the gradients, then `extra` flags ([Note: used flags])
        self.buffer = torch.zeros(self.layout.numel + extra, dtype=dtype, device=p0.device)
        self.grad = self.buffer[: self.layout.numel]
        self.views = self.layout.views(self.grad)
        self.handle: comm.Handle | None = None
        self.masters: list[nn.Parameter] = list(self.params)  # fp32 copies when mixed
        # error feedback's last errors (reduce int8, [Note: error feedback on both
        # roundings] in comm/quantized.py): (P, chunk) of this rank's send, (chunk,) of
        # the mean it owns and AllGathers
        self.error: torch.Tensor | None = None
        self.owner_error: torch.Tensor | None = None


# [Note: ddp's reduce dtype]
# Buckets hold gradients in `reduce_dtype` ([Note: master weights] in
# trainer/parallel/precision.py). When that is the parameters' dtype the `.grad` views work
# as the module docstring says; otherwise the hook adds each gradient into its slot,
# casting, and drops autograd's (under no_sync too, so micro-batches accumulate in the
# reduce dtype). After the AllReduce the fp32 master of every parameter gets its slice of
# the bucket (or of an fp32 copy of it) as `.grad`; the optimizer steps the masters and the
# module's parameters are cast from them.
#
# With `reduce_dtype=int8` the fp32 buckets are AllReduced as int8 blocks both ways
# (comm/quantized.py `all_reduce_int8`: quantized, all-to-all, summed in fp32 by each
# chunk's owner, quantized once more and AllGathered), every rank keeping the same
# dequantized mean; both phases are launched while backward runs, the AllGather as soon as
# the all-to-all has arrived ([Note: int8 AllReduce in two chained phases]). With
# `mode.error_feedback` both roundings are fed back: each rank keeps its send's errors and
# those of the chunk's mean it owns ([Note: error feedback on both roundings]).
class DDPEngine(Engine):
    name = "ddp"
    grads_sent = 2.0  # AllReduce

    def __init__(
        self,
        module: nn.Module,
        optimizer: OptimizerFactory,
        bucket_mb: float = 25.0,
        precision: Precision | None = None,
        scaler: LossScaler | None = None,
        param_options: ParamGroupFn | None = None,
        experts: ExpertPlan | None = None,
    ):
        super().__init__(module, precision, scaler, experts=experts)
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self._names = {id(p): n for n, p in module.named_parameters()}
        mp = self.precision
        cap = int(bucket_mb * 2**20)
        # Expert parameters ([Note: expert parameters in every mode] in experts.py) have
        # buckets of their own, AllReduced over the EDP group; they launch before the
        # last dense bucket (the first layers', whose gradients come last), which
        # carries the used-flags over all ranks.
        expert = [p for _, p in named if experts is not None and experts.holds(p)]
        dense = bucketize([p for _, p in named if not (experts and experts.holds(p))], cap)
        edp = experts.groups.edp if experts is not None else None
        grouped = [(ps, None) for ps in dense[:-1]]
        grouped += [(ps, edp) for ps in bucketize(expert, cap)] + [(dense[-1], None)]
        params = [p for ps, _ in grouped for p in ps]
        self.buckets = [
            _Bucket(i, ps, mp.reduce_dtype, len(params) if i == len(grouped) - 1 else 0, group)
            for i, (ps, group) in enumerate(grouped)
        ]
        if mp.reduce_int8:  # the groups of the AllGathers, made here at the same point on
            # every rank ([Note: int8 AllReduce in two chained phases] in comm/quantized.py)
            for group in {id(b.group): b.group for b in self.buckets}.values():
                prepare_all_reduce_int8(group)
        params = [p for _, p in named]
        # [Note: used flags]: this rank's use of each parameter, in the last bucket
        self._flags = self.buckets[-1].buffer[self.buckets[-1].layout.numel :]  # (n,)
        self._used = UsedFlags(params)
        self._skipped: set[int] = set()  # positions whose .grad is None until the next step
        self._had_backward = False  # a backward (synced or under no_sync) since the last step
        if mp.mixed:  # fp32 masters from the fp32 values, then the module is cast
            for b in self.buckets:
                b.masters = [nn.Parameter(p.detach().float().clone()) for p in b.params]
            self.frozen.cast(self.module, self.precision.param_dtype)
        # [Note: ddp's reduce dtype]: .grad views into the buckets when dtypes allow, else
        # copies into them
        self._views = all(p.dtype == mp.reduce_dtype for p in params)
        self._separate_grads = mp.mixed or not self._views  # masters get their own .grad
        # Sent across replica groups bucket by bucket where every bucket holds fp32
        # gradients reduced over all ranks ([Note: across replica groups during backward])
        self.across_ok = not mp.reduce_int8 and all(
            b.buffer.dtype == torch.float32 and b.group is None for b in self.buckets
        )
        names = {id(p): n for n, p in named}
        self._queue = BucketQueue(self.buckets, names, self._launch, self.name)
        for b in self.buckets:
            for p, view in zip(b.params, b.views, strict=True):
                if self._views:
                    p.grad = view  # autograd accumulates into the bucket in place
                p.register_post_accumulate_grad_hook(self._hook(b, view))
        master = {id(p): m for b in self.buckets for p, m in zip(b.params, b.masters, strict=True)}
        self._masters = [(p, master[id(p)]) for p in params]  # module order
        self._view_of = {
            id(p): v for b in self.buckets for p, v in zip(b.params, b.views, strict=True)
        }
        # Every parameter is its own tensor to the optimizer: any grouping works.
        opts = {id(p): param_options(n, p) if param_options else {} for n, p in named}
        self.optimizer = optimizer(param_groups((opts[id(p)], m) for p, m in self._masters))

    def _hook(self, bucket: _Bucket, view: torch.Tensor):
        def on_grad_ready(p: torch.Tensor) -> None:
            self._begin_backward()
            if not self._views:
                view.add_(p.grad)  # casts to the bucket's dtype; accumulates under no_sync
                p.grad = None
            elif p.grad is not view:
                # Someone replaced .grad (e.g. set it to None): put it back into the bucket.
                view.copy_(p.grad)
                p.grad = view
            self._used.mark(p)
            if self._sync:
                self._queue.ready(bucket, p)

        return on_grad_ready

    def _launch(self, b: _Bucket) -> None:
        if b is self.buckets[-1]:  # launched last: every parameter's use is known by now
            self._used.fill(self._flags)
        mp, tag = self.precision, f"bucket{b.index}"
        if mp.reduce_int8:  # [Note: int8 on the wire]: in, summed and out as int8 blocks
            flags = b.buffer.numel() - b.layout.numel  # the used-flags travel exactly
            if mp.error_feedback and b.error is None:
                p = comm.world_size(b.group)
                b.error = torch.zeros(p, chunk_of(b.layout.numel, p), device=b.buffer.device)
            if mp.error_feedback and b.owner_error is None:
                b.owner_error = torch.zeros(b.error.shape[1], device=b.buffer.device)
            b.handle = comm.all_reduce_int8(
                b.buffer, average=True, block=mp.quant_block, exact_tail=flags, error=b.error,
                owner_error=b.owner_error, tag=tag, group=b.group,
            )  # fmt: skip
        else:
            b.handle = comm.all_reduce(b.buffer, average=True, tag=tag, group=b.group)
        across = self.across_now()
        if across is not None:  # then across the groups, as soon as the group's mean is in
            b.handle = comm.chain(b.handle, lambda: across.send(b.grad))

    def _finish_backward(self) -> None:
        self._had_backward = True
        if not self._sync:  # local gradients, applied as they are if a step follows (torch DDP)
            return
        # Buckets still pending hold parameters that got no gradient in this backward
        # (their slots hold zeros, or gradients of earlier backwards and no_sync
        # micro-batches): reduce them too, in order, so every rank issues the same
        # collectives.
        self._queue.launch(force=True)
        self._queue.reset()
        across = self.across_now()
        with across.waiting() if across is not None else nullcontext():
            for b in self.buckets:
                b.handle.wait()
                b.handle = None
        self.sent_across = across is not None
        for b in self.buckets:
            if self._separate_grads:
                g = b.grad if b.grad.dtype == torch.float32 else b.grad.float()
                for m, v in zip(b.masters, b.layout.views(g), strict=True):
                    m.grad = v
        # Used by no rank since the last step: no gradient, as torch DDP.
        self._skipped = self._used.unused_everywhere(self._flags)
        for i in self._skipped:
            self._masters[i][1].grad = None

    def _step(self) -> None:
        if not self._had_backward:
            # No backward since the last step (an evaluation step, say): no parameter has
            # a gradient, as in one process, although the buckets' zeros sit in .grad.
            self._skipped = set(range(len(self._masters)))
            for _, m in self._masters:
                m.grad = None
        super()._step()

    @torch.no_grad()
    def params_from_masters(self) -> None:
        if self.precision.mixed:
            for b in self.buckets:
                for p, m in zip(b.params, b.masters, strict=True):
                    p.copy_(m)  # rounds to the compute dtype

    def grad_tensors(self) -> tuple[list[torch.Tensor], bool]:
        # Full averaged gradients, identical on every rank: the buckets, or the masters'.
        if self._separate_grads:
            return [m.grad for b in self.buckets for m in b.masters if m.grad is not None], False
        return [b.grad for b in self.buckets], False

    def _expert_group(self, p: nn.Parameter) -> Any:
        """The EDP group of an expert parameter (pieces.ShardGroup.group), else None."""
        if self.experts is None or not self.experts.holds(p):
            return None
        return self.experts.groups.edp

    def expert_grads(self) -> list[torch.Tensor]:
        grads, _ = self.grad_tensors()
        if self.experts is None:
            return []
        mine = [b for b in self.buckets if b.group is not None]
        held = {id(m.grad) for b in mine for m in b.masters} | {id(b.grad) for b in mine}
        return [g for g in grads if id(g) in held]

    def zero_grad(self) -> None:
        for b in self.buckets:
            b.grad.zero_()  # in place: every .grad stays a view into its bucket
            if self._separate_grads:
                for m in b.masters:
                    m.grad = None
        if self._views and not self._separate_grads:  # the masters are the params
            for i in self._skipped:
                p = self._masters[i][0]
                p.grad = self._view_of[id(p)]
        self._skipped = set()
        self._had_backward = False
        self._used.clear()

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        state = super().state_tensors()
        masters = [m for _, m in self._masters]
        state["master"] = (masters if self.precision.mixed else []) + self.frozen.tensors()
        # The buckets and, when separate, the masters' fp32 gradients.
        separate = [m.grad for m in masters if m.grad is not None]
        errors = [e for b in self.buckets for e in (b.error, b.owner_error) if e is not None]
        state["grads"] = [b.buffer for b in self.buckets] + separate + errors
        return state

    def feedback_owners(self) -> list[_Bucket]:
        return list(self.buckets) if self.precision.error_feedback else []

    def shard_groups(self) -> list[ShardGroup]:
        # Every rank holds every parameter whole: one unsharded group per parameter, its
        # values being the fp32 master the optimizer steps.
        return [
            ShardGroup(
                [name := self._names[id(p)]],
                FlatLayout.of([p]),
                m,
                [Piece(name, i, 0, m.numel(), m)],
                False,
                self._expert_group(p),
            )
            for i, (p, m) in enumerate(self._masters)
        ]
