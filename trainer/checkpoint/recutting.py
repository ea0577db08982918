"""Reading a checkpoint into this run's layout, as saved or re-cut from another one, range
by range; and the full model of a checkpoint, one tensor at a time.

[Note: re-cutting shards]
Each rank reads only what it keeps. For every parameter that reaches into one of its
groups' ranges, it finds where that part of the parameter lies in the checkpoint (which
saved group, at which offset, in which holder ranks' ranges) and reads those element
ranges of the holders' data files ([Note: streamed checkpoint files] in stream.py)
straight into its own tensors: the values into the group's `local`, each per-element
optimizer tensor (exp_avg, exp_avg_sq, momentum_buffer: laid out like the values) into
the new state tensor of the piece; step counters are kept per parameter name and copied.
The same layout is the case where every range is one rank's own. No rank reads a whole
file it does not need, nor builds a full flat buffer. Before anything is changed, every
range to be read is checked against the files' checksums (a first pass over the same
blocks): a bad file leaves the engine as it was.
That is pure data movement, so values are exact; only the arithmetic that follows in
the other mode may round differently.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from trainer import comm
from trainer.checkpoint import agree, stream
from trainer.checkpoint.files import read_meta, read_rank
from trainer.checkpoint.saving import REPLICATED
from trainer.errors import ConfigError
from trainer.parallel import state as engine_state

# One range to read: (saved rank, saved group, start in that rank's entry, start in this
# rank's group, number of elements).
Copy = tuple[int, int, int, int, int]


class Checkpoint:
    """A checkpoint's meta, and the indexes and data files of the ranks read so far."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.meta = read_meta(self.path)
        self.layout = self.meta["layout"]
        self.indexes: dict[int, dict[str, Any]] = {}
        self.data: dict[int, stream.DataFile] = {}
        # parameter name -> its parts: (saved group, offset in it, first element of the
        # parameter there, elements there, holders as (rank, start, end)); one part for a
        # dense parameter, one per EP position for an expert one ([Note: expert groups in
        # a checkpoint] in parallel/state.py)
        self.where: dict[str, list[tuple[int, int, int, int, list[tuple[int, int, int]]]]] = {}
        for j, g in enumerate(self.layout["groups"]):
            expert = g.get("expert")
            held_by = range(holders(self.layout)) if g["sharded"] else [0]
            if expert is not None:
                held_by = expert["writers"]
            for n, offset, shape in zip(g["names"], g["offsets"], g["shapes"], strict=True):
                numel = math.prod(shape)
                if expert is None:
                    self.where[n] = [(j, offset, 0, numel, [(r, *g["ranges"][r]) for r in held_by])]
                    continue
                for e in range(expert["ep_size"]):
                    ranges = [(r, *g["ranges"][r]) for r in held_by if expert["ep_ranks"][r] == e]
                    self.where.setdefault(n, []).append((j, offset, e * numel, numel, ranges))

    def open(self, ranks: set[int]) -> None:
        """Read and check the indexes of `ranks` and the sizes of their data files."""
        for r in sorted(ranks - self.indexes.keys()):
            self.indexes[r] = read_rank(self.path, r, self.meta)
        for r in sorted(ranks - self.data.keys()):
            self.data[r] = stream.DataFile(self.path / f"rank{r}.bin", self.indexes[r]["data"])

    def close(self) -> None:
        for d in self.data.values():
            d.close()

    def copies(self, name: str, start: int, end: int, at: int) -> list[Copy]:
        """The ranges that hold elements [start, end) of parameter `name`, which go to
        this rank's group at `at` onwards."""
        out = []
        for j, offset, first, numel, ranges in self.where[name]:
            s, t = max(start, first), min(end, first + numel)
            if s >= t:
                continue
            a, b = offset + s - first, offset + t - first  # in the saved group
            dst = at + s - start
            for r, lo, hi in ranges:
                x, y = max(a, lo), min(b, hi)
                if x < y:
                    out.append((r, j, x - lo, dst + x - a, y - x))
        return out

    def read(self, rank: int, entry: str, start: int, out: torch.Tensor | None, n: int) -> None:
        self.data[rank].read(entry, start, out, n)

    def replicated(self, key: str, out: torch.Tensor | None) -> None:
        n = math.prod(self.meta["replicated"][key][1])
        self.read(0, REPLICATED + key, 0, out, n)


