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

import copy
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from trainer import comm
from trainer.checkpoint import agree, background, faults, files, stream
from trainer.checkpoint.rng import rng_state
from trainer.errors import TrainingError
from trainer.parallel import state as engine_state

DEFAULT_BUFFER_MB = 64  # ckpt.buffer_mb: the staging buffer of a save
REPLICATED = "replicated/"  # data entries of buffers and frozen parameters (rank 0)


def maybe_save(
    cfg: DictConfig, engine, run_dir: Path, step: int, force: bool = False, **stateful: Any
) -> Path | None:
    """After optimizer step `step`: save every `ckpt.every` steps, at the last step, and
    when `force` (a stop on SIGTERM). `stateful` objects (the sampler, a scheduler) are
    saved through their state_dict(). With `ckpt.async` the save is written in the
    background ([Note: async save]), except at the last step and a stop, which wait for
    it: nothing is left to overlap."""
    if faults.armed():  # [Note: fault injection]; `corrupt` needs the directory
        faults.fault("step", step, files.checkpoint_dir(cfg, run_dir))
    every, last = cfg.ckpt.every, cfg.train.steps
    if not force and step != last and not (every and step % every == 0):
        return None
    directory = files.checkpoint_dir(cfg, run_dir)
    config, keep = OmegaConf.to_yaml(cfg), cfg.ckpt.keep
    buffer_mb = cfg.ckpt.get("buffer_mb", DEFAULT_BUFFER_MB)
    in_background = bool(cfg.ckpt.get("async", False))
    path = save(directory, step, engine, config, keep, buffer_mb, in_background, **stateful)
    if in_background and (force or step == last):
        background.finish()
    return path


def save(
    directory: Path,
    step: int,
    engine,
    config: str = "",
    keep: int = 0,
    buffer_mb: float = DEFAULT_BUFFER_MB,
    in_background: bool = False,
    **stateful: Any,
) -> Path:
    """Write checkpoint `step` under `directory`; every rank calls it ([Note: atomic
    checkpoints]). Each rank streams its state from the live tensors through at most one
    staging buffer of `buffer_mb` ([Note: streamed checkpoint files]). Returns once the
    checkpoint is complete and visible to every rank; `in_background`: once this rank's
    state is copied to the host, the write and commit following ([Note: async save]).
    A save still pending is finished first."""
    background.finish()  # a second save waits for the first
    buffer_bytes = max(stream.BLOCK, int(buffer_mb * 2**20))
    directory, rank = Path(directory), comm.rank()
    final = files.step_dir(directory, step)
    device = agree.device_of(engine)
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
        save_id = tmp.name.rsplit("-", 1)[1]

        def failed(e: Exception) -> str:
            return f"rank {rank} could not write its part of checkpoint {final}: {agree.line(e)}"

        def commit(error: str | None) -> None:
            _agree_and_commit(tmp, final, error, device, directory, keep, step, save_id)

        write, error = None, None
        try:
            layout = engine_state.shard_layout(engine)
            header = {"format": files.FORMAT, "id": save_id, "step": step, "layout": layout}
            # [Note: streamed checkpoint files]: the live tensors, through one buffer
            planned, scalars = engine_state.data_to_write(engine)
            entries = [stream.Entry(*e) for e in planned]
            shard = {"rank": rank, "scalar": scalars, "rng": rng_state()}
            shard["feedback"] = engine_state.feedback_layout(engine)  # this rank's errors
            meta = None
            if rank == 0:
                replicated = [e for e in entries if e.name.startswith(REPLICATED)]
                meta = {
                    **header,
                    "run": files.lineage(directory),
                    "config": config,
                    "optimizer": type(engine.optimizer).__name__,
                    "optim_hparams": engine_state.optim_hparams(engine),
                    # what rank0.bin holds of the buffers and frozen parameters
                    "replicated": {
                        e.name[len(REPLICATED) :]: [stream.dtype_name(e.dtype), e.shape]
                        for e in replicated
                    },
                    # a copy: training goes on changing these while an async save writes
                    "state": copy.deepcopy({k: obj.state_dict() for k, obj in stateful.items()}),
                }
            if in_background:  # [Note: async save]: a host copy, then training goes on
                host = background.host_buffer(stream.planned_bytes(entries), device.type == "cuda")
                entries = stream.stage_entries(entries, host)
                if device.type == "cuda":
                    torch.cuda.current_stream(device).synchronize()  # the copy is complete

            def write() -> str | None:
                try:
                    data_path = tmp / f"rank{rank}.bin"
                    index = files.write_data(
                        data_path,
                        entries,
                        buffer_bytes,
                        halfway=lambda: faults.fault("save", step, data_path),
                    )
                    files.write(tmp / f"rank{rank}.pt", {**header, **shard, "data": index})
                    if meta is not None:
                        files.write(tmp / "meta.pt", meta)
                except Exception as e:  # every rank must learn of it, or the others would wait
                    return failed(e)
                return None

        except Exception as e:
            error = failed(e)
        if in_background:
            background.start(background.Pending(write if error is None else None, commit, error))
            return final
        if error is None:
            error = write()
        commit(error)
    return final


def _agree_and_commit(
    tmp: Path,
    final: Path,
    error: str | None,
    device: torch.device,
    directory: Path,
    keep: int,
    step: int,
    save_id: str,
) -> None:
    """Every rank's files are written (or the first failure is raised on every rank); rank 0
    then marks, renames and prunes. Main thread only: collectives."""
    error = agree.first_error(error, device)
    if error is not None:
        if comm.rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise TrainingError(error)
    if comm.rank() == 0:
        # Every rank's file is written and fsynced (the agreement above): mark it.
        marker = {"step": step, "id": save_id, "run": files.lineage(directory)}
        files.write_text(tmp / files.MARKER, json.dumps(marker))
        _commit(tmp, final)
        _prune(directory, keep, step)
    comm.barrier(tag="checkpoint").wait()


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
