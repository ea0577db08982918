"""Reading a checkpoint into this run's layout: as saved, or re-cut from another one; and
consolidating it into one full state_dict.

[Note: re-cutting shards]
A checkpoint resumed with the layout it was written with (same mode, world size and
groups) is read by each rank from its own file (plus rank 0's for unsharded groups).
Any other layout is re-cut: every rank reads every file, reassembles each saved group's
flat buffer from the ranks' ranges, takes each parameter and each per-element optimizer
tensor (exp_avg, exp_avg_sq, momentum_buffer: shaped like the parameter) out of it by
name, and lays them into its own groups, cutting its own range; step counters are kept
per parameter name and copied.
That is pure data movement, so values are exact; only the arithmetic that follows in
the other mode may round differently.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from trainer import comm
from trainer.checkpoint.files import read_meta, read_rank
from trainer.errors import ConfigError
from trainer.parallel import state as engine_state


def prepare(path: Path, engine) -> tuple[dict, dict, dict | None]:
    """Read what this rank needs, check it, and cut this rank's state (no side effects)."""
    meta = read_meta(path)
    mine, saved = engine_state.shard_layout(engine), meta["layout"]
    module = engine.module.state_dict()
    buffers = {k: tuple(module[k].shape) for k, name in mine["keys"] if name is None}
    _check_compatible(path / "meta.pt", meta, mine, buffers, type(engine.optimizer).__name__)
    rank = comm.rank()
    # Sharded groups are held by the first shard group's ranks ([Note: hybrid sharding]).
    holder = rank % holders(saved)
    if saved == mine:  # the fast path: the file of this rank's slice (and rank 0's)
        need = {rank, holder} | {0 for g in saved["groups"] if not g["sharded"]}
    else:  # [Note: re-cutting shards]
        need = set(range(saved["world_size"]))
    files = {r: read_rank(path, r, meta) for r in sorted(need)}
    if saved == mine:
        state = {"params": [], "optim": []}
        for i, g in enumerate(saved["groups"]):
            holder_file = files[holder if g["sharded"] else 0]
            state["params"].append(holder_file["params"][i])
            state["optim"].append(holder_file["optim"][i])
    else:
        state = recut(saved, files, mine, rank)
    state["optim_hparams"] = meta["optim_hparams"]
    state["replicated"] = meta["replicated"]
    return meta, state, files[rank]["rng"] if rank in files else None


def _check_compatible(
    file: Path, meta: dict, mine: dict, buffers: dict[str, tuple[int, ...]], optimizer: str
) -> None:
    """The checkpoint must hold this model's parameters and buffers, with their shapes."""
    theirs = _shapes(meta["layout"])
    ours = _shapes(mine)
    missing, extra = sorted(ours.keys() - theirs.keys()), sorted(theirs.keys() - ours.keys())
    if missing or extra:
        raise ConfigError(
            f"{file} does not match this model: parameters missing there {_few(missing)}, "
            f"not in this model {_few(extra)}"
        )
    for name, shape in ours.items():
        if theirs[name] != shape:
            raise ConfigError(
                f"{file} does not match this model: {name} has shape {theirs[name]} there "
                f"and {shape} here"
            )
    theirs_keys = {k for k, _ in meta["layout"]["keys"]}
    ours_keys = {k for k, _ in mine["keys"]}
    if theirs_keys != ours_keys:
        raise ConfigError(
            f"{file} does not match this model: state_dict keys missing there "
            f"{_few(sorted(ours_keys - theirs_keys))}, not in this model "
            f"{_few(sorted(theirs_keys - ours_keys))}"
        )
    for k, shape in buffers.items():
        if tuple(meta["replicated"][k].shape) != shape:
            raise ConfigError(
                f"{file} does not match this model: {k} has shape "
                f"{tuple(meta['replicated'][k].shape)} there and {shape} here"
            )
    if meta.get("optimizer") != optimizer:
        raise ConfigError(
            f"{file} holds {meta.get('optimizer')} optimizer state; this run uses {optimizer}"
        )


def _shapes(layout: dict) -> dict[str, tuple[int, ...]]:
    return {
        n: tuple(s) for g in layout["groups"] for n, s in zip(g["names"], g["shapes"], strict=True)
    }


