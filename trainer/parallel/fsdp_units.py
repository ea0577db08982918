"""fsdp's units: the parameters of one submodule, gathered and freed together (`Unit`),
one `UnitBuffer` per optimizer param group, whose full buffer is allocated only while the
unit is gathered ([Note: parameters as views of one storage]). When each is gathered,
freed and reduced is fsdp.py's story.
"""

from __future__ import annotations

from typing import Any

import torch

from trainer import comm
from trainer.comm.groups import Mesh
from trainer.errors import ConfigError
from trainer.models.materialize import swap_into
from trainer.parallel.engine import ParamGroupFn
from trainer.parallel.experts import ExpertPlan
from trainer.parallel.pieces import split_by_options
from trainer.parallel.precision import Precision
from trainer.parallel.sharded import ShardedBuffer
from trainer.parallel.units import UnitPlan
from trainer.parallel.used import UsedFlags


class UnitBuffer(ShardedBuffer):
    """A unit's ShardedBuffer whose `full` buffer is allocated only while the unit is
    gathered; `master` is the fp32 slice (mixed precision: each AllGather sends it cast
    to the compute dtype, as FSDP2's MixedPrecisionPolicy does).

    [Note: parameters as views of one storage]
    Module parameters stay registered (the same objects autograd knows as leaves) with
    their values in the one persistent `full` buffer. Freeing resizes its storage to 0
    and points each parameter at an empty tensor, so code touching a freed parameter
    fails on its shape instead of reading freed memory. Gathering re-allocates the
    storage, AllGathers into it and points each parameter back at its view
    (`p.data = view`). Autograd saves parameters and views of them (`w.t()`) in forward;
    they share that storage, so they are valid again once the unit is gathered for its
    backward, while between forward and backward the memory is really free.
    `p.data = ...` swaps a tensor's storage behind autograd's back, which is unsafe in
    general; here the swap happens only while no autograd op reads the parameter (before
    its unit runs, after its gradients exist) and always to the same storage. Swapping
    in new Parameter objects instead would break the identity that optimizers, hooks and
    users' references rely on."""

    def __init__(self, *args: Any, device: torch.device) -> None:
        """ShardedBuffer's arguments, up to `keep_full`: a unit frees its full buffer."""
        super().__init__(*args, keep_full=False, device=device)
        self.nbytes = self.full.untyped_storage().nbytes()
        self.views = self.layout.views(self.full)
        self.empty = self.full.new_empty(0)
        self.gather: comm.Handle | None = None  # AllGather in flight into `full`
        self.gather_group: Any = None  # the twin of its shard group, set by the engine
        self.again_group: Any = None  # another twin: gathers for a unit's later calls
        # ([Note: a unit called again after another] in calls.py)
        # mode.offload=host: the master in the compute dtype on the device, what each
        # unshard gathers, copied up after each step ([Note: host offload] in
        # offload/host.py)
        self.device_shard: torch.Tensor | None = None

    @property
    def is_full(self) -> bool:  # gathered, or being gathered
        return self.full.untyped_storage().nbytes() > 0

    def unshard(self, again: bool = False) -> None:
        """Launch the AllGather of the full parameters, unless they are there already;
        `again`: for a later call of the unit in this forward."""
        if self.is_full:
            return
        self.full.untyped_storage().resize_(self.nbytes)
        # a cast copy in mixed precision; int8 quantizes the master itself (sharded.py);
        # with host offload the master is on the host, its cast copy here (`device_shard`)
        if self.device_shard is not None:
            mine = self.device_shard
        elif self.precision.gather_int8:
            mine = self.master
        else:
            mine = self.master.detach().to(self.full.dtype)
        self.gather = self.gather_full(mine, self.again_group if again else self.gather_group)

    def wait(self) -> None:
        """The AllGather done: the parameters point into `full` again."""
        if self.gather is not None:
            self.gather.wait()
            self.gather = None
            for p, view in zip(self.params, self.views, strict=True):
                p.data = view

    def free(self) -> None:
        self.wait()  # the collective may still be writing into the storage
        for p in self.params:
            if p.is_meta:  # built on meta: `p.data =` cannot change a tensor's device
                swap_into(p, self.empty)
            else:
                p.data = self.empty
        self.full.untyped_storage().resize_(0)


class Unit:
    """A submodule whose parameters are gathered and freed together: one buffer, or one
    per optimizer param group (e.g. weights and, with no weight decay, biases and
    norms), all gathered and reduced at the same points."""

    def __init__(
        self,
        tag: str,
        plan: UnitPlan,
        used: UsedFlags,
        mesh: Mesh,
        mp: Precision,
        param_options: ParamGroupFn | None,
        device: torch.device,
        experts: ExpertPlan | None = None,
    ):
        self.tag, self.name, self.module = tag, plan.name or "<root>", plan.module
        self.params = [p for _, p in plan.params]
        # The unit's expert parameters ([Note: expert parameters in every mode] in
        # experts.py) are buffers of their own, sharded over the EDP group; gathered,
        # freed and reduced with the unit's other buffers. (Built on meta, they have
        # their rows already while the others are still on meta.)
        is_expert = experts.holds if experts is not None else lambda p: False
        dense = [(n, p) for n, p in plan.params if not is_expert(p)]
        expert = [(n, p) for n, p in plan.params if is_expert(p)]
        for part in (dense, expert):
            if len({(p.dtype, p.device) for _, p in part}) > 1:
                names = [n for n, _ in part]
                raise ConfigError(f"fsdp unit {self.name!r} mixes dtypes/devices: {names}")
        groups = [("", opts, pairs, mesh) for opts, pairs in split_by_options(dense, param_options)]
        if expert:
            groups += [
                ("experts", opts, pairs, experts.groups.edp_mesh)
                for opts, pairs in split_by_options(expert, param_options)
            ]
        self.flat_buffers = [
            UnitBuffer(
                tag if i == 0 else f"{tag}.{i}",
                pairs,
                [used.index[id(p)] for _, p in pairs],
                opts,
                group_mesh,
                mp,
                device=device,
            )
            for i, (_, opts, pairs, group_mesh) in enumerate(groups)
        ]
        self.ready = 0  # parameters whose gradient arrived in this backward
        self.expected = len(self.params)  # of them, those this rank's forward reached
        self.done = False  # gradients handled in this backward

    @property
    def is_full(self) -> bool:  # gathered, or being gathered (nothing to gather: always)
        return all(b.is_full for b in self.flat_buffers)