def prepare(path: Path, engine) -> tuple[dict, Any, dict | None]:
    """Read what this rank needs and check it, with no side effects: (meta, a function
    that loads it into `engine`, this rank's RNG states or None)."""
    ckpt = Checkpoint(path)
    meta, saved = ckpt.meta, ckpt.layout
    mine = engine_state.shard_layout(engine)
    module = engine.module.state_dict()
    buffers = {k: tuple(module[k].shape) for k, name in mine["keys"] if name is None}
    _check_compatible(path / "meta.pt", meta, mine, buffers, type(engine.optimizer).__name__)
    rank = comm.rank()
    plan = [_group_plan(ckpt, g, rank) for g in mine["groups"]]
    need = {c[0] for p in plan for c in p}
    need |= {0} if buffers else set()
    need |= {rank} if rank < saved["world_size"] else set()  # for its RNG states
    try:
        ckpt.open(need)
        # The optimizer state: counters of every parameter this rank keeps, per-element
        # tensors of the saved groups it reads from.
        scalar: dict[str, dict] = {}
        for index in ckpt.indexes.values():
            for entries in index["scalar"]:
                scalar.update(entries or {})
        per_element = []
        for p in plan:
            keys = set()
            for r, j, *_ in p:
                prefix = f"optim/{j}/"
                entries = ckpt.indexes[r]["data"]["entries"]
                keys |= {e[len(prefix) :] for e in entries if e.startswith(prefix)}
            per_element.append(sorted(keys))

        sizes = [g["ranges"][rank][1] - g["ranges"][rank][0] for g in mine["groups"]]

        def fill(i: int, key: str | None, out: torch.Tensor | None, start: int) -> None:
            """Elements [start, start + n) of this rank's group i, from the files; `out`
            None: check them only."""
            n = out.numel() if out is not None else sizes[i]
            for r, j, src, dst, count in plan[i]:
                a, b = max(dst, start), min(dst + count, start + n)
                if a >= b:
                    continue
                entry = f"params/{j}" if key is None else f"optim/{j}/{key}"
                if key is not None and not ckpt.data[r].has(entry):
                    continue  # no piece of that range had state there: zeros
                part = out[a - start : b - start] if out is not None else None
                ckpt.read(r, entry, src + a - dst, part, b - a)

        for i in range(len(plan)):  # every range once, checked against its checksums
            for key in [None, *per_element[i]]:
                fill(i, key, None, 0)
        for k in buffers:
            ckpt.replicated(k, None)
        feedback, restart = _feedback_plan(ckpt, rank, engine)
        for i, b in enumerate(feedback["buffers"] if feedback else []):
            for attr, key in (("error", "shape"), ("owner_error", "owner_shape")):
                if b.get(key) is not None:
                    name = engine_state.feedback_entry(i, attr)
                    ckpt.read(rank, name, 0, None, math.prod(b[key]))
    finally:
        ckpt.close()  # reopened by `load`, if it comes to that

    def load(engine) -> None:
        try:
            engine_state.load_streamed(
                engine, fill, scalar, per_element, meta["optim_hparams"], ckpt.replicated
            )
            if feedback is not None:  # [Note: error feedback in a checkpoint]
                engine_state.load_feedback(
                    engine, feedback, lambda name, out: ckpt.read(rank, name, 0, out, 0)
                )
            elif restart is not None:
                agree.say(restart)
        finally:
            ckpt.close()

    rng = ckpt.indexes[rank]["rng"] if rank in ckpt.indexes else None
    return meta, load, rng


def _feedback_plan(ckpt: Checkpoint, rank: int, engine) -> tuple[dict | None, str | None]:
    """This rank's saved error feedback layout when it can be loaded as it is, else None
    and the line that says it restarts at zero (None when there is nothing to say:
    no error feedback in this run, or none saved) ([Note: error feedback in a
    checkpoint] in parallel/state.py)."""
    mine = engine_state.feedback_layout(engine)
    index = ckpt.indexes.get(rank)  # None on a rank the checkpoint did not have
    saved = index.get("feedback") if index is not None else None
    if mine is None or saved is None:  # rank 0, which says the line, always has an index
        return None, None
    why = engine_state.feedback_mismatch(saved, mine)
    if why is None:
        return saved, None
    return None, f"error feedback restarts at zero: {ckpt.path} holds it for another layout ({why})"


