"""One sharded flat buffer: what zero keeps per bucket and fsdp per unit, and the pipeline
that reduces its gradients. zero.py and fsdp.py differ in when they gather and reduce
these buffers, not in what a buffer is.

A buffer lays parameters end to end (flat.py's FlatLayout), padded to a multiple of the
shard group size N; rank r of the group owns slice r, elements [r*S, (r+1)*S):

    full        (N*S,)  every parameter, in the compute dtype; zero keeps it, fsdp only
                        while the unit runs (its parameters are views of it)
    master      (S,)    fp32 values of slice r: what the optimizer steps, in `pieces`
                        ([Note: per-parameter optimizer tensors] in pieces.py)
    grad_shard  (S,)    fp32 averaged gradient of slice r; the pieces' `.grad` view it

Reducing a buffer's gradients, the same in both modes (`Reducer`):

    fill -> ReduceScatter (average, + used-flag columns) -> release: wait, free the
    (N, S) input, start the AllReduce across replicas -> collect into grad_shard ->
    hand out to the pieces
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from trainer import comm
from trainer.comm.groups import Mesh
from trainer.comm.quantized import prepare_all_reduce_int8
from trainer.models.materialize import Request
from trainer.parallel import pieces
from trainer.parallel.engine import OptimizerFactory
from trainer.parallel.flat import FlatLayout, ScatterInput
from trainer.parallel.precision import Precision
from trainer.parallel.used import UsedFlags


class ShardedBuffer:
    """Parameters of one optimizer param group laid out flat; this rank's slice of them.

    `keep_full`: the full buffer lives as long as the buffer (zero). Then, in fp32, the
    master is the slice of `full` itself, no copy; otherwise it is a copy of its own,
    since `full` is freed (fsdp) or holds a lower precision (mixed precision)."""

    def __init__(
        self,
        tag: str,
        named: Sequence[tuple[str, nn.Parameter]],
        flags: Sequence[int],
        options: dict[str, Any],
        mesh: Mesh,
        precision: Precision,
        keep_full: bool,
        device: torch.device | None = None,
    ):
        self.tag = tag  # names its collectives in traces and byte counts
        self.mesh = mesh  # the ranks it is sharded over (experts': the EDP group)
        self.options = options  # optimizer options of every parameter in it
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.slot = {id(p): i for i, p in enumerate(self.params)}
        self.n_shards, self.shard_rank = mesh.shard_size, mesh.shard_rank
        self.layout = FlatLayout.of(self.params, self.n_shards)
        self.shard_numel = self.layout.shard_size(self.n_shards)  # S
        like = self.params[0]
        lo = self.shard_rank * self.shard_numel
        if like.is_meta:  # built on meta: the values come slice by slice (`slice_requests`)
            if keep_full:
                raise ValueError("a buffer that keeps `full` needs its parameters' values")
            self.master = torch.zeros(self.shard_numel, dtype=like.dtype, device=device)
            # freed by its owner before the next unit's buffers exist (fsdp)
            self.full = torch.empty(
                self.layout.padded_numel, dtype=precision.param_dtype, device=device
            )
        else:
            full = torch.zeros(self.layout.padded_numel, dtype=like.dtype, device=like.device)
            with torch.no_grad():
                self.layout.copy_in(full, [p.detach() for p in self.params])
            mine = full[lo : lo + self.shard_numel]
            # int8 AllGathers write dequantized values into `full`: the master stays apart
            separate = precision.mixed or precision.gather_int8
            self.master = mine if keep_full and not separate else mine.clone()  # (S,)
            self.full = full.to(precision.param_dtype)  # no copy in fp32
        self.pieces = pieces.cut(self.names, flags, self.layout, self.master, self.shard_rank)
        self.reduce_dtype = precision.reduce_dtype
        self.precision = precision  # int8 on the wire ([Note: int8 on the wire])
        if precision.reduce_int8 and mesh.replicate is not None:  # made at the same point
            prepare_all_reduce_int8(mesh.replicate)  # on every rank
        self.error: torch.Tensor | None = None  # (N, S) fp32: error feedback's last error
        # None: the AllReduce across groups (`Reducer`) has no error feedback, on neither
        # of its roundings ([Note: error feedback on both roundings] in comm/quantized.py)
        self.owner_error: torch.Tensor | None = None
        self.n_flags = 0  # used-flag columns its ReduceScatter carries ([Note: used flags])
        self.grad_shard: torch.Tensor | None = None  # (S,) fp32, summed over synced backwards
        # mode.offload=host: (S,) fp32 host buffer the step copies grad_shard into, and
        # what the pieces' `.grad` are views of ([Note: host offload] in offload/host.py)
        self.host_grad: torch.Tensor | None = None
        # In flight while it is reduced: the filled (N, S + n_flags) input, the output of
        # the ReduceScatter (S + n_flags,) and the handle of whichever collective runs.
        self.grad_input: ScatterInput | None = None
        self.reduced: torch.Tensor | None = None
        self.handle: comm.Handle | None = None

    @property
    def param_shard(self) -> torch.Tensor:
        """(S,) this rank's slice of `full`, in the compute dtype."""
        s = self.shard_numel
        return self.full[self.shard_rank * s : (self.shard_rank + 1) * s]

    @property
    def device(self) -> torch.device:
        """Where forward, backward and the collectives run: `full`'s device (with host
        offload, the master is on the host)."""
        return self.full.device

    def gather_full(self, shard: torch.Tensor, group: Any) -> comm.Handle:
        """AllGather every rank's slice into `full`: `shard` (this rank's slice in the
        compute dtype) as it is or, with gather_dtype=int8, this rank's fp32 master
        quantized ([Note: int8 on the wire] in precision.py)."""
        mp = self.precision
        if mp.gather_int8:
            master = self.master.detach()
            return comm.all_gather_int8(
                self.full, master, block=mp.quant_block, tag=self.tag, group=group
            )
        return comm.all_gather(self.full, shard, tag=self.tag, group=group)

    def slice_requests(self) -> list[Request]:
        """What this rank's slice holds of each parameter, as requests that write it into
        `master`: how a model built on the meta device gets its values (materialize.py)."""
        lo, hi = self.shard_rank * self.shard_numel, (self.shard_rank + 1) * self.shard_numel
        requests = []
        for name, p, o in zip(self.names, self.params, self.layout.offsets, strict=True):
            a, b = max(o, lo), min(o + p.numel(), hi)
            if a < b:
                requests.append(Request(name, p, a - o, b - o, self.master[a - lo : b - lo]))
        return requests

    def optimizer_tensors(self) -> list[tuple[dict[str, Any], torch.Tensor]]:
        """(options, tensor) of each piece: what the optimizer steps of this buffer."""
        return [(self.options, t) for t in pieces.optimizer_tensors(self.pieces, self.master)]

    # -- gradients -------------------------------------------------------------------------
    def write_grad(self, p: nn.Parameter, grad: torch.Tensor | None) -> None:
        """`p`'s gradient (zeros for None) into its slot of the gradient input."""
        if self.grad_input is None:
            # Every slot is written (a gradient or zeros) and the padding zeroed there: no
            # memset of the whole buffer.
            self.grad_input = ScatterInput(
                self.layout, self.n_shards, self.n_flags, self.reduce_dtype, self.device
            )
        if grad is None:
            self.grad_input.zero(self.slot[id(p)])
        else:
            self.grad_input.write(self.slot[id(p)], grad)

    def hand_out(self, unused: set[int]) -> None:
        """The pieces' `.grad`: views of `grad_shard`, None where no rank used the
        parameter since the last step ([Note: used flags] in used.py). With host offload,
        views of `host_grad`, which the step fills from `grad_shard`."""
        on_host = self.host_grad is not None and self.grad_shard is not None
        pieces.hand_out(self.pieces, self.host_grad if on_host else self.grad_shard, unused)


