"""What each rank of each mode holds, counted on a model built on the meta device (no
memory, so a 70B model costs nothing).

The flat buffers are laid out by the functions the engines call: `flat.bucketize` and
`FlatLayout` (padding) for ddp's and zero's buckets, `units.plan_units` for fsdp's units,
`pieces.split_by_options` for weight-decay groups, `pieces.cut` for what the optimizer
steps on each rank. The bytes per element of each kind come from `memory.bytes_per_element`,
the rule memory.py checks runs against. The result is the figure `memory.measure` reads
from a live run right after an optimizer step, to the byte (tests/test_estimate.py):
padding, the used-flags riding on the last collective ([Note: used flags]) and the
optimizer's per-tensor state (AdamW's 0-d `step`) included.

With `mode.shard_group_size` S (zero and fsdp) the flat buffers are cut over the S ranks
of a shard group instead of all P, a rank's slice being its rank inside the group
([Note: hybrid sharding] in comm/groups.py).

With `mode.expert_parallel` E each rank lays out n_experts/E of every experts module's
experts, in flat buffers of their own that zero and fsdp cut over the P/E ranks of an
expert-data-parallel group, a rank's slice being its position there, rank // E
([Note: expert parameters in every mode] in parallel/experts.py).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from trainer.comm import quantized
from trainer.errors import ConfigError
from trainer.observe.memory import bytes_per_element, optimizer_bytes_per_param
from trainer.offload.disk import aligned
from trainer.parallel import ENGINES, experts, pieces
from trainer.parallel.broadcast import BROADCAST_PACK_BYTES
from trainer.parallel.engine import OptimizerFactory, ParamGroupFn
from trainer.parallel.flat import FlatLayout, bucketize
from trainer.parallel.precision import Precision
from trainer.parallel.units import DEFAULT_UNIT_CLASSES, plan_units
from trainer.parallel.zero import BUCKETS_IN_FLIGHT

KINDS = ("params", "master", "grads", "optimizer")


@dataclass(frozen=True)
class OptimizerState:
    """What the optimizer keeps: bytes per parameter element, and per tensor it steps."""

    per_element: float  # AdamW: 8 (two fp32 moments); SGD with momentum: 4
    per_tensor: int  # AdamW: 4 (its 0-d fp32 `step`)


def optimizer_state(factory: OptimizerFactory) -> OptimizerState:
    """Step the configured optimizer once on a small real parameter and read its state."""
    probe = nn.Parameter(torch.zeros(16))
    probe.grad = torch.zeros(16)
    opt = factory([probe])
    opt.step()
    k = optimizer_bytes_per_param(opt) or 0.0
    total = sum(
        v.numel() * v.element_size() for v in opt.state[probe].values() if torch.is_tensor(v)
    )
    return OptimizerState(k, int(total - k * probe.numel()))


@dataclass
class Flat:
    """One flat buffer of a mode: a bucket (ddp, zero) or a unit's buffer (fsdp)."""

    names: list[str]
    layout: FlatLayout
    n_flags: int = 0  # used-flags carried by its collective ([Note: used flags])
    unit: int = -1  # fsdp: index of its unit in `plan_units` order (0: the root)
    expert: bool = False  # holds expert parameters: cut over the EDP group

    @property
    def root(self) -> bool:  # fsdp: gathered once per forward, kept through backward
        return self.unit == 0