def _group_plan(ckpt: Checkpoint, group: dict, rank: int) -> list[Copy]:
    """The ranges of the checkpoint that make this rank's range of `group`."""
    lo, hi = group["ranges"][rank]
    expert = group.get("expert")
    out: list[Copy] = []
    for name, shape, offset in zip(group["names"], group["shapes"], group["offsets"], strict=True):
        numel = math.prod(shape)
        # where this rank's rows of an expert parameter begin in the full one
        first = expert["ep_ranks"][rank] * numel if expert is not None else 0
        a, b = max(offset, lo), min(offset + numel, hi)
        if a < b:
            out += ckpt.copies(name, first + a - offset, first + b - offset, a - lo)
    return out


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
        theirs_shape = tuple(meta["replicated"][k][1])
        if theirs_shape != shape:
            raise ConfigError(
                f"{file} does not match this model: {k} has shape {theirs_shape} there and "
                f"{shape} here"
            )
    if meta.get("optimizer") != optimizer:
        raise ConfigError(
            f"{file} holds {meta.get('optimizer')} optimizer state; this run uses {optimizer}"
        )


def _shapes(layout: dict) -> dict[str, tuple[int, ...]]:
    """Every parameter's full shape (an expert parameter's over all experts)."""
    return {
        n: tuple(s)
        for g in layout["groups"]
        for n, s in zip(
            g["names"], g["expert"]["full_shapes"] if "expert" in g else g["shapes"], strict=True
        )
    }


def _few(names: list[str]) -> str:
    return "[" + ", ".join(names[:4]) + (", ...]" if len(names) > 4 else "]")


def holders(layout: dict) -> int:
    """How many ranks (0, 1, ...) hold the slices of sharded groups: a shard group's."""
    return layout.get("shard_group_size", layout["world_size"])


def _model_ranks(layout: dict) -> set[int]:
    """The ranks whose files hold the model: rank 0 and the first shard group."""
    sharded = any(g["sharded"] for g in layout["groups"])
    writers = {r for g in layout["groups"] if "expert" in g for r in g["expert"]["writers"]}
    return {0} | (set(range(holders(layout))) if sharded else set()) | writers


def model_tensors(path: Path, only: set[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The full model of checkpoint `path` as (state_dict key, tensor), one tensor read at
    a time from the ranges that hold it, in state_dict order (the keys in `only`, if
    given); no process group, no model, no optimizer state. A tied weight (two keys, one
    parameter) is one tensor, under each of its keys in turn."""
    ckpt = Checkpoint(path)
    try:
        layout = ckpt.layout
        shapes = _shapes(layout)
        ckpt.open(_model_ranks(layout))
        last: tuple[str | None, torch.Tensor | None] = (None, None)
        for key, name in layout["keys"]:
            if only is not None and key not in only:
                continue
            if name is None:
                dtype, shape = ckpt.meta["replicated"][key]
                value = torch.empty(shape, dtype=stream.dtype_of(dtype))
                ckpt.replicated(key, value.reshape(-1))
            elif name == last[0]:
                value = last[1]
            else:
                shape = shapes[name]
                j, *_, ranges = ckpt.where[name][0]
                dtype = ckpt.data[ranges[0][0]].entry(f"params/{j}")[0]
                value = torch.empty(shape, dtype=dtype)
                flat = value.reshape(-1)
                for r, j, src, dst, n in ckpt.copies(name, 0, flat.numel(), 0):
                    ckpt.read(r, f"params/{j}", src, flat[dst : dst + n], n)
                last = (name, value)
            yield key, value
    finally:
        ckpt.close()


def model_entries(path: Path) -> list[tuple[str, str | None, torch.dtype, tuple[int, ...]]]:
    """(key, parameter name or None, dtype, shape) of every tensor `model_tensors(path)`
    yields, read from the meta and indexes alone."""
    ckpt = Checkpoint(path)
    layout = ckpt.layout
    shapes = _shapes(layout)
    ckpt.open(_model_ranks(layout))
    ckpt.close()
    out = []
    for key, name in layout["keys"]:
        if name is None:
            dtype, shape = ckpt.meta["replicated"][key]
            out.append((key, None, stream.dtype_of(dtype), tuple(shape)))
        else:
            j, *_, ranges = ckpt.where[name][0]
            dtype = ckpt.data[ranges[0][0]].entry(f"params/{j}")[0]
            out.append((key, name, dtype, shapes[name]))
    return out


def consolidate(path: Path) -> dict[str, torch.Tensor]:
    """The full model state_dict of checkpoint `path` (every state_dict key, tied weights
    under each of their names, one tensor), read from the files alone: no process group,
    no model, no optimizer state. It holds the model once (4Ψ in fp32)."""
    return dict(model_tensors(path))