def build_optimizer(factory: OptimizerFactory, buffers: Sequence[ShardedBuffer]) -> Optimizer:
    """The optimizer over every piece of `buffers`, one param group per distinct options."""
    return factory(pieces.param_groups(t for b in buffers for t in b.optimizer_tensors()))


class Reducer:
    """The buffers of one backward being reduced, in launch order: ReduceScatters in
    flight, then (inputs freed) results pending until the end of backward.

    Each mode bounds how many ReduceScatters stay in flight (`release_beyond`): waiting
    for the oldest frees its full-size input, so memory stays bounded while the newest
    ones overlap the rest of backward. Every rank launches in the same order, and a
    rank waits only for collectives it launched earlier, which its peers launched
    earlier too ([Note: buckets in order] in buckets.py, [Note: one collective order on
    every rank] in schedule.py)."""

    def __init__(self, used: UsedFlags, across: Callable[[], Any] = lambda: None):
        self.used = used
        # the engine's `across_now`: each result is sent across replica groups once it is
        # in ([Note: across replica groups during backward] in comm/replicas.py)
        self.across = across
        self.in_flight: list[ShardedBuffer] = []
        self.pending: list[ShardedBuffer] = []  # inputs freed, results not yet taken

    def launch(self, b: ShardedBuffer) -> None:
        """The averaged ReduceScatter of `b`'s filled gradient input; the buffer carrying
        the used-flags fills them now, when every parameter's use is known."""
        if b.n_flags:
            self.used.fill(b.grad_input.control)
        b.reduced = torch.empty(b.shard_numel + b.n_flags, dtype=b.reduce_dtype, device=b.device)
        mp = b.precision
        if mp.reduce_int8:  # [Note: int8 on the wire]; the used-flags travel exactly
            if mp.error_feedback and b.error is None:
                b.error = torch.zeros(b.n_shards, b.shard_numel, device=b.device)
            b.handle = comm.reduce_scatter_int8(
                b.reduced, b.grad_input.input, average=True, block=mp.quant_block,
                exact_tail=b.n_flags, error=b.error, tag=b.tag, group=b.mesh.shard,
            )  # fmt: skip
        else:
            b.handle = comm.reduce_scatter(
                b.reduced, b.grad_input.input, average=True, tag=b.tag, group=b.mesh.shard
            )
        self.in_flight.append(b)

    def release_beyond(self, keep: int) -> None:
        """Release the oldest ReduceScatters until at most `keep` are in flight."""
        while len(self.in_flight) > keep:
            self._release(self.in_flight.pop(0))

    def _release(self, b: ShardedBuffer) -> None:
        """Wait for `b`'s ReduceScatter and free its full-size input; with replicas, start
        averaging the reduced slice across them ([Note: hybrid sharding] in
        comm/groups.py), overlapping the rest of backward. On CUDA the compute stream
        waits here, to reuse the input's memory; the host does not."""
        b.handle.wait()
        comm.free_storage(b.grad_input.rows)
        b.grad_input = b.handle = None
        if b.mesh.replicate is not None and b.precision.reduce_int8:  # across groups: int8
            b.handle = comm.all_reduce_int8(
                b.reduced, average=True, block=b.precision.quant_block, exact_tail=b.n_flags,
                tag=b.tag, group=b.mesh.replicate,
            )  # fmt: skip
        elif b.mesh.replicate is not None:
            b.handle = comm.all_reduce(b.reduced, average=True, tag=b.tag, group=b.mesh.replicate)
        across = self.across()
        if across is not None:  # then across replica groups, once the slice's mean is in
            first = b.handle if b.handle is not None else comm.Handle(None)
            b.handle = comm.chain(first, lambda: across.send(b.reduced[: b.shard_numel]))
        self.pending.append(b)

    def finish(self) -> torch.Tensor | None:
        """End of backward: every result into its buffer's `grad_shard` (several synced
        backwards before a step add up, as in torch); returns the reduced used-flags,
        or None when no buffer carried them."""
        self.release_beyond(0)
        flags = None
        across = self.across()
        with across.waiting() if across is not None else nullcontext():
            for b in self.pending:
                if b.handle is not None:
                    b.handle.wait()
        while self.pending:
            b = self.pending.pop(0)
            reduced = b.reduced[: b.shard_numel].float()  # no copy when already fp32
            if b.n_flags:
                flags = b.reduced[b.shard_numel :]
            if b.grad_shard is None:
                b.grad_shard = reduced
            else:
                b.grad_shard.add_(reduced)
            b.reduced = b.handle = None
        return flags
