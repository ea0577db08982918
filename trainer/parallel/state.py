"""What a checkpoint needs of an engine: where each rank's trainable state lives (its
groups and their pieces), that state as CPU copies, and loading it back.

A group is one flat buffer of the mode with its parameters' names, shapes and offsets
and each rank's range of it; checkpoint/recutting.py re-cuts groups of one layout into
another. The notes, beside the functions they explain:
- `shard_layout`: [Note: shard layout], [Note: expert groups in a checkpoint];
- `feedback_layout`: [Note: error feedback in a checkpoint], each rank's own errors;
- `live_state`: [Note: live state], what a replica group that restarted heals from.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from trainer.errors import ConfigError
from trainer.offload.disk import OnDisk
from trainer.parallel.engine import Engine
from trainer.parallel.pieces import ShardGroup


# [Note: shard layout]
# A group is one flat buffer of the mode (a zero bucket, an fsdp unit's buffer; in ddp one
# parameter) with its parameters' names, shapes and offsets and each rank's range of it;
# checkpoint/recutting.py re-cuts groups of one layout into another
# ([Note: re-cutting shards]). Optimizer state is kept per piece
# ([Note: per-parameter optimizer tensors] in pieces.py): per-element tensors laid out like
# the group, step counters by parameter name.
#
# [Note: expert groups in a checkpoint]
# With expert parallelism an expert group (parallel/experts.py) holds, on EP position e,
# rows [e*n/E, (e+1)*n/E) of each stacked expert parameter, sharded (zero, fsdp) over its
# EDP group: rank r holds slice r // E. Its layout entry keeps the local shapes and
# offsets, so that `ranges` are ranges of one rank's flat buffer as for dense groups, and
# adds `expert`: each parameter's full shape (all experts), each rank's EP position and the
# ranks that write it (every rank when sharded, the first EP group when not). Local
# element k of a parameter on EP position e is then element e*L + k of the full parameter
# (L its local numel: rows are the leading dimension, so a slice of rows is one range of
# elements), and a re-cut to another E or P reads the full parameter by ranges as it does
# a dense one (checkpoint/recutting.py).
def shard_layout(engine: Engine) -> dict[str, Any]:
    """Mode, world size and, per group, the parameters' names, shapes and offsets in
    the flat buffer and each rank's range of it: what a checkpoint needs to re-cut."""
    named = dict(engine.module.named_parameters())
    canonical: dict[int, str] = {}
    groups = []
    size = engine.mesh.shard_size  # ranks sharing one copy: rank r holds slice r % size
    experts = engine.experts
    for g in engine.shard_groups():
        canonical.update({id(named[n]): n for n in g.names})
        entry: dict[str, Any] = {
            "names": list(g.names),
            "shapes": [list(shape) for shape in g.layout.shapes],
            "offsets": list(g.layout.offsets),
            "numel": g.layout.numel,
            "padded_numel": g.layout.padded_numel,
            "sharded": g.sharded,
        }
        if g.group is None:
            s = g.layout.padded_numel // size
            entry["ranges"] = [
                [r % size * s, (r % size + 1) * s] if g.sharded else [0, g.layout.numel]
                for r in range(engine.world_size)
            ]
        else:  # [Note: expert groups in a checkpoint]
            e, s = experts.groups.ep_size, g.layout.padded_numel // experts.groups.edp_size
            entry["ranges"] = [
                [r // e * s, (r // e + 1) * s] if g.sharded else [0, g.layout.numel]
                for r in range(engine.world_size)
            ]
            entry["expert"] = {
                "ep_size": e,
                "full_shapes": [list(experts.full_shapes[n]) for n in g.names],
                "ep_ranks": [r % e for r in range(engine.world_size)],
                "writers": [r for r in range(engine.world_size) if g.sharded or r < e],
            }
        groups.append(entry)
    # Every state_dict key, with the grouped parameter it names (tied weights: two keys,
    # one parameter), or None for tensors every rank keeps whole (buffers, frozen).
    keys = [[k, canonical.get(id(v))] for k, v in engine.module.state_dict(keep_vars=True).items()]
    return {
        "mode": engine.name,
        "world_size": engine.world_size,
        # [Note: hybrid sharding] in comm/groups.py: ranks [0, size) hold one whole copy
        "shard_group_size": size,
        "groups": groups,
        "keys": keys,
    }


# [Note: error feedback in a checkpoint]
# With `mode.error_feedback` each rank holds, per gradient buffer, the fp32 error of its
# last quantization of its own gradient ((P, C): one row per destination rank), in the
# gradient's units (loss-scaled in fp16, as the scale that is saved with it), and in ddp
# the error of its last quantization of the chunk's mean it owns and AllGathers ((C,),
# [Note: error feedback on both roundings] in comm/quantized.py). They belong to that
# rank alone, so every rank writes its own, replicas included, as `feedback/i` (and
# `feedback/i/owner`) in its data file, and describes them in its index
# (`feedback_layout`: mode, world size, shard group size, expert-parallel size and each
# buffer's parameters). A resume with the same description reads each rank's errors back
# exactly, and the next reduction sends them as if the run had not stopped (a checkpoint
# written before ddp kept owner errors holds none: they start at zero, as that run's
# AllGathers had none). Another one (another world size, mode, bucket size, shard group
# or expert-parallel size) cannot be re-cut: an error is of one rank's local gradient,
# which no rank of the new layout computes; error feedback then restarts at zero, as a
# fresh run's does, with one line saying so: what it loses is the rounding error of one
# step, at most half a quantization step per value and rank (and per rounding, in ddp).
def feedback_layout(engine: Engine) -> dict[str, Any] | None:
    """What a checkpoint says of this rank's error feedback buffers, None without error
    feedback ([Note: error feedback in a checkpoint]): `buffers` holds, per buffer, its
    parameters' names and element count and the shapes of its `error` and `owner_error`
    (None before its first int8 reduction, and where a mode has none; nothing is written
    then)."""
    owners = engine.feedback_owners()
    if not owners:
        return None
    names = {id(p): n for n, p in engine.module.named_parameters()}
    experts = engine.experts
    return {
        "mode": engine.name,
        "world_size": engine.world_size,
        "shard_group_size": engine.mesh.shard_size,
        "ep_size": experts.groups.ep_size if experts is not None else 1,
        "buffers": [
            {
                "names": [names[id(p)] for p in b.params],
                "numel": sum(p.numel() for p in b.params),
                "shape": None if b.error is None else list(b.error.shape),
                "owner_shape": None if b.owner_error is None else list(b.owner_error.shape),
            }
            for b in owners
        ],
    }


def feedback_mismatch(saved: dict[str, Any], mine: dict[str, Any]) -> str | None:
    """Why errors saved with layout `saved` cannot be loaded into one with `mine`, or
    None when they can, buffer by buffer ([Note: error feedback in a checkpoint])."""
    for key in ("mode", "world_size", "shard_group_size", "ep_size"):
        if saved[key] != mine[key]:
            return f"{key.replace('_', ' ')} {saved[key]} there, {mine[key]} here"
    strip = [[{k: b[k] for k in ("names", "numel")} for b in x["buffers"]] for x in (saved, mine)]
    if strip[0] != strip[1]:
        return "its gradient buffers hold other parameters (another bucket size or model)"
    return None


@torch.no_grad()
def load_feedback(
    engine: Engine, saved: dict[str, Any], read: Callable[[str, torch.Tensor], None]
) -> None:
    """Each saved `error` and `owner_error` into its buffer (layouts already agreed by
    `feedback_mismatch`), `read(name, out)` filling entry `name` (`feedback_entry`) from
    this rank's file; one saved without (not reduced yet; an owner error in a checkpoint
    from before ddp kept them) starts at zero, as do all without a checkpoint."""
    for i, (b, entry) in enumerate(zip(engine.feedback_owners(), saved["buffers"], strict=True)):
        device = b.params[0].device
        for attr, key in (("error", "shape"), ("owner_error", "owner_shape")):
            shape, held = entry.get(key), getattr(b, attr)
            if shape is None:
                setattr(b, attr, None)
                continue
            if held is None or list(held.shape) != shape:
                held = torch.zeros(shape, dtype=torch.float32, device=device)
                setattr(b, attr, held)
            read(feedback_entry(i, attr), held.view(-1))


def feedback_entry(i: int, attr: str) -> str:
    """The data file entry of buffer i's `error` or `owner_error`."""
    return f"feedback/{i}" if attr == "error" else f"feedback/{i}/owner"


def holds(engine: Engine, g: ShardGroup) -> bool:
    """Whether this rank writes group `g`: unsharded groups by rank 0 alone (ddp writes
    its model once), sharded ones by the first shard group (its replicas hold the same
    slices). An expert group's: the ranks of the first EP group when unsharded (ddp), as
    they hold different experts ([Note: expert groups in a checkpoint])."""
    if g.group is not None and not g.sharded:
        return engine.rank < engine.experts.groups.ep_size
    return engine.rank < engine.mesh.shard_size if g.sharded else engine.rank == 0


# What a rank writes, as (name, dtype, shape, segments): segments are live tensors, or
# counts of zero elements ([Note: streamed checkpoint files] in checkpoint/stream.py).
DataEntry = tuple[str, torch.dtype, list[int], list[torch.Tensor | int | OnDisk]]


@torch.no_grad()
def data_to_write(engine: Engine) -> tuple[list[DataEntry], list[dict[str, dict] | None]]:
    """This rank's part of a checkpoint, as views of the live tensors (no copies), and the
    optimizer's other state (step counters) per group by parameter name, None for groups
    it does not write. Entries: `params/i` (the group's local values, 1-D), `optim/i/k`
    (per-element optimizer tensor k laid out like them, zero where no piece has state),
    on every rank with error feedback `feedback/i` (its own errors, [Note: error feedback
    in a checkpoint]) and, on rank 0, `replicated/KEY` (buffers and frozen parameters,
    fp32 like the masters, so that a checkpoint does not depend on `precision`)."""
    entries: list[DataEntry] = []
    scalars: list[dict[str, dict] | None] = []
    state = engine.optimizer.state
    # mode.offload=disk: what is in the offload file is streamed from there
    stored = engine.offload.on_disk() if engine.offload is not None else {}
    for i, g in enumerate(engine.shard_groups()):
        if not holds(engine, g):
            scalars.append(None)
            continue
        local = g.local.detach().reshape(-1)
        values = stored.get(id(g.local), local)
        entries.append((f"params/{i}", local.dtype, [local.numel()], [values]))
        per_element: dict[str, list[torch.Tensor | int | OnDisk]] = {}
        dtypes: dict[str, torch.dtype] = {}
        ends: dict[str, int] = {}
        scalar: dict[str, dict] = {}
        for piece in g.pieces:  # in order of their ranges in `local`
            st = state.get(piece.tensor)
            if not st:
                continue
            scalar[piece.name] = {}
            for k, v in st.items():
                if torch.is_tensor(v) and v.shape == piece.tensor.shape and k != "step":
                    segments = per_element.setdefault(k, [])
                    dtypes.setdefault(k, v.dtype)
                    elements = stored.get(id(v), v.detach().reshape(-1))
                    segments += [piece.start - ends.get(k, 0), elements]
                    ends[k] = piece.end
                else:
                    scalar[piece.name][k] = v.detach().cpu().clone() if torch.is_tensor(v) else v
        for k, segments in per_element.items():
            segments.append(local.numel() - ends[k])
            entries.append((f"optim/{i}/{k}", dtypes[k], [local.numel()], segments))
        scalars.append(scalar)
    # [Note: error feedback in a checkpoint]: every rank its own
    for i, b in enumerate(engine.feedback_owners()):
        for attr in ("error", "owner_error"):
            if (e := getattr(b, attr)) is not None:
                entries.append((feedback_entry(i, attr), torch.float32, [e.numel()], [e.view(-1)]))
    if engine.rank == 0:
        module = engine.module.state_dict(keep_vars=True)
        for k, name in shard_layout(engine)["keys"]:
            if name is None:
                v = engine.frozen.value(module[k])
                dtype = torch.float32 if v.is_floating_point() else v.dtype
                entries.append((f"replicated/{k}", dtype, list(v.shape), [v]))
    return entries, scalars


def optim_hparams(engine: Engine) -> list[dict[str, Any]]:
    """The optimizer's hyperparameters per param group, as plain CPU values (an fp16
    run's lr is a device tensor: [Note: the schedule counts taken steps])."""
    return [
        {
            k: v.detach().cpu().clone() if torch.is_tensor(v) else v
            for k, v in g.items()
            if k != "params"
        }
        for g in engine.optimizer.param_groups
    ]


# Fills elements [start, start + out.numel()) of this rank's group i (1-D, as `local`)
# into `out`: the values (key None) or per-element optimizer tensor `key`.
Fill = Callable[[int, str | None, torch.Tensor, int], None]


# Optimizer options that choose an implementation, not the update it computes.
_IMPLEMENTATION = ("fused", "foreach", "capturable", "differentiable")


@torch.no_grad()
def load_streamed(
    engine: Engine,
    fill: Fill,
    scalar: dict[str, dict[str, Any]],
    per_element: list[list[str]],
    hparams: list[dict[str, Any]],
    replicated: Callable[[str, torch.Tensor], None],
) -> None:
    """Load a checkpoint into this engine's own tensors, piece by piece ([Note: shard
    layout]): `fill` reads the values into each group's `local` and each stepped piece's
    per-element optimizer tensors (`per_element[i]`: their names in group i) into new
    tensors shaped like the piece, which the optimizer takes as they are; `scalar`: the
    other optimizer state (step counters) by parameter name; `replicated(key, out)`
    reads a buffer or frozen parameter. Every rank calls it, with its own `fill`."""
    groups, opt, offload = engine.shard_groups(), engine.optimizer, engine.offload
    index = {id(p): i for i, p in enumerate(p for pg in opt.param_groups for p in pg["params"])}
    target = opt.state_dict()
    target["state"] = {}
    for i, g in enumerate(groups):
        if offload is not None:  # [Note: offloaded state]: one group in memory at a time
            offload.load_master(i)
        fill(i, None, g.local.detach().reshape(-1), 0)
        loaded = {}
        for piece in g.pieces:
            saved = scalar.get(piece.name)
            if saved is None:  # never stepped: no state
                continue
            t = piece.tensor
            tensors = {}
            for k in per_element[i]:
                out = torch.zeros(t.numel(), dtype=t.dtype, device=t.device)
                fill(i, k, out, piece.start)
                tensors[k] = out.view_as(t)
            # copies: the optimizer increments step counters in place, one each
            counters = {k: v.clone() if torch.is_tensor(v) else v for k, v in saved.items()}
            target["state"][index[id(t)]] = {**counters, **tensors}
            loaded[t] = tensors
        if offload is not None:  # out to the file; the optimizer takes them freed
            offload.store(i, loaded)
    # How the optimizer is implemented stays this run's: torch places the step counters
    # by the loaded groups' `fused` (on the parameters' device, as fused kernels need, or
    # on the CPU), and an fp16 run is fused where an fp32 one is not.
    saved_groups = [{k: v for k, v in g.items() if k not in _IMPLEMENTATION} for g in hparams]
    same = len(saved_groups) == len(target["param_groups"])
    for i, pg in enumerate(target["param_groups"]):
        # The same grouping: every hyperparameter; another one (a run with weight-decay
        # groups resumed without them): the learning rate alone.
        lr = {k: saved_groups[0][k] for k in ("lr", "initial_lr") if k in saved_groups[0]}
        pg.update(saved_groups[i] if same else lr)
    opt.load_state_dict(target)
    module = engine.module.state_dict(keep_vars=True)
    for k, name in shard_layout(engine)["keys"]:
        if name is None:  # one tensor at a time, in the checkpoint's dtype (fp32)
            v = module[k]
            value = torch.empty(v.shape, dtype=_saved_dtype(v), device=v.device)
            replicated(k, value.reshape(-1))
            engine.frozen.load(v, value)
    engine.params_from_masters()


def _saved_dtype(v: torch.Tensor) -> torch.dtype:
    return torch.float32 if v.is_floating_point() else v.dtype


# [Note: live state] What a replica group that restarted heals from
# ([Note: fault-tolerant replica groups] in comm/replicas.py): rank r's whole engine state
# as CPU copies, sent by rank r of a live group, whose layout is the same (the same config
# and ranks per group, which the groups check). Unlike a checkpoint it holds every group
# this rank keeps, replicas included, and its own error feedback.
@torch.no_grad()
def live_state(engine: Engine) -> dict[str, Any]:
    """This rank's engine state as CPU copies: each group's `local` values, the
    optimizer's state_dict, buffers and frozen parameters, error feedback."""
    if engine.offload is not None:  # checked before the run starts: replicas.py's caller
        raise ConfigError("live state of an offloaded engine is not kept in memory")

    def copy(v: Any) -> Any:
        return v.detach().to("cpu", copy=True) if torch.is_tensor(v) else v

    optim = engine.optimizer.state_dict()
    module = engine.module.state_dict(keep_vars=True)
    return {
        "values": [copy(g.local) for g in engine.shard_groups()],
        "optimizer": {
            "state": {i: {k: copy(v) for k, v in s.items()} for i, s in optim["state"].items()},
            "param_groups": [{k: copy(v) for k, v in g.items()} for g in optim["param_groups"]],
        },
        "replicated": {
            k: engine.frozen.copy(module[k])
            for k, name in shard_layout(engine)["keys"]
            if name is None
        },
        "feedback": [
            [copy(getattr(b, attr)) for attr in ("error", "owner_error")]
            for b in engine.feedback_owners()
        ],
    }


@torch.no_grad()
def load_live_state(engine: Engine, state: dict[str, Any]) -> None:
    """`live_state` of rank r of a peer group into this engine (rank r here)."""
    groups = engine.shard_groups()
    if len(groups) != len(state["values"]) or any(
        g.local.shape != v.shape for g, v in zip(groups, state["values"], strict=True)
    ):
        raise ConfigError(
            "the state a peer replica group sent has another layout than this group's: every "
            "group of a run needs the same config and ranks per group"
        )
    for g, v in zip(groups, state["values"], strict=True):
        g.local.copy_(v)
    engine.optimizer.load_state_dict(state["optimizer"])
    module = engine.module.state_dict(keep_vars=True)
    for k, value in state["replicated"].items():
        engine.frozen.load(module[k], value)
    for b, (error, owner) in zip(engine.feedback_owners(), state["feedback"], strict=True):
        b.error = None if error is None else error.to(engine.device)
        if hasattr(b, "owner_error"):
            b.owner_error = None if owner is None else owner.to(engine.device)
    engine.params_from_masters()
