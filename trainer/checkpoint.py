"""Sharded, atomic checkpoints: save, resume (also into another mode or world size) and
consolidate into one state_dict.

    start = checkpoint.maybe_resume(cfg, engine, run_dir, sampler=sampler)   # before the loop
    checkpoint.maybe_save(cfg, engine, run_dir, step, sampler=sampler)       # after each step

One directory per checkpoint under `ckpt.dir` (default `<run dir>/checkpoints`):

    step_000120/
      meta.pt    step, config (YAML), layout (mode, world size, per group: parameter
                 names, shapes, offsets, padded size, each rank's range), optimizer class
                 and hyperparameters, sampler (and other) state, buffers, checksum
      rank0.pt   this rank's slice of every sharded group (zero buckets, fsdp units) and
      rank1.pt   its optimizer state; rank 0 also holds unsharded groups (ddp's whole
      ...        model: ddp writes it once); every rank's RNG states; checksum
      COMPLETE   written last (JSON: step, save id, run lineage): only a directory
                 holding it counts as a checkpoint, as torch.distributed.checkpoint's
                 `.metadata`
    lineage      (beside the step directories) the id of the run that owns them: a
                 fresh run starts a new lineage, a resumed one continues its checkpoint's

Every file holds plain tensors and Python values only: `torch.load(weights_only=True)`
reads it, and that is the only way this module loads one. Each carries a CRC32 over its
contents, so a truncated or corrupted file is named rather than silently loaded.

[Note: atomic checkpoints]
All ranks write into `step_000120.tmp-<id>/` and fsync their files; they then agree (one
small AllReduce) that every rank succeeded; rank 0 fsyncs the directory, writes `COMPLETE`
into it, renames it to `step_000120` (atomic on one filesystem) and fsyncs the parent.
Only a directory with a final name and a `COMPLETE` marker counts as a checkpoint, so a
crash at any moment leaves the previous checkpoint complete and the partial one ignored;
it is removed by the next successful save. `ckpt.keep` prunes older checkpoints only
after the new one is in place, each by renaming it away first (atomic) and deleting it
after: a kill while pruning never leaves a final-named partial checkpoint.

[Note: run lineage]
Checkpoints under one `ckpt.dir` belong to one run and the runs that resumed it. A fresh
run (resume=null) refuses a directory that already holds checkpoints, instead of writing
its own steps between another run's; resume=auto takes only checkpoints of the lineage
named in `ckpt.dir/lineage`; resume=PATH continues PATH's lineage and refuses a
`ckpt.dir` that holds another's. Two processes never share a directory at the same time:
trainer/rundir.py locks it for the run.
`ckpt.dir` must be a filesystem that every rank sees (one machine, or a shared mount).

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

[Note: fault injection]
Tests kill or stall a rank at a chosen point through the environment:
SHARDTRAIN_FAULT="RANK:STEP:ACTION" with ACTION `kill` (SIGKILL after that step),
`hang` (stop answering after that step) or `kill_in_save` (SIGKILL halfway through
writing its file of that step's checkpoint) or `kill_in_prune` (SIGKILL halfway through
removing the checkpoint that step's save prunes). With SHARDTRAIN_FAULT_ONCE=PATH it fires
only while PATH does not exist (creating it), so a restarted group runs on undisturbed.
"""

from __future__ import annotations

import errno
import json
import math
import os
import pickle
import random
import shutil
import signal
import time
import uuid
import zlib
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from trainer import comm
from trainer.errors import ConfigError, TrainingError

FORMAT = 2  # 2: optimizer step counters per parameter name
MARKER, LINEAGE = "COMPLETE", "lineage"
FAULT_ENV, FAULT_ONCE_ENV = "SHARDTRAIN_FAULT", "SHARDTRAIN_FAULT_ONCE"


def step_dir(directory: Path, step: int) -> Path:
    return Path(directory) / f"step_{step:06d}"


def checkpoint_dir(cfg: DictConfig, run_dir: Path) -> Path:
    return Path(cfg.ckpt.dir) if cfg.ckpt.get("dir") else Path(run_dir) / "checkpoints"


def check_config(cfg: DictConfig) -> None:
    for key in ("every", "keep"):
        value = cfg.ckpt[key]
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ConfigError(f"ckpt.{key}={value!r} must be a whole number >= 0")