@dataclass
class Plan:
    """The flat buffers of one mode, in the order the engine builds them."""

    mode: str
    flat_buffers: list[Flat]
    shard: int  # S: the ranks each dense flat buffer is cut over (1 in ddp)
    psi: int  # Ψ, trainable parameter elements of the model (every expert)
    options: dict[str, Any] = field(default_factory=dict)
    expert_parallel: int = 1  # E: each rank lays out n_experts / E of the experts
    units: list[str] = field(default_factory=list)  # fsdp: unit names, `plan_units` order
    # fsdp: AllGathers again per forward, by unit index, of units called again after
    # other units ([Note: a unit called again after another] in parallel/calls.py), and
    # those their backward issues beyond one per unit
    again: dict[int, int] = field(default_factory=dict)
    again_backward: dict[int, int] = field(default_factory=dict)

    @property
    def sharded(self) -> bool:
        return ENGINES[self.mode].shards_parameters

    @property
    def held(self) -> int:
        """Trainable parameter elements a rank lays out: Ψ, less the experts it does not
        hold under expert parallelism."""
        return sum(f.layout.numel for f in self.flat_buffers)

    def shard_of(self, f: Flat) -> int:
        """The ranks `f` is cut over: S, or for experts the P/E ranks of an EDP group
        (hybrid sharding with experts is refused: S = P there)."""
        if f.expert and self.sharded:
            return self.shard // self.expert_parallel
        return self.shard

    def group_rank(self, f: Flat, rank: int) -> int:
        """`rank`'s slice of `f`: its rank in its shard group, or in its EDP group."""
        return rank // self.expert_parallel if f.expert else rank % self.shard


def trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    named = list(model.named_parameters())
    frozen = [n for n, p in named if not p.requires_grad]
    if frozen:  # the engines keep them whole beside the rest; not counted here
        raise ConfigError(f"the estimate counts trainable parameters only; frozen: {frozen[:3]}")
    return named


