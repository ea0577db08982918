"""Resuming: which checkpoint `resume` picks, and loading it into an engine.

[Note: run lineage]
Checkpoints under one `ckpt.dir` belong to one run and the runs that resumed it. A fresh
run (resume=null) refuses a directory that already holds checkpoints, instead of writing
its own steps between another run's; resume=auto takes only checkpoints of the lineage
named in `ckpt.dir/lineage`; resume=PATH continues PATH's lineage and refuses a
`ckpt.dir` that holds another's. Two processes never share a directory at the same time:
trainer/run/rundir.py locks it for the run.
`ckpt.dir` must be a filesystem that every rank sees (one machine, or a shared mount).
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from trainer import comm
from trainer.checkpoint import agree, files, saving
from trainer.checkpoint.recutting import prepare
from trainer.checkpoint.rng import set_rng_state
from trainer.errors import (
    ConfigError,
    Damaged,
    Missing,
    NotResumable,
    StorageError,
    TrainingError,
)


def check_config(cfg: DictConfig) -> None:
    for key in ("every", "keep"):
        value = cfg.ckpt[key]
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ConfigError(f"ckpt.{key}={value!r} must be a whole number >= 0")
    value = cfg.ckpt.get("buffer_mb", 1)
    if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
        raise ConfigError(f"ckpt.buffer_mb={value!r} must be a number of megabytes > 0")


def maybe_resume(cfg: DictConfig, engine, run_dir: Path, **stateful: Any) -> int:
    """Load the checkpoint `resume` names and return its step, or 0 to start afresh.

    resume=auto: the newest complete checkpoint of this directory's lineage under
    ckpt.dir that loads. A newer one that is damaged (a file that no rank finds, or whose
    bytes fail their checksum, do not unpickle, or end early) is set aside (renamed to
    `step_N.damaged-<id>`, one line naming the file); one that does not load for another
    reason is skipped, with a warning naming it. None left: one line says so and the run
    starts from step 0. A read that the storage fails (EIO, ESTALE, EACCES, a file one
    rank does not find while another does) is retried a few times, then fails the resume
    on every rank with StorageError, nothing renamed ([Note: storage errors are not
    damage] in storage.py). resume=PATH: that checkpoint, or an error.
    resume=null: start afresh into a ckpt.dir without checkpoints, except in a group
    torchrun has restarted (TORCHELASTIC_RESTART_COUNT > 0), which resumes as with auto.
    Values given on the command line win over the checkpoint's (optimizer hyperparameters,
    schedule, steps, train.grad_accum_steps); one line names those that differ. A changed
    seed, dataset or train.batch_size is refused, and so are other tokens ([Note: what
    the data is] in trainer/data/tokens.py).
    """
    check_config(cfg)
    choice = cfg.get("resume")
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    if choice is None and restarted:
        choice = "auto"
    directory = files.checkpoint_dir(cfg, run_dir)
    if choice is None:
        agree.agree(_claim, directory, None)
        return 0
    if str(choice) != "auto":
        path = Path(str(choice))
        agree.agree(_claim_of, directory, path)
        meta = _load(path, engine, cfg, **stateful)
        _say_changes(cfg, meta)
        agree.say(f"resumed from {choice} at step {meta['step']}")
        return int(meta["step"])
    # Every rank tries the same candidates in the same order.
    found: list[Any] = agree.agree(_candidates, directory)
    damaged = 0
    for i, path in enumerate(found):
        try:
            meta = _load(path, engine, cfg, **stateful)
        except Damaged as e:  # it can never load: out of the way, never deleted
            aside = agree.agree(_set_aside, path)
            where = f"set aside as {aside}" if aside else "left in place (it cannot be renamed)"
            agree.say(f"warning: checkpoint {path} is damaged ({e}); {where}; trying an older one")
            damaged += 1
            continue
        except ConfigError as e:
            if i == len(found) - 1 or isinstance(e, NotResumable):
                raise
            agree.say(f"warning: skipping checkpoint {path}: {e}")
            continue
        _say_changes(cfg, meta)
        agree.agree(_claim_of, directory, path)
        agree.say(f"resumed from {path} at step {meta['step']}")
        return int(meta["step"])
    agree.agree(_claim, directory, None)
    hint = "is ckpt.dir right?"
    if damaged:
        hint = f"{damaged} damaged one(s) set aside, none older"
    elif restarted:
        hint = "restarted: give a fixed hydra.run.dir or ckpt.dir so that a restart finds them"
    agree.say(
        f"warning: resume=auto found no checkpoint under {directory}; starting from step 0 ({hint})"
    )
    return 0


def _candidates(directory: Path) -> list[Path]:
    """resume=auto's candidates, newest first: those of the directory's lineage, after
    finishing the commits that a crash interrupted ([Note: atomic checkpoints])."""
    saving.finish_commits(directory)
    lineage, found = files.lineage(directory), files.find_checkpoints(directory)
    if lineage is None:
        return found
    ours = [p for p in found if (files.marker(p) or {}).get("run") == lineage]
    for p in found:
        if p not in ours:
            agree.say(f"warning: skipping checkpoint {p}: it belongs to another run than {lineage}")
    return ours


def _set_aside(path: Path) -> str | None:
    """Rename damaged checkpoint `path` out of the checkpoint names (to
    `step_000120.damaged-<id>`, which no save prunes); its new name, or None when it
    cannot be renamed (read-only: then it is skipped alone, as before). Rank 0 alone."""
    aside = path.with_name(f"{path.name}.damaged-{uuid.uuid4().hex[:8]}")
    try:
        os.rename(path, aside)
        files.fsync_dir(path.parent)
    except OSError:
        return None
    return str(aside)


def _claim_of(directory: Path, path: Path) -> str:
    """`_claim` for the lineage of checkpoint `path` (read by rank 0 alone: a marker the
    storage fails is the same error on every rank)."""
    return _claim(directory, (files.marker(path) or {}).get("run") or "")


def _claim(directory: Path, lineage: str | None) -> str:
    """Make `directory` this run's ([Note: run lineage]): a new lineage when `lineage`
    is None (a fresh run), else `lineage` ("" for a checkpoint written before lineages).
    Refuses a directory holding checkpoints of another lineage. Rank 0 alone."""
    theirs = sorted(
        (p for p in Path(directory).glob("step_*") if p.name[5:].isdigit()), key=files.step_of
    )
    owner = files.lineage(directory)
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
            files.write_text(Path(directory) / files.LINEAGE, lineage)
    except OSError as e:
        raise ConfigError(f"ckpt.dir {directory} is not writable: {e.strerror}") from None
    return lineage


# Keys a resumed run must share with its checkpoint, and why. (`root` and `download` of
# a dataset only say where its files are.) A changed train.grad_accum_steps or world size
# is taken: the same samples make each step, only cut into other micro-batches or ranks.
_FIXED_ON_RESUME = {
    "seed": "the data order would not continue",
    "data.dataset": "the data order would not continue",
    "train.batch_size": (
        "the data order would not continue, and each step would average another number "
        "of samples than the learning rate was set for"
    ),
}
_WHERE_KEYS = ("root", "download")
# [Note: keys a dataset gained]: a checkpoint written before a dataset's config gained a
# key (data.mix, data.doc_mask) resumes where this run leaves that key at None or False,
# which reads the data as before; a target renamed since compares under its old name.
_RENAMED_TARGETS = {"trainer.data.mix.token_data": "trainer.data.tokens.TokenData"}
# Keys a resumed run may change; one line names those that differ.
_TAKEN_ON_RESUME = ("optim", "train.steps", "train.grad_accum_steps")


def refuse_changes(cfg: DictConfig, path: Path, meta: dict[str, Any]) -> None:
    """Refuse a changed seed, dataset or batch size, before anything is loaded."""
    saved = _saved_config(cfg, meta)
    if saved is None:
        return
    for key, why in _FIXED_ON_RESUME.items():
        mine, theirs = _plain(OmegaConf.select(cfg, key)), _plain(OmegaConf.select(saved, key))
        if isinstance(mine, dict) and isinstance(theirs, dict):
            mine, theirs = (
                _comparable(cfg, key, mine, theirs),
                _comparable(saved, key, theirs, mine),
            )
        if mine != theirs:
            raise NotResumable(
                f"{key}={_show(mine)} differs from checkpoint {path}'s {key}={_show(theirs)}: "
                f"{why}; resume with {key}={_show(theirs)}, or start a fresh run in a new "
                "hydra.run.dir (without resume)"
            )


def _say_changes(cfg: DictConfig, meta: dict[str, Any]) -> None:
    """One line naming the values that differ from the checkpoint's, which this run
    takes (optimizer, schedule, steps, accumulation)."""
    saved = _saved_config(cfg, meta)
    if saved is None:
        return
    changed = []
    for key in _TAKEN_ON_RESUME:
        mine, theirs = _flatten(key, cfg), _flatten(key, saved)
        changed += [
            f"{k}={_show(v)} (checkpoint: {_show(theirs.get(k))})"
            for k, v in mine.items()
            if theirs.get(k) != v
        ]
    if changed:
        agree.say(f"resumed with values that differ from the checkpoint's: {', '.join(changed)}")


def _comparable(cfg: DictConfig, key: str, node: dict, other: dict) -> dict:
    """`node` (cfg's `key`) without where-keys, without keys `other` lacks that `cfg` sets
    to None or False, its target under its old name ([Note: keys a dataset gained])."""
    out = {
        k: v
        for k, v in node.items()
        if k not in _WHERE_KEYS
        and (k in other or OmegaConf.select(cfg, f"{key}.{k}") not in (None, False))
    }
    if out.get("_target_") in _RENAMED_TARGETS:
        out["_target_"] = _RENAMED_TARGETS[out["_target_"]]
    return out


def _saved_config(cfg: DictConfig | None, meta: dict[str, Any]) -> DictConfig | None:
    if cfg is None or not meta.get("config") or "optim" not in cfg:
        return None  # a checkpoint saved by code outside the trainer (tests, own loops)
    return OmegaConf.create(meta["config"])


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
    return int(_load(path, engine, None, **stateful)["step"])


def _load(path: Path, engine, cfg: DictConfig | None, **stateful: Any) -> dict[str, Any]:
    """Load `path` (see `load`); with `cfg`, first refuse values it cannot resume with."""
    path = Path(path)
    device = agree.device_of(engine)
    prepared, error = None, None
    try:
        prepared = prepare(path, engine)
    except Missing as e:
        error = ("missing", str(e), e.path)
    except Damaged as e:
        error = ("damaged", str(e), None)
    except StorageError as e:
        error = ("storage", str(e), None)
    except ConfigError as e:
        error = ("other", str(e), None)
    except Exception as e:  # reading must fail alike on every rank, not leave one behind
        why = f"checkpoint {path} cannot be loaded: {type(e).__name__}: {agree.line(e)}"
        error = ("other", why, None)
    with comm.unaccounted():
        _verdict(agree.all_errors(error, device), device)
    meta, load_into, rng = prepared
    refuse_changes(cfg, path, meta)  # every rank alike: the same files and config
    mine = _hparams(engine.optimizer)  # the values this run was built with
    refusal = None
    for name, obj in stateful.items():  # the sampler first: it refuses other data
        if name in meta["state"]:
            try:
                obj.load_state_dict(meta["state"][name])
            except ConfigError as e:
                refusal = f"{path / 'meta.pt'}: {e}"
                break
    # A rank's data may differ from the others' (a copy per node): all refuse alike, and
    # at once, since an older checkpoint of the same run would be refused the same way.
    with comm.unaccounted():
        refusal = agree.first_error(refusal, agree.device_of(engine))
    if refusal is not None:
        raise NotResumable(refusal)
    # [Note: re-cutting shards]: range by range, into its tensors. The ranges were all read
    # and checked above; a read that fails now (the storage again) fails every rank alike.
    failed = None
    try:
        with comm.unaccounted():
            load_into(engine)
    except (ConfigError, TrainingError) as e:
        failed = f"rank {comm.rank()}: {e}"
    with comm.unaccounted():
        failed = agree.first_error(failed, device)
    if failed is not None:  # it read and checked well a moment before: not damage
        raise StorageError(f"{failed} (while loading it, once read and checked); nothing was "
                           f"set aside: {_AGAIN}")  # fmt: skip
    _keep_hparams(engine.optimizer, mine, stateful.get("scheduler"))
    if rng is not None:
        set_rng_state(rng)
    return meta


def _verdict(errors: list[tuple[int, tuple[str, str, str | None]]], device) -> None:
    """Raise on every rank alike what the failing ranks' errors (rank, (kind, message,
    missing file)) say of the checkpoint ([Note: storage errors are not damage] in
    storage.py): damage that any rank proves (bytes that are wrong, a file that no rank
    finds) makes it Damaged, set aside by resume=auto; else a storage error of any rank (a
    read that failed, a file that one rank misses while another finds it) fails the resume
    with its line, nothing renamed; else the first rank's error (ConfigError)."""
    if not errors:
        return
    missing = sorted({f for _, (kind, _, f) in errors if kind == "missing"})
    found = dict(zip(missing, agree.found_by(missing, device), strict=True))  # collective
    for _, (kind, message, f) in errors:
        if kind == "damaged" or (kind == "missing" and found[f] == ([], [])):
            raise Damaged(message)
    for rank, (kind, message, f) in errors:
        if kind == "storage":
            raise StorageError(f"rank {rank} {message}; nothing was set aside: {_AGAIN}")
        if kind == "missing":
            seen, unsure = found[f]
            by = (
                f"rank {_few(seen)} finds it"
                if seen
                else f"the storage of rank {_few(unsure)} cannot tell"
            )
            raise StorageError(
                f"rank {rank} does not find {f}, while {by}: every rank must see one and the "
                f"same ckpt.dir (a shared filesystem); nothing was set aside: {_AGAIN}"
            )
    raise ConfigError(errors[0][1][1])


_AGAIN = "resume again once the storage answers"


def _few(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks[:4])) + (" ..." if len(ranks) > 4 else "")


def _hparams(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def _keep_hparams(optimizer: torch.optim.Optimizer, mine: list[dict[str, Any]], scheduler) -> None:
    """Put this run's hyperparameters back over the checkpoint's, which the engine
    loaded: what the user passes (a lower lr on resume) wins. The learning rate is the
    base lr (`initial_lr`) times the schedule's factor at the restored position, as the
    scheduler computes it, so an unchanged run continues bitwise as before."""
    for group, values in zip(optimizer.param_groups, mine, strict=True):
        group.update({k: v for k, v in values.items() if k != "lr"})
    if scheduler is None:  # no schedule: the lr is the configured one
        for group, values in zip(optimizer.param_groups, mine, strict=True):
            group["lr"] = values["lr"]
        return
    scheduler.rebase([g["initial_lr"] for g in optimizer.param_groups])
