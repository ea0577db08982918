"""Saving a checkpoint: every rank writes its file, rank 0 commits the whole by a rename.

All ranks write into a temporary directory and agree that every one succeeded; rank 0 then
marks it complete, renames it to its final name and prunes older checkpoints, in an order
that no crash can leave without a complete copy for resume=auto to find:
[Note: atomic checkpoints], beside `save`. A commit that the storage fails is undone on
every rank alike: [Note: a failed commit], beside `_mark_and_commit`.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
from omegaconf import DictConfig, OmegaConf

from trainer import comm
from trainer.checkpoint import agree, background, faults, files, storage, stream
from trainer.checkpoint.rng import rng_state
from trainer.errors import StorageError, TrainingError
from trainer.parallel import state as engine_state

DEFAULT_BUFFER_MB = 64  # ckpt.buffer_mb: the staging buffer of a save
REPLICATED = "replicated/"  # data entries of buffers and frozen parameters (rank 0)

T = TypeVar("T")


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


# [Note: atomic checkpoints]
# All ranks write into `step_000120.tmp-<id>/` and fsync their files; they then agree (one
# small AllReduce) that every rank succeeded; rank 0 writes `COMPLETE` into it and fsyncs
# the directory: from then on it is a complete checkpoint. Rank 0 renames it to
# `step_000120` (atomic on one filesystem) and fsyncs the parent. `ckpt.keep` then prunes
# older checkpoints, each renamed away to `step_N.old-<id>` first (atomic) and deleted
# after, and deletes what interrupted saves left (temporary directories without a marker,
# `.old-` ones). Only a directory with a final name and a marker counts as a checkpoint.
# No crash between these renames and deletes leaves a step without a complete copy that
# resume=auto finds (tests/test_checkpoint_storage.py crashes a save and a prune at each):
# - before the marker: the previous checkpoints are as they were; the partial directory
#   is removed by the next save;
# - after the marker, before the rename: a marked `step_N.tmp-<id>` is complete, and is
#   never deleted: resume=auto first finishes its commit (`finish_commits`);
# - the same step saved again (a run resumed from an older checkpoint: the newer one did
#   not fit it, or resume=PATH chose the older one) finds `step_N` there. That one is kept:
#   renamed to `step_N.replaced-<id>` (which no save prunes; one line names it) before the
#   new one takes its name, never deleted. A crash between the two renames leaves the new
#   one marked under its temporary name: as above;
# - in a prune: the new checkpoint is in place and fsynced before anything is pruned, and
#   what a prune removes goes out of the checkpoint names before it is deleted.
# A storage error in rank 0's commit (not a crash) fails the save on every rank alike, the
# commit undone; in its prune, a warning ([Note: a failed commit]).
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

        lineage: str | None = None  # rank 0's, read below

        def commit(error: str | None) -> None:
            marker = {"step": step, "id": save_id, "run": lineage}
            _agree_and_commit(tmp, final, error, device, directory, keep, step, marker)

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
                lineage = files.lineage(directory)  # read once, here: a failure is agreed
                meta = {
                    **header,
                    "run": lineage,
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
    marker: dict[str, Any],
) -> None:
    """Every rank's files are written (or the first failure is raised on every rank); rank 0
    then marks, renames and prunes, and every rank raises its error if that failed ([Note: a
    failed commit]). Main thread only: collectives."""
    error = agree.first_error(error, device)
    if error is not None:
        if comm.rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise TrainingError(error)
    failure: TrainingError | None = None
    if comm.rank() == 0:
        try:
            _mark_and_commit(tmp, final, marker, directory, keep, step)
        except StorageError as e:
            failure = StorageError(f"rank 0 could not commit checkpoint {final}: {e}")
        except Exception as e:  # not the storage's: still every rank's, or they would wait
            failure = TrainingError(f"rank 0 could not commit checkpoint {final}: {agree.line(e)}")
    # [Note: a failed commit]: one small AllReduce; rank 0's line follows only on a failure
    failure = agree.first_error(failure, device, "checkpoint commit")
    if failure is not None:
        raise type(failure)(str(failure))


# [Note: a failed commit]
# Rank 0 alone marks, renames and prunes; the other ranks wait for it. An OSError there (a
# rename, an fsync, the marker's write: EIO on a network filesystem) used to end rank 0 alone,
# and the others waited dist.timeout_s to report a peer that stopped answering. They now wait
# in `agree.first_error`, which is one small AllReduce, as the barrier it replaces was: rank 0
# enters it with None or its error (one line naming the file and the errno), and on a failure
# that is broadcast, so every rank raises the same StorageError at once. Before rank 0 says
# so, it undoes what the commit did, as far as the storage lets it: the renames are put back
# (a checkpoint of the same step that was there goes back to its name) and the new save's
# directory goes, marker first. What was complete before the save is as it was, and
# resume=auto takes the newest of it: a save whose commit failed was not saved (an fsync that
# failed says nothing about what the disk holds). A prune that fails is not the save's
# failure: the new checkpoint is in place and fsynced by then, so the prune warns in one line
# and leaves the rest to the next save's prune.


def _mark_and_commit(
    tmp: Path, final: Path, marker: dict[str, Any], directory: Path, keep: int, step: int
) -> None:
    """Rank 0's part, once every rank's files are written and fsynced: the marker, the
    rename, the prune ([Note: atomic checkpoints]). A StorageError naming the operation and
    its errno when the storage fails the commit; `tmp` is removed then, and the names are
    as before ([Note: a failed commit])."""
    try:
        marker_file = tmp / files.MARKER
        _io(f"cannot write {marker_file}", files.write_text, marker_file, json.dumps(marker))
        _commit(tmp, final)
    except StorageError:
        _discard(tmp)
        raise
    _prune(directory, keep, step)


def _commit(tmp: Path, final: Path) -> None:
    """Marked `tmp` becomes checkpoint `final`; one already there is kept beside it as
    `step_N.replaced-<id>` ([Note: atomic checkpoints]). Rank 0 alone. A StorageError when
    the storage fails it, the renames made put back first ([Note: a failed commit])."""
    _io(f"cannot fsync {tmp}", files.fsync_dir, tmp)
    renamed: list[tuple[Path, Path]] = []  # (from, to), to put back if a later one fails
    aside = None
    try:
        # this step written again, by a run resumed from an older one
        if _io(f"cannot stat {final}", final.exists):
            aside = final.with_name(f"{final.name}.replaced-{uuid.uuid4().hex[:8]}")
            _rename(final, aside)
            renamed.append((final, aside))
        _rename(tmp, final)
        renamed.append((tmp, final))
        _io(f"cannot fsync {final.parent}", files.fsync_dir, final.parent)
    except StorageError as e:
        raise StorageError(f"{e}{_put_back(renamed)}") from None
    if aside is not None:
        agree.say(f"note: {final} was there already; kept as {aside}, beside the new one")


def _put_back(renamed: list[tuple[Path, Path]]) -> str:
    """Undo `renamed`, newest first; '' when all went back, else what was left where."""
    for source, target in reversed(renamed):
        try:
            os.rename(target, source)
        except OSError as e:
            return f"; {source} is left as {target} (renaming it back: {storage.describe(e)})"
    return ""


def _discard(tmp: Path) -> None:
    # The marker first: should the storage let no more go, what stays is unmarked, which
    # no resume takes and the next save removes.
    try:
        os.unlink(tmp / files.MARKER)
    except OSError:
        pass
    shutil.rmtree(tmp, ignore_errors=True)


def _rename(source: Path, target: Path) -> None:
    _io(f"cannot rename {source} to {target}", os.rename, source, target)


def _io(what: str, op: Callable[..., T], *args: Any) -> T:
    """`op(*args)`; an OSError raises StorageError: `what`, then its errno."""
    try:
        return op(*args)
    except OSError as e:
        raise StorageError(f"{what}: {storage.describe(e)}") from None


def _keep_aside(path: Path, final: Path) -> Path:
    aside = final.with_name(f"{final.name}.replaced-{uuid.uuid4().hex[:8]}")
    _rename(path, aside)
    return aside


def finish_commits(directory: Path) -> None:
    """Finish the commits a crash interrupted ([Note: atomic checkpoints]): each marked
    `step_N.tmp-<id>` (complete) takes the name `step_N`. A checkpoint already there is
    kept aside (as `_commit` does) when the marked one is newer by its marker's time, else
    the marked one is (a save interrupted before a later save of the same step). Rank 0
    alone, before resume=auto looks for checkpoints."""
    for tmp in sorted(Path(directory).glob("step_*.tmp-*")):
        step, _, save_id = tmp.name[len("step_") :].partition(".tmp-")
        mark = files.marker(tmp)
        if not step.isdigit() or mark is None or mark.get("id") != save_id:
            continue  # unfinished: not a checkpoint (the next save removes it)
        final = files.step_dir(directory, int(step))
        try:
            there = _io(f"cannot stat {final}", final.exists)
            if there and _marked_at(final) > _marked_at(tmp):
                aside = _keep_aside(tmp, final)
                agree.say(
                    f"note: {tmp}, a save of step {step} interrupted before its rename, is "
                    f"older than {final}; kept as {aside}"
                )
                continue
            _commit(tmp, final)
        except StorageError as e:  # raised alike on every rank (through agree): never lost
            raise StorageError(
                f"cannot finish the commit of {tmp}, a complete save that a crash interrupted: {e}"
            ) from None
        agree.say(f"note: {final}: finished its commit, which a crash interrupted")


def _marked_at(path: Path) -> int:
    try:
        return os.stat(path / files.MARKER).st_mtime_ns
    except OSError:
        return 0


def _prune(directory: Path, keep: int, step: int) -> None:
    """Remove leftovers of interrupted saves, then all but the newest `keep` complete
    checkpoints up to `step` (newer ones belong to a run this one resumed before). Each
    goes by an atomic rename out of the final names first ([Note: atomic checkpoints]).
    A marked temporary directory is complete and stays (resume=auto finishes it); what
    the storage does not let us read or rename stays too, with a warning ([Note: a failed
    commit])."""
    try:
        if keep:
            done = [p for p in files.find_checkpoints(directory) if files.step_of(p) <= step]
            for p in done[keep:]:
                old = p.with_name(f"{p.name}.old-{uuid.uuid4().hex[:8]}")
                _rename(p, old)
                faults.fault("prune", step, old)
            _io(f"cannot fsync {directory}", files.fsync_dir, directory)
        for leftover in [*directory.glob("step_*.tmp-*"), *directory.glob("step_*.old-*")]:
            if ".tmp-" in leftover.name and files.marker(leftover) is not None:
                continue
            shutil.rmtree(leftover, ignore_errors=True)
    except StorageError as e:
        agree.say(f"warning: not pruning under {directory} this time: {e}")
