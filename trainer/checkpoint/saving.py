"""Saving a checkpoint: every rank writes its file, rank 0 commits the whole by a rename.

[Note: atomic checkpoints]
All ranks write into `step_000120.tmp-<id>/` and fsync their files; they then agree (one
small AllReduce) that every rank succeeded; rank 0 fsyncs the directory, writes `COMPLETE`
into it, renames it to `step_000120` (atomic on one filesystem) and fsyncs the parent.
Only a directory with a final name and a `COMPLETE` marker counts as a checkpoint, so a
crash at any moment leaves the previous checkpoint complete and the partial one ignored;
it is removed by the next successful save. `ckpt.keep` prunes older checkpoints only
after the new one is in place, each by renaming it away first (atomic) and deleting it
after: a kill while pruning never leaves a final-named partial checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from trainer import comm
from trainer.checkpoint import agree, faults, files
from trainer.checkpoint.rng import rng_state
from trainer.errors import TrainingError
from trainer.parallel import state as engine_state


def maybe_save(
    cfg: DictConfig, engine, run_dir: Path, step: int, force: bool = False, **stateful: Any
) -> Path | None:
    """After optimizer step `step`: save every `ckpt.every` steps, at the last step, and
    when `force` (a stop on SIGTERM). `stateful` objects (the sampler, a scheduler) are
    saved through their state_dict()."""
    faults.fault("step", step)
    every, last = cfg.ckpt.every, cfg.train.steps
    if not force and step != last and not (every and step % every == 0):
        return None
    directory = files.checkpoint_dir(cfg, run_dir)
    return save(directory, step, engine, OmegaConf.to_yaml(cfg), cfg.ckpt.keep, **stateful)


def save(
    directory: Path, step: int, engine, config: str = "", keep: int = 0, **stateful: Any
) -> Path:
    """Write checkpoint `step` under `directory`; every rank calls it ([Note: atomic
    checkpoints]). Returns once the checkpoint is complete and visible to every rank."""
    directory, rank = Path(directory), comm.rank()
    final = files.step_dir(directory, step)
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
            state = engine_state.sharded_state(engine)
            save_id = tmp.name.rsplit("-", 1)[1]
            shard = {"params": state["params"], "optim": state["optim"], "rng": rng_state()}
            header = {
                "format": files.FORMAT,
                "id": save_id,
                "step": step,
                "layout": state["layout"],
            }
            path = tmp / f"rank{rank}.pt"
            files.write(path, {**header, "rank": rank, **shard})
            faults.fault("save", step, path)
            if rank == 0:
                meta = {
                    **header,
                    "run": files.lineage(directory),
                    "config": config,
                    "optimizer": type(engine.optimizer).__name__,
                    "optim_hparams": state["optim_hparams"],
                    "replicated": state["replicated"],
                    "state": {k: obj.state_dict() for k, obj in stateful.items()},
                }
                files.write(tmp / "meta.pt", meta)
        except Exception as e:  # every rank must learn of it, or the others would wait
            error = f"rank {rank} could not write its part of checkpoint {final}: {agree.line(e)}"
        error = agree.first_error(error, agree.device_of(engine))
        if error is not None:
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise TrainingError(error)
        if rank == 0:
            # Every rank's file is written and fsynced (the agreement above): mark it.
            marker = {"step": step, "id": save_id, "run": files.lineage(directory)}
            files.write_text(tmp / files.MARKER, json.dumps(marker))
            _commit(tmp, final)
            _prune(directory, keep, step)
        comm.barrier(tag="checkpoint").wait()
    return final


def _commit(tmp: Path, final: Path) -> None:
    files.fsync_dir(tmp)
    old = None
    if final.exists():  # this step written again, by a run resumed from an older one
        old = final.with_name(f"{final.name}.old-{uuid.uuid4().hex[:8]}")
        os.rename(final, old)
    os.rename(tmp, final)
    files.fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _prune(directory: Path, keep: int, step: int) -> None:
    """Remove leftovers of interrupted saves, then all but the newest `keep` complete
    checkpoints up to `step` (newer ones belong to a run this one resumed before). Each
    goes by an atomic rename out of the final names first ([Note: atomic checkpoints])."""
    if keep:
        done = [p for p in files.find_checkpoints(directory) if files.step_of(p) <= step]
        for p in done[keep:]:
            old = p.with_name(f"{p.name}.old-{uuid.uuid4().hex[:8]}")
            os.rename(p, old)
            faults.fault("prune", step, old)
        files.fsync_dir(directory)
    for leftover in [*directory.glob("step_*.tmp-*"), *directory.glob("step_*.old-*")]:
        shutil.rmtree(leftover, ignore_errors=True)