def _few(names: list[str]) -> str:
    return "[" + ", ".join(names[:4]) + (", ...]" if len(names) > 4 else "]")


def full_tensors(layout: dict, files: dict[int, dict]) -> tuple[dict, dict, dict]:
    """Whole tensors by parameter name from the ranks' files of a checkpoint written
    with `layout`: (values, per-element optimizer tensors, other optimizer state of the
    parameters that have any)."""
    values: dict[str, torch.Tensor] = {}
    per_element: dict[str, dict[str, torch.Tensor]] = {}
    scalar: dict[str, dict[str, Any]] = {}
    for i, g in enumerate(layout["groups"]):
        held_by = range(holders(layout)) if g["sharded"] else [0]
        ranges = [g["ranges"][r] for r in held_by]
        flat = _assemble([files[r]["params"][i] for r in held_by], ranges)
        entries = [files[r]["optim"][i] for r in held_by]
        keys = sorted({k for e in entries for k in e["per_element"]})
        # A rank whose pieces have no state yet (never stepped) holds no entry: zeros.
        opt_flat = {
            k: _assemble(
                [
                    e["per_element"].get(k, flat.new_zeros(hi - lo))
                    for e, (lo, hi) in zip(entries, ranges, strict=True)
                ],
                ranges,
            )
            for k in keys
        }
        for name, shape, offset in zip(g["names"], g["shapes"], g["offsets"], strict=True):
            n = math.prod(shape)
            values[name] = flat[offset : offset + n].view(shape)
            per_element[name] = {k: v[offset : offset + n].view(shape) for k, v in opt_flat.items()}
        for e in entries:  # a parameter split over ranks: the same counters on each
            scalar.update(e["scalar"])
    return values, per_element, scalar


def holders(layout: dict) -> int:
    """How many ranks (0, 1, ...) hold the slices of sharded groups: a shard group's."""
    return layout.get("shard_group_size", layout["world_size"])


def _assemble(pieces: list[torch.Tensor], ranges: list[list[int]]) -> torch.Tensor:
    flat = pieces[0].new_zeros(max(hi for _, hi in ranges))
    for piece, (lo, hi) in zip(pieces, ranges, strict=True):
        flat[lo:hi] = piece
    return flat


def recut(saved: dict, files: dict[int, dict], layout: dict, rank: int) -> dict[str, list]:
    """This rank's params and optimizer state in `layout`, from a checkpoint of `saved`."""
    values, per_element, scalar = full_tensors(saved, files)
    params, optim = [], []
    for g in layout["groups"]:
        lo, hi = g["ranges"][rank]
        names = g["names"]
        params.append(_lay_out(g, {n: values[n] for n in names})[lo:hi].clone())
        per = {}
        for k in sorted({k for n in names for k in per_element[n]}):
            tensors = {n: per_element[n][k] for n in names if k in per_element[n]}
            per[k] = _lay_out(g, tensors)[lo:hi].clone()
        optim.append({"per_element": per, "scalar": {n: scalar[n] for n in names if n in scalar}})
    return {"params": params, "optim": optim}


def _lay_out(group: dict, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """A group's padded flat buffer with `tensors` at their offsets (absent ones zero)."""
    like = next(iter(tensors.values()))
    flat = like.new_zeros(group["padded_numel"])
    for name, offset in zip(group["names"], group["offsets"], strict=True):
        if name in tensors:
            t = tensors[name].reshape(-1)
            flat[offset : offset + t.numel()] = t
    return flat


def consolidate(path: Path) -> dict[str, torch.Tensor]:
    """The full model state_dict of checkpoint `path` (every state_dict key, tied weights
    under each of their names), read from the files alone: no process group, no model."""
    path = Path(path)
    meta = read_meta(path)
    files = {r: read_rank(path, r, meta) for r in range(meta["layout"]["world_size"])}
    values, _, _ = full_tensors(meta["layout"], files)
    return {
        key: (values[name] if name is not None else meta["replicated"][key]).clone()
        for key, name in meta["layout"]["keys"]
    }