# ---------------------------------------------------------------------------------------
# Saving


def maybe_save(
    cfg: DictConfig, engine, run_dir: Path, step: int, force: bool = False, **stateful: Any
) -> Path | None:
    """After optimizer step `step`: save every `ckpt.every` steps, at the last step, and
    when `force` (a stop on SIGTERM). `stateful` objects (the sampler, a scheduler) are
    saved through their state_dict()."""
    _fault("step", step)
    every, last = cfg.ckpt.every, cfg.train.steps
    if not force and step != last and not (every and step % every == 0):
        return None
    directory = checkpoint_dir(cfg, run_dir)
    return save(directory, step, engine, OmegaConf.to_yaml(cfg), cfg.ckpt.keep, **stateful)


def save(
    directory: Path, step: int, engine, config: str = "", keep: int = 0, **stateful: Any
) -> Path:
    """Write checkpoint `step` under `directory`; every rank calls it ([Note: atomic
    checkpoints]). Returns once the checkpoint is complete and visible to every rank."""
    directory, rank = Path(directory), comm.rank()
    final = step_dir(directory, step)
    with comm.unaccounted():
        name: list[Any] = [None]
        if rank == 0:
            try:
                directory.mkdir(parents=True, exist_ok=True)
                name = [str(final.with_name(f"{final.name}.tmp-{uuid.uuid4().hex[:8]}"))]
                Path(name[0]).mkdir()
            except OSError as e:
                name = [OSError(f"cannot create a checkpoint under {directory}: {e}")]
        comm.broadcast_object(name)
        if isinstance(name[0], OSError):
            raise TrainingError(str(name[0]))
        tmp = Path(name[0])
        error = None
        try:
            state = engine.sharded_state()
            save_id = tmp.name.rsplit("-", 1)[1]
            shard = {"params": state["params"], "optim": state["optim"], "rng": _rng_state()}
            header = {"format": FORMAT, "id": save_id, "step": step, "layout": state["layout"]}
            path = tmp / f"rank{rank}.pt"
            _write(path, {**header, "rank": rank, **shard})
            _fault("save", step, path)
            if rank == 0:
                meta = {
                    **header,
                    "run": _lineage(directory),
                    "config": config,
                    "optimizer": type(engine.optimizer).__name__,
                    "optim_hparams": state["optim_hparams"],
                    "replicated": state["replicated"],
                    "state": {k: obj.state_dict() for k, obj in stateful.items()},
                }
                _write(tmp / "meta.pt", meta)
        except Exception as e:  # every rank must learn of it, or the others would wait
            error = f"rank {rank} could not write its part of checkpoint {final}: {_line(e)}"
        error = _first_error(error, _device(engine))
        if error is not None:
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise TrainingError(error)
        if rank == 0:
            # Every rank's file is written and fsynced (the agreement above): mark it.
            marker = {"step": step, "id": save_id, "run": _lineage(directory)}
            _write_text(tmp / MARKER, json.dumps(marker))
            _commit(tmp, final)
            _prune(directory, keep, step)
        comm.barrier(tag="checkpoint").wait()
    return final


def _write(path: Path, obj: dict[str, Any]) -> None:
    obj["checksum"] = _checksum(obj)
    write_file(path, obj, atomic=False)  # atomic already: the directory is renamed


def write_file(path: Path, obj: Any, atomic: bool = True) -> None:
    """torch.save `obj` to `path` and fsync it. `atomic`: through `<path>.tmp`, renamed
    at the end. A failed write leaves no partial or temporary file and raises
    TrainingError; a full disk is named as such (torch itself says only
    `[enforce fail at inline_container.cc:672] . unexpected pos 5952 vs 5846`)."""
    path = Path(path)
    target = path.with_name(path.name + ".tmp") if atomic else path
    sink = None
    try:
        with open(target, "wb") as f:
            sink = _Sink(f)
            torch.save(obj, sink)
            f.flush()
            os.fsync(f.fileno())
        if atomic:
            os.replace(target, path)
    except (OSError, RuntimeError) as e:
        target.unlink(missing_ok=True)
        cause = next((x for x in (e, e.__context__, sink and sink.error) if _is_full(x)), None)
        if cause is not None:
            raise TrainingError(
                f"no space left on device writing {path} (it needs about "
                f"{_megabytes(_tensor_bytes(obj))}; free some, or set a ckpt.dir with room)"
            ) from None
        raise TrainingError(f"cannot write {path}: {_line(e)}") from None


