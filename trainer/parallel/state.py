"""What a checkpoint needs of an engine: where each rank's trainable state lives (its
groups and their pieces), that state as CPU copies, and loading it back.

[Note: shard layout] A group is one flat buffer of the mode (a zero bucket, an fsdp
unit's buffer; in ddp one parameter) with its parameters' names, shapes and offsets and
each rank's range of it; checkpoint/recutting.py re-cuts groups of one layout into another
([Note: re-cutting shards]). Optimizer state is kept per piece ([Note: per-parameter
optimizer tensors] in pieces.py): per-element tensors laid out like the group, step
counters by parameter name.
"""

from __future__ import annotations

from typing import Any

import torch

from trainer.errors import ConfigError
from trainer.parallel.engine import Engine
from trainer.parallel.pieces import ShardGroup


def _optimizer_entry(state: dict[Any, dict[str, Any]], g: ShardGroup) -> dict[str, dict]:
    """Optimizer state of one group: tensors shaped like their piece (exp_avg,
    momentum_buffer, ...) laid out 1-D like `local` (zero where no piece has state), and
    the rest (step counters) per parameter name."""
    per_element: dict[str, torch.Tensor] = {}
    scalar: dict[str, dict[str, Any]] = {}
    for piece in g.pieces:
        st = state.get(piece.tensor)
        if not st:
            continue
        scalar[piece.name] = {}
        for k, v in st.items():
            if torch.is_tensor(v) and v.shape == piece.tensor.shape and k != "step":
                flat = per_element.setdefault(k, v.new_zeros(g.local.numel(), device="cpu"))
                flat[piece.start : piece.end] = v.detach().reshape(-1).cpu()
            else:
                scalar[piece.name][k] = v.detach().cpu().clone() if torch.is_tensor(v) else v
    return {"per_element": per_element, "scalar": scalar}


def shard_layout(engine: Engine) -> dict[str, Any]:
    """Mode, world size and, per group, the parameters' names, shapes and offsets in
    the flat buffer and each rank's range of it: what a checkpoint needs to re-cut."""
    if engine.experts is not None:
        # Expert groups hold other rows on every rank of an EP group: no range of one
        # flat layout describes them. Refused rather than saved or re-cut wrongly.
        raise ConfigError(
            f"checkpoints of an expert-parallel engine (mode.expert_parallel="
            f"{engine.experts.groups.ep_size}) are not supported yet; run with "
            "mode.expert_parallel=1 to save or resume one"
        )
    named = dict(engine.module.named_parameters())
    canonical: dict[int, str] = {}
    groups = []
    size = engine.mesh.shard_size  # ranks sharing one copy: rank r holds slice r % size
    for g in engine.shard_groups():
        canonical.update({id(named[n]): n for n in g.names})
        s = g.layout.padded_numel // size
        ranges = [
            [r % size * s, (r % size + 1) * s] if g.sharded else [0, g.layout.numel]
            for r in range(engine.world_size)
        ]
        groups.append(
            {
                "names": list(g.names),
                "shapes": [list(shape) for shape in g.layout.shapes],
                "offsets": list(g.layout.offsets),
                "numel": g.layout.numel,
                "padded_numel": g.layout.padded_numel,
                "sharded": g.sharded,
                "ranges": ranges,
            }
        )
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


@torch.no_grad()
def sharded_state(engine: Engine) -> dict[str, Any]:
    """This rank's model and optimizer state as CPU copies, 1-D per group, and the
    layout; no communication. Unsharded groups are kept by rank 0 alone (ddp writes
    its model once), sharded ones by the first shard group (its replicas hold the same
    slices); other ranks hold None there."""
    groups, opt = engine.shard_groups(), engine.optimizer
    params, optim = [], []
    for g in groups:
        held = engine.rank < engine.mesh.shard_size if g.sharded else engine.rank == 0
        params.append(g.local.detach().reshape(-1).cpu().clone() if held else None)
        optim.append(_optimizer_entry(opt.state, g) if held else None)
    layout = shard_layout(engine)
    module = engine.module.state_dict(keep_vars=True)
    whole = [k for k, name in layout["keys"] if name is None]
    return {
        "layout": layout,
        "params": params,
        "optim": optim,
        # an fp16 run's lr is a device tensor ([Note: the schedule counts taken steps])
        "optim_hparams": [
            {
                k: v.detach().cpu().clone() if torch.is_tensor(v) else v
                for k, v in g.items()
                if k != "params"
            }
            for g in opt.param_groups
        ],
        # fp32 like the masters, so a checkpoint does not depend on `precision`
        "replicated": {k: engine.whole_copy(module[k]) for k in whole},
    }


# Optimizer options that choose an implementation, not the update it computes.
_IMPLEMENTATION = ("fused", "foreach", "capturable", "differentiable")


@torch.no_grad()
def load_sharded_state(engine: Engine, state: dict[str, Any]) -> None:
    """Inverse of sharded_state() for this engine's own layout; checkpoint.py re-cuts a
    checkpoint of another mode or world size into it first. Every rank calls it."""
    groups, opt = engine.shard_groups(), engine.optimizer
    for g, values in zip(groups, state["params"], strict=True):
        g.local.copy_(values.view_as(g.local))
    index = {id(p): i for i, p in enumerate(p for pg in opt.param_groups for p in pg["params"])}
    target = opt.state_dict()
    target["state"] = {}
    for g, entry in zip(groups, state["optim"], strict=True):
        for piece in g.pieces:
            scalar = entry["scalar"].get(piece.name)
            if scalar is None:  # never stepped: no state
                continue
            t = piece.tensor
            target["state"][index[id(t)]] = {
                # copies: the optimizer increments step counters in place, one each
                **{k: v.clone() if torch.is_tensor(v) else v for k, v in scalar.items()},
                **{
                    k: v[piece.start : piece.end].view_as(t)
                    for k, v in entry["per_element"].items()
                },
            }
    # How the optimizer is implemented stays this run's: torch places the step counters
    # by the loaded groups' `fused` (on the parameters' device, as fused kernels need, or
    # on the CPU), and an fp16 run is fused where an fp32 one is not.
    saved = [
        {k: v for k, v in g.items() if k not in _IMPLEMENTATION} for g in state["optim_hparams"]
    ]
    same = len(saved) == len(target["param_groups"])
    for i, pg in enumerate(target["param_groups"]):
        # The same grouping: every hyperparameter; another one (a run with weight-decay
        # groups resumed without them): the learning rate alone.
        lr = {k: saved[0][k] for k in ("lr", "initial_lr") if k in saved[0]}
        pg.update(saved[i] if same else lr)
    opt.load_state_dict(target)
    module = engine.module.state_dict(keep_vars=True)
    for k, v in state["replicated"].items():
        engine.load_whole(module[k], v)
    engine.params_from_masters()
