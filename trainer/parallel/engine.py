"""The interface the training loop talks to, whatever the mode.

    engine = build_engine(model, mode="ddp", optimizer=partial(AdamW, lr=1e-3))
    loss = loss_fn(engine(x), y)
    loss.backward()        # or engine.backward(loss): needed for fp16's loss scaling
    engine.step()          # True; in fp16 a device flag, False where it skipped

Each mode subclasses `Engine` in its own file and decides where gradients live and when
they are communicated (`_finish_backward`, `_step`). What every mode shares is here: the
end-of-backward callback, casting inputs and outputs, buffers that follow rank 0. fp16's
step is scaling.py's, clipping clipping.py's, frozen parameters' fp32 values precision.py's.

[Note: end of backward]
Users call `loss.backward()`, as with torch DDP and FSDP2, not a method of ours. The
first gradient hook of each backward pass queues `_end_backward` with autograd's
execution engine (`queue_callback`, what DDP and FSDP2 use); autograd runs it once the
whole backward pass is done, before `backward()` returns. There each mode waits for its
last collectives, reduces what got no gradient and hands gradients to the optimizer.
Several backwards before one step each run it; their gradients add up.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainer import comm
from trainer.comm import groups as comm_groups
from trainer.errors import ConfigError
from trainer.offload.host import HostOffload
from trainer.offload.state import OffloadedState
from trainer.parallel import clipping, pieces
from trainer.parallel.broadcast import broadcast_tensors
from trainer.parallel.experts import ExpertPlan
from trainer.parallel.pieces import ShardGroup
from trainer.parallel.precision import FrozenMasters, Precision
from trainer.parallel.scaling import LossScaler, can_skip_on_device

# Called with the tensors to step: a list of tensors, or of param-group dicts.
OptimizerFactory = Callable[[Iterable[Any]], torch.optim.Optimizer]
# Optimizer options of one parameter, by name: {} for the defaults, {"weight_decay": 0.0}.
ParamGroupFn = Callable[[str, nn.Parameter], dict[str, Any]]


class Engine(ABC):
    """Wraps a model for one data-parallel mode. Subclasses decide where gradients live
    and how they are communicated (`_finish_backward`, `shard_groups`, ...) and build
    `optimizer` over the tensors they step."""

    name = "base"
    shards_parameters = False  # True: each rank keeps 1/P of the parameters' state
    builds_from_meta = False  # takes a model on meta and allocates only its own slices
    optimizer: torch.optim.Optimizer  # set by each mode's constructor
    # What the formulas of memory.py ([Note: the expected figures]) need to know of a mode:
    sharded_kinds: frozenset[str] = frozenset()  # model-state kinds divided over the P ranks
    masters_are_params = False  # its only persistent parameters are the fp32 shards
    grads_sent = 0.0  # gradient bytes sent per rank and step, in (P-1)/P · Ψ·r
    params_sent = 0.0  # parameter bytes sent per rank and step, in (P-1)/P · Ψ·b

    def __init__(
        self,
        module: nn.Module,
        precision: Precision | None = None,
        scaler: LossScaler | None = None,
        device: torch.device | None = None,
        experts: ExpertPlan | None = None,
    ):
        self.module = module
        # Expert parallelism ([Note: expert parameters in every mode] in experts.py): the
        # expert parameters this rank holds, reduced and sharded over the EDP group.
        self.experts = experts
        self.world_size = comm.world_size()
        self.rank = comm.rank()
        # The ranks a sharding mode splits its state over ([Note: hybrid sharding] in
        # comm/groups.py): all of them unless the mode was given a shard group size.
        self.mesh = comm_groups.Mesh(None, None, self.world_size, self.rank, 1)
        # [Note: master weights] in trainer/parallel/precision.py. Each mode builds its fp32
        # masters from the module's fp32 values, then casts the module.
        self.precision = precision or Precision()
        # where the model's state lives (given for a model whose parameters are on meta)
        self.device = device or next((p.device for p in module.parameters()), torch.device("cpu"))
        self.scaler = (scaler or LossScaler(enabled=False)).to(self.device)
        self._module_buffers = [b for b in module.buffers()]
        self._buffers_changed = False  # a training forward ran since the last broadcast
        self._sync = True
        self._in_backward = False  # [Note: end of backward]: the callback is queued
        self.frozen = FrozenMasters()  # fp32 values of frozen parameters, if cast
        # mode.offload=disk: the optimizer state in a file between steps (offload/state.py)
        self.offload: OffloadedState | HostOffload | None = None
        # Replica groups' per-step sync, sent bucket by bucket behind this rank's own
        # reduction where the mode can ([Note: across replica groups during backward] in
        # comm/replicas.py): set by the replica groups for one step; `sent_across` says
        # that step's gradients went across during backward.
        self.across: Any = None
        self.sent_across = False
        self.across_ok = False  # whether this mode's reduction can carry `across`

    def across_now(self) -> Any:
        """The step's `across` where this engine's reduction carries it, else None."""
        return self.across if self.across_ok else None

    # -- forward -------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.module.training or self._buffers_changed:
            # As torch DDP's broadcast_buffers: running statistics follow rank 0 before
            # every training forward and before the first other forward after one (an
            # eval right after training), since a training forward updates them.
            self._broadcast_buffers()
        self._buffers_changed = self.module.training
        cast_in = self.precision.cast_in
        out = self.module(*cast_in(args), **cast_in(kwargs))
        return self.precision.cast_out(out)

    def _broadcast_buffers(self) -> None:
        if self._module_buffers and self.world_size > 1:
            broadcast_tensors(self._module_buffers)

    # -- backward and step ----------------------------------------------------------------
    def backward(self, loss: torch.Tensor) -> None:
        """`loss.backward()`, with the loss scaled first in fp16 ([Note: dynamic loss
        scaling]); in fp32 and bf16 the same as calling `loss.backward()` directly."""
        self.scaler.backward(loss)

    def _begin_backward(self) -> None:
        """Called by every gradient hook of the modes; the first one of a backward pass
        queues `_end_backward` ([Note: end of backward])."""
        if self._in_backward:
            return
        if self.scaler.enabled and not self.scaler.scaling:
            self.zero_grad()  # before this backward communicated anything, on every rank
            self.scaler.refuse_unscaled()
        self._in_backward = True
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _end_backward(self) -> None:
        self._in_backward = False
        self.scaler.found_inf = None  # new gradients: not unscaled yet
        self._finish_backward()

    def step(self) -> bool | torch.Tensor:
        """Update the parameters. Returns whether it did: True in fp32 and bf16; in fp16 a
        0-d bool tensor on the device, False where the gradients overflowed on some rank
        and every rank skipped the step ([Note: dynamic loss scaling]). `if
        engine.step():` still works, at the cost of a host read in fp16; the training
        loop hands the flag on instead (lr schedule, metrics)."""
        if not self.scaler.enabled:
            self._step()
            return True
        self._unscale()
        owners = [b for b in self.feedback_owners() if b.error is not None]
        before = self.scaler.scale.clone() if owners else None
        stepped = self.scaler.step(self.optimizer, self._step, self.zero_grad)
        if owners:
            # Error feedback's errors are in loss-scaled units, as the gradients they
            # join (ddp's owner errors too, of the mean of such gradients): a new scale
            # rescales them (a power of two, exact), on the device.
            ratio = self.scaler.scale / before
            for b in owners:
                b.error.mul_(ratio)
                if b.owner_error is not None:
                    b.owner_error.mul_(ratio)
        return stepped

    @property
    def skips_on_device(self) -> bool:
        """fp16 with an optimizer that skips an overflowed step on the device itself: no
        host read per step ([Note: dynamic loss scaling])."""
        return self.scaler.enabled and can_skip_on_device(self.optimizer)

    def _unscale(self) -> torch.Tensor | None:
        """fp16: the gradients unscaled once per step; the ranks' agreed found-inf flag."""
        return self.scaler.unscale_agreed(lambda: self.grad_tensors()[0])

    # -- what every mode implements -----------------------------------------------------
    @abstractmethod
    def _finish_backward(self) -> None:
        """The end of a backward pass ([Note: end of backward]): the mode's last
        collectives, waited for; gradients handed to what the optimizer steps."""

    @torch.no_grad()
    def _step(self) -> None:
        if self.offload is None:
            self.optimizer.step()
            self.zero_grad()
            self.params_from_masters()
        else:  # buffer by buffer, each brought up to date as it steps: the disk path while
            # its state is read back ([Note: offloaded state]), the host path copying its
            # master up ([Note: host offload])
            self.offload.step()
            self.zero_grad()

    def params_from_masters(self) -> None:
        """Bring the module's compute-precision parameters up to date with the masters
        (after a step, after loading a checkpoint). Modes whose module parameters are not
        what the optimizer steps implement it."""
        return None  # fsdp: the optimizer steps the shards, gathered before each use

    def zero_grad(self) -> None:
        """Drop accumulated gradients without stepping (e.g. a skipped non-finite step)."""
        self.optimizer.zero_grad(set_to_none=True)

    @torch.no_grad()
    def full_state_dict(self, rank0_only: bool = False) -> dict[str, torch.Tensor]:
        """Unsharded state with the keys of `module.state_dict()`, as CPU copies: fp32
        parameters from the masters, floating buffers in fp32. A collective in the modes
        that shard: every rank must call it. `rank0_only`: gathered to rank 0 one group
        at a time, {} on the other ranks ([Note: gathering to rank 0] in pieces.py)."""
        groups = self.shard_groups()
        whole = dict(
            pieces.whole_values(groups, self.mesh, rank0_only, self._masters_in_memory, self.device)
        )
        if self.experts is not None:  # each rank's experts, then over their EP group
            self.experts.gather_rows(whole, self.device)
        if rank0_only and self.rank != 0:
            return {}
        named = dict(self.module.named_parameters())
        by_id = {id(named[n]): t for n, t in whole.items()}
        state = self.module.state_dict(keep_vars=True)  # buffers, frozen params: whole
        return {
            k: by_id[id(v)] if id(v) in by_id else self.frozen.copy(v) for k, v in state.items()
        }

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The tensors this rank holds by kind, for memory accounting from live storages
        (observe/memory.py): "params" (what forward computes with), "master" (fp32 copies
        the optimizer steps), "grads", "optimizer", "comm" (buffers kept for
        communication). Modes that keep other storage (shards, flat buffers) override it."""
        params = list(self.module.parameters())
        return {
            "params": params,
            "master": self.frozen.tensors(),
            "grads": [p.grad for p in params if p.grad is not None],
            "optimizer": optimizer_state_tensors(self.optimizer),
            "comm": [],
        }

    def working_set_bytes(self) -> int:
        """Bytes held only while a step runs, beyond the model state (fsdp's gathered
        units); what memory.py adds to its formula for the working set."""
        return 0

    def traffic_beyond_formula(self) -> float:
        """Bytes this rank sent in the last step beyond its mode's ring formula (fsdp:
        units gathered again for a later call); memory.py adds them to the expected
        traffic."""
        return 0.0

    # -- gradient clipping -------------------------------------------------------------
    def grad_tensors(self) -> tuple[list[torch.Tensor], bool]:
        """The gradients this rank holds after backward, and whether they are shards.

        Unsharded (ddp): every rank holds the same full, averaged gradients. Sharded
        (zero, fsdp): each rank holds its 1/P slice of the flat buffers; the padding at
        the end is zero, so it adds nothing to a norm.
        """
        return [p.grad for p in self.module.parameters() if p.grad is not None], False

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale the gradients so that their global L2 norm is at most `max_norm`; return
        the norm before clipping, as `torch.nn.utils.clip_grad_norm_` does on one process.
        Call it after `backward()` and before `step()`, on every rank (clipping.py)."""
        self._unscale()  # clip the true gradients, not the loss-scaled ones
        grads, sharded = self.grad_tensors()
        ep = self.experts.groups.ep if self.experts is not None else None
        split = self.expert_grads()
        return clipping.clip_grad_norm_(
            grads, max_norm, sharded, self.mesh.shard, self.device, split, ep
        )

    def expert_grads(self) -> list[torch.Tensor]:
        """Of `grad_tensors()`, the whole gradients of this rank's experts, in a mode that
        does not shard them (ddp): its EP group's ranks hold different experts. Sharded
        modes hold slices of every parameter, experts included: []."""
        return []

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the first backward outside communicates."""
        prev, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = prev

    @property
    def training(self) -> bool:
        return self.module.training

    def train(self, mode: bool = True) -> Engine:
        self.module.train(mode)
        return self

    def eval(self) -> Engine:
        return self.train(False)

    # -- offload ----------------------------------------------------------------------------
    def offload_state(self, path: Path) -> None:
        """mode.offload=disk: keep this rank's optimizer state in a file at `path` between
        steps ([Note: offloaded state] in trainer/offload/state.py). The sharding modes
        implement it; build_engine refuses the others first."""
        raise ConfigError(f"mode.offload=disk: mode={self.name} keeps no sharded state to offload")

    def offload_to_host(self) -> None:
        """mode.offload=host: this rank's masters and optimizer state in host memory,
        stepped there ([Note: host offload] in trainer/offload/host.py). The sharding
        modes implement it; build_engine refuses the others first."""
        raise ConfigError(f"mode.offload=host: mode={self.name} keeps no sharded state to offload")

    def _masters_in_memory(self, i: int) -> AbstractContextManager:
        """Inside: shard group i's values (`local`) in memory, where offload moved them."""
        if self.offload is None or not self.offload.move_masters:
            return nullcontext()
        return self.offload.masters(i)

    def close(self) -> None:
        """What the engine holds outside memory, released: the offload file is removed.
        The run calls it once it is done with the engine, on success or error."""
        if self.offload is not None:
            self.offload.close()

    # -- checkpoints (trainer/checkpoint/; the layout code is in state.py) -------------------
    @abstractmethod
    def shard_groups(self) -> list[ShardGroup]:
        """Where this rank's trainable state lives, one group per flat buffer of the mode
        (ddp: one per parameter), in a fixed order."""

    def feedback_owners(self) -> list[Any]:
        """The gradient buffers whose `error` (error feedback's last quantization error
        of this rank, None until their first int8 reduction) and `owner_error` (that of
        the AllGathered sum of the chunk this rank owns, ddp's AllReduce; None elsewhere)
        a checkpoint saves, in a fixed order, each with its `params` ([Note: error
        feedback in a checkpoint] in state.py). None of them without
        `mode.error_feedback`."""
        return []


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