class _Sink:
    """The file torch.save writes through: keeps the OSError of a failed write, which
    torch replaces with a message of its own ("unexpected pos ...")."""

    def __init__(self, f) -> None:
        self.f, self.error = f, None

    def write(self, data: bytes) -> int:
        try:
            return self.f.write(data)
        except OSError as e:
            self.error = e
            raise

    def flush(self) -> None:
        self.f.flush()


def _is_full(e: BaseException | None) -> bool:
    return isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)


def _tensor_bytes(obj: Any) -> int:
    if torch.is_tensor(obj):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def _megabytes(n: int) -> str:
    return f"{n / 2**20:.1f} MB" if n >= 2**20 else f"{n / 2**10:.1f} kB"


def _write_text(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _commit(tmp: Path, final: Path) -> None:
    _fsync_dir(tmp)
    old = None
    if final.exists():  # this step written again, by a run resumed from an older one
        old = final.with_name(f"{final.name}.old-{uuid.uuid4().hex[:8]}")
        os.rename(final, old)
    os.rename(tmp, final)
    _fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _prune(directory: Path, keep: int, step: int) -> None:
    """Remove leftovers of interrupted saves, then all but the newest `keep` complete
    checkpoints up to `step` (newer ones belong to a run this one resumed before). Each
    goes by an atomic rename out of the final names first ([Note: atomic checkpoints])."""
    if keep:
        done = [p for p in find_checkpoints(directory) if _step_of(p) <= step]
        for p in done[keep:]:
            old = p.with_name(f"{p.name}.old-{uuid.uuid4().hex[:8]}")
            os.rename(p, old)
            _fault("prune", step, old)
        _fsync_dir(directory)
    for leftover in [*directory.glob("step_*.tmp-*"), *directory.glob("step_*.old-*")]:
        shutil.rmtree(leftover, ignore_errors=True)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------
# Finding and resuming


def find_checkpoints(directory: Path) -> list[Path]:
    """Checkpoints under `directory`, newest first: directories with a final name and
    the marker a save writes last. load() checks that every file is there and intact."""
    found = [
        p for p in Path(directory).glob("step_*") if p.name[5:].isdigit() and _marker(p) is not None
    ]
    return sorted(found, key=_step_of, reverse=True)


def _step_of(path: Path) -> int:
    return int(path.name[5:])


def _marker(path: Path) -> dict[str, Any] | None:
    """The COMPLETE marker of checkpoint `path`, or None when it has none (unfinished)."""
    try:
        marker = json.loads((Path(path) / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def _lineage(directory: Path) -> str | None:
    """The run lineage that owns `directory` ([Note: run lineage]); None if unclaimed."""
    try:
        return (Path(directory) / LINEAGE).read_text().strip() or None
    except OSError:
        return None


def maybe_resume(cfg: DictConfig, engine, run_dir: Path, **stateful: Any) -> int:
    """Load the checkpoint `resume` names and return its step, or 0 to start afresh.

    resume=auto: the newest complete checkpoint of this directory's lineage under
    ckpt.dir that loads (a newer one that does not is skipped, with a warning naming the
    file); none: one line says so and the run starts from step 0. resume=PATH: that
    checkpoint, or an error. resume=null: start afresh into a ckpt.dir without
    checkpoints, except in a group torchrun has restarted (TORCHELASTIC_RESTART_COUNT >
    0), which resumes as with auto. Values given on the command line win over the
    checkpoint's (optimizer hyperparameters, schedule); one line names those that differ.
    """
    check_config(cfg)
    choice = cfg.get("resume")
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    if choice is None and restarted:
        choice = "auto"
    directory = checkpoint_dir(cfg, run_dir)
    if choice is None:
        _agree(_claim, directory, None)
        return 0
    if str(choice) != "auto":
        path = Path(str(choice))
        _agree(_claim, directory, (_marker(path) or {}).get("run") or "")
        meta = _load(path, engine, **stateful)
        _check_resumable(cfg, path, meta)
        _say(f"resumed from {choice} at step {meta['step']}")
        return int(meta["step"])
    # Every rank tries the same candidates in the same order.
    found: list[Any] = _agree(_candidates, directory)
    for i, path in enumerate(found):
        try:
            meta = _load(path, engine, **stateful)
        except ConfigError as e:
            if i == len(found) - 1:
                raise
            _say(f"warning: skipping checkpoint {path}: {e}")
            continue
        _check_resumable(cfg, path, meta)
        _agree(_claim, directory, (_marker(path) or {}).get("run") or "")
        _say(f"resumed from {path} at step {meta['step']}")
        return int(meta["step"])
    _agree(_claim, directory, None)
    hint = "is ckpt.dir right?"
    if restarted:
        hint = "restarted: give a fixed hydra.run.dir or ckpt.dir so that a restart finds them"
    _say(
        f"warning: resume=auto found no checkpoint under {directory}; starting from step 0 ({hint})"
    )
    return 0


def _candidates(directory: Path) -> list[Path]:
    """resume=auto's candidates, newest first: those of the directory's lineage."""
    lineage, found = _lineage(directory), find_checkpoints(directory)
    if lineage is None:
        return found
    ours = [p for p in found if (_marker(p) or {}).get("run") == lineage]
    for p in found:
        if p not in ours:
            _say(f"warning: skipping checkpoint {p}: it belongs to another run than {lineage}")
    return ours


def _claim(directory: Path, lineage: str | None) -> str:
    """Make `directory` this run's ([Note: run lineage]): a new lineage when `lineage`
    is None (a fresh run), else `lineage` ("" for a checkpoint written before lineages).
    Refuses a directory holding checkpoints of another lineage. Rank 0 alone."""
    theirs = sorted(
        (p for p in Path(directory).glob("step_*") if p.name[5:].isdigit()), key=_step_of
    )
    owner = _lineage(directory)
    if lineage is None and theirs:
        raise ConfigError(
            f"ckpt.dir {directory} already holds checkpoints of another run (up to "
            f"{theirs[-1].name}); continue that run with resume=auto, or start this one in "
            "a new hydra.run.dir or ckpt.dir"
        )
    if lineage and owner and owner != lineage and theirs:
        raise ConfigError(
            f"ckpt.dir {directory} holds checkpoints of another run ({owner}) than the one "
            "resumed; give this run a new hydra.run.dir or ckpt.dir"
        )
    lineage = lineage or owner or uuid.uuid4().hex
    try:
        Path(directory).mkdir(parents=True, exist_ok=True)
        if owner != lineage:
            _write_text(Path(directory) / LINEAGE, lineage)
    except OSError as e:
        raise ConfigError(f"ckpt.dir {directory} is not writable: {e.strerror}") from None
    return lineage


def _agree(fn, *args: Any) -> Any:
    """`fn(*args)` on rank 0, its result (or ConfigError) on every rank."""
    out: list[Any] = [None]
    if comm.rank() == 0:
        try:
            out = [fn(*args)]
        except ConfigError as e:
            out = [e]
    comm.broadcast_object(out)
    if isinstance(out[0], ConfigError):
        raise ConfigError(str(out[0]))
    return out[0]


# Keys a resumed run must share with its checkpoint: the sampler's position means
# nothing in another permutation or another dataset. (`root` and `download` only say
# where the files are.)
_FIXED_ON_RESUME = ("seed", "data.dataset")
_WHERE_KEYS = ("root", "download")


def _check_resumable(cfg: DictConfig, path: Path, meta: dict[str, Any]) -> None:
    """Refuse a changed seed or dataset; name the values that differ from the
    checkpoint's and take this run's (optimizer, schedule, steps) in one line."""
    if not meta.get("config") or "optim" not in cfg:
        return  # a checkpoint saved by code outside the trainer (tests, own loops)
    saved = OmegaConf.create(meta["config"])
    for key in _FIXED_ON_RESUME:
        mine, theirs = _plain(OmegaConf.select(cfg, key)), _plain(OmegaConf.select(saved, key))
        if isinstance(mine, dict) and isinstance(theirs, dict):
            mine = {k: v for k, v in mine.items() if k not in _WHERE_KEYS}
            theirs = {k: v for k, v in theirs.items() if k not in _WHERE_KEYS}
        if mine != theirs:
            raise ConfigError(
                f"{key}={_show(mine)} differs from checkpoint {path}'s {key}={_show(theirs)}: "
                "the data order would not continue; resume with the same value, or start "
                "a fresh run"
            )
    changed = []
    for key in ("optim", "train.steps"):
        mine, theirs = _flatten(key, cfg), _flatten(key, saved)
        changed += [
            f"{k}={_show(v)} (checkpoint: {_show(theirs.get(k))})"
            for k, v in mine.items()
            if theirs.get(k) != v
        ]
    if changed:
        _say(f"resumed with values that differ from the checkpoint's: {', '.join(changed)}")


def _plain(node: Any) -> Any:
    return OmegaConf.to_container(node, resolve=False) if OmegaConf.is_config(node) else node


def _flatten(key: str, cfg: DictConfig) -> dict[str, Any]:
    node = OmegaConf.select(cfg, key)
    if not OmegaConf.is_config(node):
        return {key: node}
    return {f"{key}.{k}": _plain(node[k]) for k in node}


def _show(value: Any) -> str:
    return str(value).replace("\n", " ")


def load(path: Path, engine, **stateful: Any) -> int:
    """Load checkpoint `path` into `engine` (and `stateful` objects); return its step.

    Every rank calls it. All files are read and checked before anything changes: a
    missing, truncated, corrupted or mismatched file raises ConfigError naming it, on
    every rank alike, with the engine untouched and nothing on disk modified.
    """
    return int(_load(path, engine, **stateful)["step"])


def _load(path: Path, engine, **stateful: Any) -> dict[str, Any]:
    path = Path(path)
    prepared, error = None, None
    try:
        prepared = _prepare(path, engine)
    except ConfigError as e:
        error = str(e)
    except Exception as e:  # reading must fail alike on every rank, not leave one behind
        error = f"checkpoint {path} cannot be loaded: {type(e).__name__}: {_line(e)}"
    with comm.unaccounted():
        error = _first_error(error, _device(engine))
    if error is not None:
        raise ConfigError(error)
    meta, state, rng = prepared
    mine = _hparams(engine.optimizer)  # the values this run was built with
    for name, obj in stateful.items():
        if name in meta["state"]:
            try:
                obj.load_state_dict(meta["state"][name])
            except ConfigError as e:
                raise ConfigError(f"{path / 'meta.pt'}: {e}") from None
    with comm.unaccounted():
        engine.load_sharded_state(state)
    _keep_hparams(engine.optimizer, mine, stateful.get("scheduler"))
    if rng is not None:
        _set_rng_state(rng)
    return meta


def _hparams(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def _keep_hparams(optimizer: torch.optim.Optimizer, mine: list[dict[str, Any]], scheduler) -> None:
    """Put this run's hyperparameters back over the checkpoint's, which the engine
    loaded: what the user passes (a lower lr on resume) wins. The learning rate is the
    base lr (`initial_lr`) times the schedule's factor at the restored position, as the
    scheduler computes it, so an unchanged run continues bitwise as before."""
    for group, values in zip(optimizer.param_groups, mine, strict=True):
        group.update({k: v for k, v in values.items() if k != "lr"})
    lambdas = getattr(scheduler, "lr_lambdas", None)
    if lambdas is None:  # no schedule: the lr is the configured one
        for group, values in zip(optimizer.param_groups, mine, strict=True):
            group["lr"] = values["lr"]
        return
    scheduler.base_lrs = [g["initial_lr"] for g in optimizer.param_groups]
    for group, base, factor in zip(
        optimizer.param_groups, scheduler.base_lrs, lambdas, strict=True
    ):
        group["lr"] = base * factor(scheduler.last_epoch)
    scheduler._last_lr = [g["lr"] for g in optimizer.param_groups]


def _prepare(path: Path, engine) -> tuple[dict, dict, dict | None]:
    """Read what this rank needs, check it, and cut this rank's state (no side effects)."""
    meta = read_meta(path)
    mine, saved = engine.shard_layout(), meta["layout"]
    module = engine.module.state_dict()
    buffers = {k: tuple(module[k].shape) for k, name in mine["keys"] if name is None}
    _check_compatible(path / "meta.pt", meta, mine, buffers, type(engine.optimizer).__name__)
    rank = comm.rank()
    if saved == mine:  # the fast path: this rank's file (and rank 0's for unsharded groups)
        need = {rank} | {0 for g in saved["groups"] if not g["sharded"]}
    else:  # [Note: re-cutting shards]
        need = set(range(saved["world_size"]))
    files = {r: read_rank(path, r, meta) for r in sorted(need)}
    if saved == mine:
        state = {"params": [], "optim": []}
        for i, g in enumerate(saved["groups"]):
            holder = files[rank if g["sharded"] else 0]
            state["params"].append(holder["params"][i])
            state["optim"].append(holder["optim"][i])
    else:
        state = recut(saved, files, mine, rank)
    state["optim_hparams"] = meta["optim_hparams"]
    state["replicated"] = meta["replicated"]
    return meta, state, files[rank]["rng"] if rank in files else None


# ---------------------------------------------------------------------------------------
# Reading and checking files


def read_meta(path: Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_dir():
        raise ConfigError(f"checkpoint {path} does not exist or is not a directory")
    meta = _read(path / "meta.pt")
    for key in ("step", "layout", "optim_hparams", "replicated", "state"):
        if key not in meta:
            raise ConfigError(f"{path / 'meta.pt'} is not a checkpoint's meta.pt (no {key!r})")
    return meta


def read_rank(path: Path, rank: int, meta: dict[str, Any]) -> dict[str, Any]:
    """Rank `rank`'s file, checked to belong to the checkpoint that `meta` describes."""
    file = Path(path) / f"rank{rank}.pt"
    data = _read(file)
    layout, want = data.get("layout", {}), meta["layout"]
    if layout != want or data.get("rank") != rank or data.get("id") != meta.get("id"):
        if layout.get("mode") != want["mode"] or layout.get("world_size") != want["world_size"]:
            what = (
                f"a shard of mode {layout.get('mode')} over {layout.get('world_size')} ranks, "
                f"while meta.pt describes mode {want['mode']} over {want['world_size']} ranks"
            )
        elif layout != want:
            what = "a shard of another parameter layout than meta.pt describes"
        elif data.get("rank") != rank:
            what = f"rank {data.get('rank')}'s shard"
        else:
            what = f"a shard of another save (id {data.get('id')}, meta.pt has {meta.get('id')})"
        raise ConfigError(f"{file} does not belong to this checkpoint: it holds {what}")
    if data.get("step") != meta["step"]:
        raise ConfigError(f"{file} is from step {data.get('step')}, meta.pt from {meta['step']}")
    return data


def _read(file: Path) -> dict[str, Any]:
    if not file.is_file():
        raise ConfigError(f"{file} is missing: the checkpoint is incomplete")
    try:
        data = torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        if "weights only load failed" not in str(e).lower():
            raise ConfigError(f"{file} is truncated or corrupted: {_line(e)}") from None
        # torch's message suggests weights_only=False, which would run that code.
        raise ConfigError(
            f"{file} holds objects other than tensors and plain values; it was not loaded, "
            "for safety (unpickling it could run code)"
        ) from None
    except Exception as e:
        raise ConfigError(f"{file} is truncated or corrupted: {_line(e)}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT or "checksum" not in data:
        raise ConfigError(f"{file} is not a checkpoint file of this trainer (format {FORMAT})")
    stored = data.pop("checksum")
    if _checksum(data) != stored:
        raise ConfigError(f"{file} is corrupted: its contents do not match their checksum")
    return data


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


# ---------------------------------------------------------------------------------------
# Re-cutting ([Note: re-cutting shards]) and consolidating


def full_tensors(layout: dict, files: dict[int, dict]) -> tuple[dict, dict, dict]:
    """Whole tensors by parameter name from the ranks' files of a checkpoint written
    with `layout`: (values, per-element optimizer tensors, other optimizer state of the
    parameters that have any)."""
    values: dict[str, torch.Tensor] = {}
    per_element: dict[str, dict[str, torch.Tensor]] = {}
    scalar: dict[str, dict[str, Any]] = {}
    for i, g in enumerate(layout["groups"]):
        holders = range(layout["world_size"]) if g["sharded"] else [0]
        ranges = [g["ranges"][r] for r in holders]
        flat = _assemble([files[r]["params"][i] for r in holders], ranges)
        entries = [files[r]["optim"][i] for r in holders]
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


# ---------------------------------------------------------------------------------------
# Checksums, RNG states, agreement between ranks, fault injection


def _checksum(obj: Any, crc: int = 0) -> int:
    """CRC32 over a nested structure: tensors by dtype, shape and bytes, the rest by repr."""
    if torch.is_tensor(obj):
        t = obj.detach().cpu().contiguous().reshape(-1)
        crc = zlib.crc32(f"{t.dtype}{tuple(obj.shape)}".encode(), crc)
        return zlib.crc32(t.view(torch.uint8).numpy(), crc)
    if isinstance(obj, dict):
        for k, v in obj.items():
            crc = _checksum(v, zlib.crc32(repr(k).encode(), crc))
        return crc
    if isinstance(obj, list | tuple):
        crc = zlib.crc32(f"{type(obj).__name__}{len(obj)}".encode(), crc)
        for v in obj:
            crc = _checksum(v, crc)
        return crc
    return zlib.crc32(repr(obj).encode(), crc)


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    try:
        import numpy as np

        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        state["numpy"] = [kind, torch.from_numpy(keys.astype("int64")), pos, has_gauss, gauss]
    except ImportError:
        pass
    # This rank's device generator only: get_rng_state_all() would create a CUDA context
    # on every visible GPU in every rank, and its list would not fit a resume on another
    # GPU count. A process that never used CUDA has no generator state worth keeping.
    if torch.cuda.is_initialized():
        state["cuda_device"] = torch.cuda.get_rng_state(torch.cuda.current_device())
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, gauss))
    if not torch.cuda.is_initialized():
        return
    device = torch.cuda.current_device()
    if "cuda_device" in state:
        torch.cuda.set_rng_state(state["cuda_device"], device)
    elif "cuda" in state and device < len(state["cuda"]):
        # Checkpoints written before "cuda_device": every visible GPU's state, by index.
        torch.cuda.set_rng_state(state["cuda"][device], device)


def _device(engine) -> torch.device:
    # A device the backend can reduce on: where the model lives (cuda for nccl).
    return next(engine.module.parameters()).device


def _first_error(error: str | None, device: torch.device) -> str | None:
    """Every rank learns the lowest failing rank's error, or None when all succeeded."""
    failed = torch.zeros(comm.world_size(), device=device)
    if error is not None:
        failed[comm.rank()] = 1
    comm.all_reduce(failed, tag="checkpoint", account=False).wait()
    ranks = failed.nonzero().flatten().tolist()
    if not ranks:
        return None
    message = [error]
    comm.broadcast_object(message, src=int(ranks[0]))
    return message[0]


_said: set[str] = set()


def _say(message: str) -> None:
    # Once per process: a checkpoint skipped again (a later load, a restart's retry)
    # would otherwise repeat the same warning.
    if comm.rank() == 0 and message not in _said:
        _said.add(message)
        tqdm.write(message)  # above the progress bar, not through it


def _line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return (text[0] if text else type(e).__name__)[:200]


def _fault(where: str, step: int, path: Path | None = None) -> None:
    """[Note: fault injection]. Free unless SHARDTRAIN_FAULT is set."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    rank, at, action = spec.split(":")
    point = {"kill_in_save": "save", "kill_in_prune": "prune"}.get(action, "step")
    if (int(rank), int(at), point) != (comm.rank(), step, where):
        return
    once = os.environ.get(FAULT_ONCE_ENV)
    if once:
        if os.path.exists(once):
            return
        Path(once).touch()
    if action == "hang":
        while True:
            time.sleep(60)
    if action == "kill_in_save" and path is not None:
        os.truncate(path, path.stat().st_size // 2)  # as if killed in the middle of writing
    if action == "kill_in_prune" and path is not None:
        (path / "meta.pt").unlink()  # as if killed in the middle of deleting it
    os.kill(os.getpid(), signal.SIGKILL)