def plan(
    mode: str,
    model: nn.Module,
    options: dict[str, Any],
    param_options: ParamGroupFn | None,
    shard: int,
) -> Plan:
    """Lay out `model` (fp32, on meta) as `mode`'s engine would, over groups of `shard`;
    with `options["expert_parallel"]` E > 1 each rank's experts apart, over P/E ranks."""
    psi = sum(p.numel() for _, p in trainable(model))
    e = int(options.get("expert_parallel", 1))
    expert_ids: set[int] = set()  # of the parameters a rank holds n_experts / E rows of
    if e > 1:
        model, expert_ids = _local_experts(model, e)
    named = trainable(model)
    dense = [(n, p) for n, p in named if id(p) not in expert_ids]
    expert = [(n, p) for n, p in named if id(p) in expert_ids]
    bucket = int(options.get("bucket_mb", 25.0) * 2**20)
    # Expert buffers go before the last dense one, as the engines launch them (ddp.py,
    # zero.py): the last dense buffer carries the used-flags over all ranks.
    if mode == "ddp":
        shard = 1
        flats = [
            [
                _flat(named, ps, 1, expert=part is expert)
                for ps in bucketize([p for _, p in part], bucket)
            ]
            for part in (dense, expert)
        ]
        flat_buffers = flats[0][:-1] + flats[1] + flats[0][-1:]
    elif mode == "zero":
        flats = [
            [
                _flat(named, ps, shard // (e if part is expert else 1), expert=part is expert)
                for _, pairs in pieces.split_by_options(part, param_options)
                for ps in bucketize([p for _, p in pairs], bucket)
            ]
            for part in (dense, expert)
        ]
        flat_buffers = flats[0][:-1] + flats[1] + flats[0][-1:]
    elif mode == "fsdp":
        classes = options.get("unit_classes")
        units = plan_units(
            model,
            DEFAULT_UNIT_CLASSES if classes is None else tuple(classes),
            options.get("min_unit_params", 100_000),
            options.get("repeated_children", True),
        )
        flat_buffers = [  # each unit's dense buffers, then its experts' (fsdp_units.py's Unit)
            Flat(
                [n for n, _ in pairs],
                FlatLayout.of([p for _, p in pairs], shard // (e if ex else 1)),
                unit=i,
                expert=ex,
            )
            for i, u in enumerate(units)
            for ex in (False, True)
            for _, pairs in pieces.split_by_options(
                [(n, p) for n, p in u.params if (id(p) in expert_ids) == ex], param_options
            )
        ]
    else:
        raise ValueError(mode)
    # the buffer launched last carries the flags; fsdp: the root's first dense buffer
    if mode == "fsdp":
        carrier = flat_buffers[0]
        if carrier.root and not carrier.expert:
            carrier.n_flags = len(named)
    else:
        flat_buffers[-1].n_flags = len(named)
    names = [u.name for u in units] if mode == "fsdp" else []
    return Plan(mode, flat_buffers, shard, psi, options, e, names)


def _flat(
    named: list[tuple[str, nn.Parameter]], ps: list[nn.Parameter], shard: int, expert: bool
) -> Flat:
    names = {id(p): n for n, p in named}
    return Flat([names[id(p)] for p in ps], FlatLayout.of(ps, shard), expert=expert)


def _local_experts(model: nn.Module, e: int) -> tuple[nn.Module, set[int]]:
    """A copy of `model` (on meta) whose expert parameters hold n_experts / E rows, as a
    rank's do once `experts.shard` has run, and their ids."""
    model = copy.deepcopy(model)
    named = experts.expert_parameters(model)
    for _, p in named:
        p.data = torch.empty((p.shape[0] // e, *p.shape[1:]), dtype=p.dtype, device="meta")
    return model, {id(p) for _, p in named}


def bare(mode: str, psi: int, shard: int, options: dict[str, Any]) -> Plan:
    """A bare parameter count: one flat buffer of Ψ elements, no used-flags; in fsdp a
    unit like any other (gathered before forward and before backward)."""
    shard = 1 if mode == "ddp" else shard
    padded = -(-psi // shard) * shard
    layout = FlatLayout((torch.Size([psi]),), (0,), psi, padded)
    return Plan(mode, [Flat(["<all>"], layout)], shard, psi, options)


def model_state(
    p: Plan, precision: Precision, opt: OptimizerState, rank: int = 0, world: int = 1
) -> dict[str, int]:
    """Bytes of each model-state kind on `rank` of `world`, as `memory.measure` counts
    them after an optimizer step (before the gradients are dropped)."""
    b, r = precision.param_dtype.itemsize, precision.reduce_dtype.itemsize
    per = bytes_per_element(p.mode, b, r, opt.per_element)
    sharded = ENGINES[p.mode].sharded_kinds
    out = dict.fromkeys(KINDS, 0)
    for f in p.flat_buffers:
        lay = f.layout
        s = lay.shard_size(p.shard_of(f))
        for kind in ("params", "master", "grads"):
            out[kind] += int((s if kind in sharded else lay.padded_numel) * per[kind])
        if p.mode == "zero" and precision.gather_int8 and not precision.mixed:
            out["master"] += s * 4  # a copy of its own: int8 AllGathers write `full`
        # The flags: in ddp's last bucket, in the reduce dtype. In zero and fsdp the
        # reduced output keeps them after the shard's gradient elements; that gradient is
        # a view of it when it is fp32 already, else an fp32 copy without them.
        if p.mode == "ddp":
            out["grads"] += f.n_flags * r
        elif r == 4:
            out["grads"] += f.n_flags * 4
        if precision.error_feedback:
            out["grads"] += _feedback_bytes(p, f, world)
        out["optimizer"] += _optimizer_bytes(p, f, opt, p.group_rank(f, rank))
    return out


def _feedback_bytes(p: Plan, f: Flat, world: int) -> int:
    """Error feedback's fp32 errors of one buffer: this rank's whole gradient input, and
    in ddp the chunk of the mean it owns ([Note: error feedback on both roundings])."""
    if p.mode == "ddp":  # (P, chunk) and (chunk,): `all_reduce_int8` over the bucket's ranks
        g = world // p.expert_parallel if f.expert else world
        return (g + 1) * quantized.chunk_of(f.layout.numel, g) * 4
    s = p.shard_of(f)  # (S, shard): the ReduceScatter's input
    return s * f.layout.shard_size(s) * 4


def _optimizer_bytes(p: Plan, f: Flat, opt: OptimizerState, group_rank: int) -> int:
    if opt.per_element == 0:  # a stateless optimizer (SGD without momentum)
        return 0
    lay = f.layout
    if not p.sharded:  # one tensor per parameter
        sizes = [s.numel() for s in lay.shapes]
    else:  # the pieces of this rank's slice (padding is in none)
        s = lay.shard_size(p.shard_of(f))
        shard = torch.empty(s, device="meta")
        cut = pieces.cut(f.names, range(len(f.names)), lay, shard, group_rank)
        sizes = [c.end - c.start for c in cut]
    return int(sum(n * opt.per_element + opt.per_tensor for n in sizes))


def max_model_state(
    p: Plan, precision: Precision, opt: OptimizerState, world: int = 1
) -> dict[str, int]:
    """The rank holding the most (ranks differ by a few optimizer step counters). With
    expert parallelism S = P in zero and fsdp, and ddp's ranks hold the same bytes."""
    ranks = [model_state(p, precision, opt, r, world) for r in range(p.shard)]
    return max(ranks, key=lambda d: sum(d.values()))


def checkpoint_data_bytes(
    p: Plan, opt: OptimizerState, precision: Precision | None = None, world: int = 1
) -> int:
    """Bytes of rank 0's checkpoint data file (`rank0.bin`, [Note: streamed checkpoint
    files]), the largest: the fp32 values of every group it writes (its slice; ddp's whole
    model, written once) and the optimizer's per-element state laid out like them. An
    async save holds a host copy of it ([Note: async save]). Buffers are not counted, as
    in the model state; entries start at 64-byte multiples (a few bytes more each). With
    error feedback every rank also writes its errors ([Note: error feedback in a
    checkpoint] in parallel/state.py)."""
    total = 0
    for f in p.flat_buffers:
        n = f.layout.shard_size(p.shard_of(f)) if p.sharded else f.layout.padded_numel
        total += int(n * (4 + opt.per_element))  # fp32 values (the masters where mixed)
        if precision is not None and precision.error_feedback:
            total += _feedback_bytes(p, f, world)
    return total


def working_set(p: Plan, precision: Precision, micro_batches: int = 1) -> int:
    """Bytes a step holds beyond the model state and the activations, at their peak.

    ddp: none (its buckets are the gradients). zero: the flat gradient inputs of the
    ReduceScatters in flight, at most `BUCKETS_IN_FLIGHT` + 1 buckets ([Note: bounded
    buckets]), each (S, shard + flags) in the reduce dtype. fsdp: the engine's
    `working_set_bytes()`: full parameters and gradients of the root unit and of the two
    largest other units, and of the units gathered again for a later call the full
    parameters of the two largest (one is gathered at a time, two in a recomputed region
    holding both) and the gradients of all (an upper bound: each is reduced after the
    other units, from its last call's backward on). Both keep
    every reduced slice until backward ends; in fp32 those are the shard gradients
    (model state), in a lower reduce dtype they come on top. With
    several micro-batches, zero and fsdp also keep every full gradient in the reduce
    dtype between them (`no_sync`). Backend receive buffers are not counted: NCCL keeps
    its own, and Gloo's p2p path needs none at P = 2 ([Note: p2p collectives on Gloo])."""
    b, r = precision.param_dtype.itemsize, precision.reduce_dtype.itemsize
    if p.mode == "ddp":
        return 0
    extra = p.held * r if micro_batches > 1 else 0
    if r != 4:  # the reduced slices, kept apart from their fp32 copies
        extra += sum((f.layout.shard_size(p.shard_of(f)) + f.n_flags) * r for f in p.flat_buffers)
    if p.mode == "zero":
        rows = [
            (s := p.shard_of(f)) * (f.layout.shard_size(s) + f.n_flags) * r for f in p.flat_buffers
        ]
        return extra + sum(sorted(rows, reverse=True)[: BUCKETS_IN_FLIGHT + 1])
    per_unit: dict[int, int] = {}  # full params and grads of the units in the order
    again_params: dict[int, int] = {}  # of units gathered again: full params,
    again_grads = 0  # and every one's grads, reduced after the others
    for f in p.flat_buffers:
        n = f.layout.padded_numel
        if f.unit in p.again:
            again_params[f.unit] = again_params.get(f.unit, 0) + n * b
            again_grads += n * r
        else:
            per_unit[f.unit] = per_unit.get(f.unit, 0) + n * (r + b)
    root = per_unit.pop(0, 0)
    two_again = sum(sorted(again_params.values(), reverse=True)[:2])
    return extra + root + two_again + again_grads + sum(sorted(per_unit.values(), reverse=True)[:2])


# [Note: the build peak]
# What a rank holds at its high point between the imports and the first step, counted
# from what the engines allocate ([Note: building on meta] in parallel/__init__.py). The
# model is fp32 as built; M = its parameters' and buffers' bytes (4Ψ + buffers).
#
#   ordinary build (train.meta_build=false): the whole model, M, on every rank, and
#     beside it the largest of
#       - the broadcast of rank 0's values (P > 1): parameters and buffers packed into
#         flat tensors of at most BROADCAST_PACK_BYTES (broadcast.py's broadcast_tensors)
#       - ddp: its gradient buckets (Ψ in the reduce dtype, + the used-flags), and the
#         fp32 masters (4Ψ) in mixed precision
#       - zero: one bucket's full flat buffer, built while its parameters still hold
#         their own storages (they become its views bucket by bucket); in mixed
#         precision + its cast and the fp32 master of its slice
#       - fsdp: one unit at a time, its full buffer (fp32) and its slice
#   meta build (train.meta_build=true):
#     ddp, zero: `materialize` gives the model full parameters, M, then as above, but
#       only the buffers are broadcast: every rank drew or read the same values
#     fsdp: this rank's fp32 slices (the padded 4Ψ/P) and the buffers, and beside them
#       the larger of: one module's full parameters while its init runs (SeededInit) and
#       check_fit's forward, which gathers the root and two more units (one prefetched)
#       in the compute dtype
# With expert parallelism the ordinary build broadcasts the whole model first, then each
# rank keeps its experts' rows (experts.shard) before the engine is built: M before, the
# held model's bytes (4 x its trainable elements a rank lays out, + buffers) after. A meta
# build draws or reads this rank's experts only: the held model throughout.
def build_peak(
    p: Plan,
    precision: Precision,
    world_size: int,
    buffer_bytes: int = 0,
    largest_module_bytes: int = 0,
) -> dict[str, int | None]:
    """{"ordinary": bytes, "meta": bytes} a rank holds at the peak of building this plan
    ([Note: the build peak]); `largest_module_bytes`: the fp32 parameters one module
    owns, at most (0 for a bare count). fsdp's meta figure needs the units: None for a
    bare count."""
    b, r = precision.param_dtype.itemsize, precision.reduce_dtype.itemsize
    model = 4 * p.psi + buffer_bytes
    held = 4 * p.held + buffer_bytes  # model, without expert parallelism
    broadcast = min(model, BROADCAST_PACK_BYTES) if world_size > 1 else 0
    buffers_broadcast = min(buffer_bytes, BROADCAST_PACK_BYTES) if world_size > 1 else 0
    if p.mode in ("ddp", "zero"):
        if p.mode == "ddp":  # its gradient buckets, kept; fp32 masters in mixed precision
            beside = sum((f.layout.padded_numel + f.n_flags) * r for f in p.flat_buffers)
            beside += 4 * p.held if precision.mixed else 0
        else:  # one bucket at a time; in mixed precision its cast and its fp32 master
            f = max(p.flat_buffers, key=lambda f: f.layout.padded_numel)
            n = f.layout.padded_numel
            beside = n * 4 + (n * b + n // p.shard_of(f) * 4 if precision.mixed else 0)
        return {
            "ordinary": max(model + broadcast, held + beside),
            "meta": held + max(buffers_broadcast, beside),
        }
    per_unit: dict[int, int] = {}
    shards = 0
    for f in p.flat_buffers:
        per_unit[f.unit] = per_unit.get(f.unit, 0) + f.layout.padded_numel
        shards += f.layout.shard_size(p.shard_of(f)) * 4
    largest = max(per_unit.values())
    unit_at_a_time = largest * 4 + largest // p.shard * 4
    root = per_unit.pop(0, 0)
    gathered = (root + sum(sorted(per_unit.values(), reverse=True)[:2])) * b
    bare = any(f.unit < 0 for f in p.flat_buffers)  # a bare count: its units are unknown
    return {
        "ordinary": max(model + broadcast, held + unit_at_a_time),
        "meta": None if bare else shards + buffer_bytes + max(largest_module_bytes, gathered),
    }


def offload(p: Plan, precision: Precision, opt: OptimizerState) -> dict[str, int]:
    """mode.offload=disk ([Note: offloaded state] in trainer/offload/state.py): bytes of
    this rank's offload file (per flat buffer one page-aligned region per per-element
    optimizer tensor, and for zero's separate masters one more; to the byte what the
    engine reserves), the bytes moved out of memory after a step (the optimizer's
    per-element state, and the masters where they move), the bytes read and written
    back each step (every stepped piece's state and the moved masters, both ways), and
    the state a step holds at most (three buffers': written behind, stepping, read ahead)."""
    keys = round(opt.per_element / 4)  # fp32 tensors: AdamW 2, SGD with momentum 1
    moves_master = p.mode == "zero" and precision.mixed and not precision.gather_int8
    regions = keys + (1 if moves_master else 0)
    file = states = masters = 0
    per_buffer = []
    for f in p.flat_buffers:
        s = f.layout.shard_size(p.shard_of(f))
        file += regions * aligned(s * 4)
        stepped = int(_piece_elements(p, f) * opt.per_element)  # counters stay in memory
        master = s * 4 if moves_master else 0
        states, masters = states + stepped, masters + master
        per_buffer.append(stepped + master)
    return {
        "file_bytes": file,
        "optimizer_in_file_bytes": states,
        "master_in_file_bytes": masters,
        "io_bytes_per_step": 2 * (states + masters),
        "stepping_bytes": sum(sorted(per_buffer, reverse=True)[:3]),
        "moves_master": moves_master,
    }


def host_offload(p: Plan, precision: Precision, opt: OptimizerState) -> dict[str, Any]:
    """mode.offload=host on a GPU ([Note: host offload] in trainer/offload/host.py): host
    bytes per rank (the pinned arena: a page-aligned fp32 master and gradient region per
    flat buffer, to the byte what the engine registers; and the optimizer's per-element
    state), the bytes that leave the device (that state; zero's separate masters in a
    mixed precision; fsdp's master down to its compute-dtype copy), and the bytes that
    cross the bus each step (each gradient down in fp32, each master up in the compute
    dtype)."""
    b = 2 if precision.mixed else 4
    arena = states = masters = bus = stepped_params = 0
    for f in p.flat_buffers:
        s = f.layout.shard_size(p.shard_of(f))
        arena += 2 * aligned(s * 4)
        stepped = _piece_elements(p, f)
        states += int(stepped * opt.per_element)
        stepped_params += stepped
        if p.mode == "zero" and precision.mixed:
            masters += s * 4
        elif p.mode == "fsdp":
            masters += s * (4 - b)
        bus += s * (4 + b)
    return {
        "host_bytes": arena + states,
        "arena_bytes": arena,
        "optimizer_on_host_bytes": states,
        "master_off_device_bytes": masters,
        "bus_bytes_per_step": bus,
        "stepped_params": stepped_params,
    }


def _piece_elements(p: Plan, f: Flat) -> int:
    """Elements of the pieces rank 0 steps of sharded buffer `f` (padding is in none)."""
    s = f.layout.shard_size(p.shard_of(f))
    shard = torch.empty(s, device="meta")
    cut = pieces.cut(f.names, range(len(f.names)), f.layout, shard, p.group_rank(f, 0))
    return sum(c.end - c.start for c in cut)
