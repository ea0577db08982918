"""A storage hiccup is not a damaged checkpoint ([Note: storage errors are not damage] in
trainer/checkpoint/storage.py), and no crash in a save or a prune loses a step
([Note: atomic checkpoints] in trainer/checkpoint/saving.py).

In this process: the reader against injected OSErrors (retried, bounded, one line) and
against wrong bytes (damage, at once). In one group of 2 ranks (shared by every case
below it): EIO, ESTALE, EACCES and a file missing on one rank's reads during resume=auto,
a newer checkpoint skipped by resume and then saved again, a crash injected before
each rename and delete of a save and its prune, each followed by resume=auto, and an EIO
in rank 0's commit of a save (its marker, fsyncs and renames, sync and async) and in its
prune ([Note: a failed commit])."""

from __future__ import annotations

import builtins
import errno
import functools
import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from dist_harness import run_distributed

# ---------------------------------------------------------------------------------------
# Injected storage errors


class Flaky:
    """Makes opening files whose path ends with `suffix` fail with `code` the first
    `times` times (None: always); counts the attempts. Other files open as usual."""

    def __init__(self, suffix: str, code: int, times: int | None = None, on: str = "open"):
        self.suffix, self.code, self.times, self.on = suffix, code, times, on
        self.attempts = 0
        self.real_open, self.real_stat = builtins.open, os.stat

    def _fails(self, path) -> bool:
        if not str(path).endswith(self.suffix):
            return False
        self.attempts += 1
        return self.times is None or self.attempts <= self.times

    def error(self, path) -> OSError:
        return OSError(self.code, os.strerror(self.code), str(path))

    def open(self, path, *args, **kwargs):
        if self.on == "open" and self._fails(path):
            raise self.error(path)
        f = self.real_open(path, *args, **kwargs)
        if self.on == "read" and str(path).endswith(self.suffix):
            return _FailingReads(f, self)
        return f

    def stat(self, path, *args, **kwargs):
        if self.on == "stat" and self._fails(path):
            raise self.error(path)
        return self.real_stat(path, *args, **kwargs)

    def install(self, patch) -> Flaky:
        patch.setattr(builtins, "open", self.open)
        patch.setattr(os, "stat", self.stat)
        return self


class _FailingReads:
    """A file whose reads fail as `flaky` says (an NFS handle gone stale under it)."""

    def __init__(self, f, flaky: Flaky) -> None:
        self.f, self.flaky = f, flaky

    def readinto(self, view):
        if self.flaky._fails(self.f.name):
            raise self.flaky.error(self.f.name)
        return self.f.readinto(view)

    def read(self, *args):
        if self.flaky._fails(self.f.name):
            raise self.flaky.error(self.f.name)
        return self.f.read(*args)

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


@pytest.fixture
def waits(monkeypatch) -> list[float]:
    """The waits between attempts, recorded instead of slept."""
    from trainer.checkpoint import storage

    slept: list[float] = []
    monkeypatch.setattr(storage, "_sleep", slept.append)
    return slept


def _pt_file(tmp_path: Path) -> Path:
    from trainer.checkpoint import files

    path = tmp_path / "rank1.pt"
    files.write(path, {"format": files.FORMAT, "step": 4, "w": torch.arange(300.0)})
    return path


ERRNOS = [(errno.EIO, "EIO"), (errno.ESTALE, "ESTALE"), (errno.EACCES, "EACCES")]


@pytest.mark.parametrize("code, name", ERRNOS, ids=[n for _, n in ERRNOS])
def test_a_storage_error_is_retried_a_few_times_then_named_in_one_line(
    tmp_path, monkeypatch, waits, code, name
):
    from trainer.checkpoint import files, storage
    from trainer.errors import ConfigError, StorageError

    path = _pt_file(tmp_path)
    flaky = Flaky(path.name, code).install(monkeypatch)
    with pytest.raises(StorageError) as e:
        files.read(path)
    assert not isinstance(e.value, ConfigError)  # not damage, not skipped: the resume fails
    assert str(e.value) == (
        f"cannot read {path}: {name} ({os.strerror(code)}), 4 attempts over 1.4 s "
        "(a storage error, not damage)"
    )
    # bounded: four attempts, three short waits
    assert flaky.attempts == 4 and waits == list(storage.DELAYS_S) and sum(waits) < 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank1.pt"]


def test_a_storage_error_that_clears_reads_normally(tmp_path, monkeypatch, waits):
    from trainer.checkpoint import files

    path = _pt_file(tmp_path)
    flaky = Flaky(path.name, errno.EIO, times=1).install(monkeypatch)
    assert torch.equal(files.read(path)["w"], torch.arange(300.0))
    assert flaky.attempts == 2 and waits == [0.1]


def test_a_failing_data_file_read_is_retried_on_a_fresh_handle(tmp_path, monkeypatch, waits):
    from trainer.checkpoint import stream
    from trainer.errors import StorageError

    path = tmp_path / "rank0.bin"
    values = torch.arange(1000.0)
    index = stream.write_entries(path, [stream.Entry("w", torch.float32, [1000], [values])],
                                 1 << 16, lambda f: f)  # fmt: skip
    out = torch.empty(1000)
    # ESTALE on the read (the handle went stale): the next attempt opens the file anew.
    flaky = Flaky(path.name, errno.ESTALE, times=1, on="read").install(monkeypatch)
    data = stream.DataFile(path, index)
    data.read("w", 0, out)
    assert torch.equal(out, values) and flaky.attempts == 2 and waits == [0.1]
    data.close()
    # A stat that keeps failing: named, not taken for a wrong size.
    Flaky(path.name, errno.EIO, on="stat").install(monkeypatch)
    with pytest.raises(StorageError, match=f"cannot read {path}: EIO .* 4 attempts"):
        stream.DataFile(path, index)


def test_wrong_bytes_are_damage_at_once(tmp_path, monkeypatch, waits):
    from trainer.checkpoint import files, stream
    from trainer.errors import Damaged, Missing

    path = _pt_file(tmp_path)
    good = path.read_bytes()
    path.write_bytes(good[: len(good) // 2])  # truncated
    with pytest.raises(Damaged, match="is truncated or corrupted"):
        files.read(path)
    torch.save({"format": files.FORMAT, "checksum": 1, "w": torch.ones(3)}, path)
    with pytest.raises(Damaged, match="do not match their checksum"):
        files.read(path)
    path.unlink()
    with pytest.raises(Missing, match="is missing: the checkpoint is incomplete"):
        files.read(path)
    data = tmp_path / "rank0.bin"
    index = stream.write_entries(data, [stream.Entry("w", torch.float32, [8], [torch.ones(8)])],
                                 1 << 16, lambda f: f)  # fmt: skip
    os.truncate(data, 16)
    with pytest.raises(Damaged, match="16 bytes, its index says 32"):
        stream.DataFile(data, index)
    assert waits == []  # none of these is retried


def test_a_marker_the_storage_fails_is_not_taken_for_no_marker(tmp_path, monkeypatch, waits):
    from trainer.checkpoint import files
    from trainer.errors import StorageError

    ckpt = tmp_path / "step_000004"
    ckpt.mkdir()
    (ckpt / "COMPLETE").write_text(json.dumps({"step": 4}))
    Flaky("step_000004/COMPLETE", errno.EIO).install(monkeypatch)
    # Before: the checkpoint vanished from the list (resume=auto took an older one).
    with pytest.raises(StorageError, match="COMPLETE: EIO"):
        files.find_checkpoints(tmp_path)


def _marked(directory: Path, name: str, step: int, save_id: str = "0a1b2c3d") -> Path:
    d = directory / name
    d.mkdir()
    (d / "meta.pt").write_bytes(b"the files of a complete save")
    (d / "COMPLETE").write_text(json.dumps({"step": step, "id": save_id, "run": None}))
    return d


def test_a_marked_save_is_never_swept_and_resume_finishes_it(tmp_path, monkeypatch):
    # A crash after the marker, before the rename: a complete save under its temporary
    # name. The next save's sweep takes unmarked leftovers only; resume=auto renames it.
    from trainer import comm
    from trainer.checkpoint import files, saving

    monkeypatch.setattr(comm, "rank", lambda group=None: 0)
    for step in (2, 4):
        _marked(tmp_path, f"step_00000{step}", step)
    _marked(tmp_path, "step_000008.tmp-0a1b2c3d", 8)
    (tmp_path / "step_000006.tmp-99999999").mkdir()  # a save killed before its marker
    (tmp_path / "step_000006.tmp-99999999" / "meta.pt").write_bytes(b"half")
    (tmp_path / "step_000001.old-12345678").mkdir()  # a prune killed before its delete
    saving._prune(tmp_path, keep=1, step=4)
    assert sorted(os.listdir(tmp_path)) == ["step_000004", "step_000008.tmp-0a1b2c3d"]
    saving.finish_commits(tmp_path)
    assert [p.name for p in files.find_checkpoints(tmp_path)] == ["step_000008", "step_000004"]
    assert (tmp_path / "step_000008" / "meta.pt").read_bytes() == b"the files of a complete save"


def test_an_interrupted_save_older_than_the_checkpoint_of_its_step_is_kept_aside(
    tmp_path, monkeypatch
):
    # Interrupted before its rename, then that step saved again by a run resumed with
    # resume=PATH: the later save keeps the name, the earlier one is kept beside it.
    from trainer import comm
    from trainer.checkpoint import saving

    monkeypatch.setattr(comm, "rank", lambda group=None: 0)
    older = _marked(tmp_path, "step_000006.tmp-0a1b2c3d", 6)
    newer = _marked(tmp_path, "step_000006", 6, "4e5f6a7b")
    os.utime(older / "COMPLETE", ns=(10**18, 10**18))
    os.utime(newer / "COMPLETE", ns=(2 * 10**18, 2 * 10**18))
    saving.finish_commits(tmp_path)
    names = sorted(os.listdir(tmp_path))
    assert names[0] == "step_000006" and names[1].startswith("step_000006.replaced-"), names
    assert json.loads((tmp_path / "step_000006" / "COMPLETE").read_text())["id"] == "4e5f6a7b"
    assert json.loads((tmp_path / names[1] / "COMPLETE").read_text())["id"] == "0a1b2c3d"


# ---------------------------------------------------------------------------------------
# In one group of 2 ranks: resume=auto against storage errors of one rank, a skipped
# checkpoint saved again, a crash at each rename and delete of a save and its prune, and
# a storage error in rank 0's commit

WIDE = 8


def _engine(width: int = WIDE):
    from torch import nn

    from trainer.parallel import build_engine

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, width), nn.Linear(width, 4))
    return build_engine(model, "zero", functools.partial(torch.optim.SGD, lr=0.1))


def _step(engine) -> None:
    engine.backward(engine(torch.ones(4, 8)).square().sum())
    engine.step()


def _cfg(directory: Path):
    from omegaconf import OmegaConf

    ckpt = {"every": 2, "dir": str(directory), "keep": 2}
    return OmegaConf.create({"ckpt": ckpt, "resume": "auto", "train": {"steps": 8}})


def _resume(directory: Path, patch=None, width: int = WIDE):
    """resume=auto into a fresh engine: (step or None, error type, error message)."""
    from trainer import checkpoint

    engine = _engine(width)
    undo = _Undo()
    try:
        if patch is not None:
            patch(undo)
        step = checkpoint.maybe_resume(_cfg(directory), engine, Path("unused"))
        return step, None, None, engine
    except Exception as e:
        return None, type(e).__name__, str(e), engine
    finally:
        undo.undo()


class _Undo:
    """monkeypatch's setattr and undo, in a worker (pytest's fixture is not picklable)."""

    def __init__(self) -> None:
        self.saved: list = []

    def setattr(self, obj, name, value) -> None:
        self.saved.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    def undo(self) -> None:
        for obj, name, value in reversed(self.saved):
            setattr(obj, name, value)
        self.saved.clear()


def _listing(directory: Path) -> dict[str, bytes | None]:
    return {
        str(p.relative_to(directory)): p.read_bytes() if p.is_file() else None
        for p in sorted(directory.rglob("*"))
    }


def _flip(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    file.write_bytes(bytes(data))


def _on_rank(rank: int, flaky: Flaky):
    from trainer import comm

    return (lambda patch: flaky.install(patch)) if comm.rank() == rank else None


# resume=auto with a checkpoint at steps 2 and 4: what rank 1 (or rank 0) meets
STORAGE_CASES = {
    "eio_on_rank1_index": lambda: _on_rank(1, Flaky("step_000004/rank1.pt", errno.EIO)),
    "estale_on_rank1_data": lambda: _on_rank(1, Flaky("step_000004/rank1.bin", errno.ESTALE)),
    "eacces_on_rank1_meta": lambda: _on_rank(1, Flaky("step_000004/meta.pt", errno.EACCES)),
    "eio_on_rank1_once": lambda: _on_rank(1, Flaky("step_000004/rank1.pt", errno.EIO, 1)),
    "estale_on_rank1_read_once": lambda: _on_rank(
        1, Flaky("step_000004/rank1.bin", errno.ESTALE, 1, on="read")
    ),
    # rank 1 does not find a file rank 0 finds (a ckpt.dir that is not shared)
    "data_missing_on_rank1": lambda: _on_rank(
        1, Flaky("step_000004/rank1.bin", errno.ENOENT, on="stat")
    ),
    "directory_missing_on_rank1": lambda: _on_rank(
        1, Flaky("step_000004", errno.ENOENT, on="stat")
    ),
}


def _storage_cases(env, root: Path):
    from trainer import checkpoint, comm
    from trainer.checkpoint import storage

    storage._sleep = lambda s: None  # the waits are checked in-process above
    rank = comm.rank()
    base = root / "base"
    engine = _engine()
    states = {}
    for step in (2, 4):
        _step(engine)
        checkpoint.save(base, step, engine, keep=2)
        states[step] = {k: v.clone() for k, v in engine.full_state_dict().items()}
    # step 6 saved with step 4's values: the copy of step 6 that a run resumed from step 4
    # finds when it saves step 6 again
    checkpoint.save(root / "old", 6, engine, keep=0)
    out: dict = {"states": states}

    def fresh(name: str) -> Path:
        if rank == 0:
            shutil.copytree(base, root / name)
        comm.barrier().wait()
        return root / name

    for name, make in STORAGE_CASES.items():
        directory = fresh(name)
        before = _listing(directory)
        step, kind, message, resumed = _resume(directory, make())
        same = {k: torch.equal(v, states[4][k]) for k, v in resumed.full_state_dict().items()}
        after = _listing(directory)
        changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
        out[name] = (step, kind, message, all(same.values()), changed)
        comm.barrier().wait()

    # A file that no rank finds is damage; damage one rank proves outweighs another's EIO.
    directory = fresh("missing_everywhere")
    if rank == 0:
        (directory / "step_000004" / "rank1.bin").unlink()
    comm.barrier().wait()
    out["missing_everywhere"] = (*_resume(directory)[:3], sorted(os.listdir(directory)))
    directory = fresh("damage_on_rank0_eio_on_rank1")
    if rank == 0:
        _flip(directory / "step_000004" / "rank0.bin")
    comm.barrier().wait()
    got = _resume(directory, _on_rank(1, Flaky("step_000004/rank1.pt", errno.EIO)))
    out["damage_on_rank0_eio_on_rank1"] = (*got[:3], sorted(os.listdir(directory)))

    # A newer checkpoint that resume skipped (another model's) and that step saved again.
    directory = fresh("skipped")
    if rank == 0:
        shutil.rmtree(directory / "step_000004")
    comm.barrier().wait()
    wide = _engine(width=16)
    checkpoint.save(directory, 4, wide, keep=2)
    skipped = _listing(directory / "step_000004") if rank == 0 else None
    step, kind, message, engine = _resume(directory)
    _step(engine)
    _step(engine)
    checkpoint.save(directory, 4, engine, keep=2)
    asides = [p for p in directory.iterdir() if p.name.startswith("step_000004.replaced-")]
    kept = len(asides) == 1 and _listing(asides[0]) == skipped if rank == 0 else None
    out["skipped"] = (step, kind, message, sorted(os.listdir(directory)), kept)

    # A crash before each rename and delete of a save of step 6 and its prune (keep=2),
    # into steps 2 and 4 (`new`) and into steps 2, 4 and 6 (`again`: 6 saved again).
    scratch = root / "scratch"
    checkpoint.save(scratch, 6, engine, keep=0)
    out["saved_6"] = {k: v.clone() for k, v in engine.full_state_dict().items()}
    save_id = json.loads((scratch / "step_000006" / "COMPLETE").read_text())["id"]
    crashes = {}
    for kind in ("new", "again"):
        for at in range(12):
            name = f"crash_{kind}_{at}"
            directory = fresh(name)
            ops = None
            if rank == 0:
                if kind == "again":  # copy2: the marker keeps its (older) time
                    shutil.copytree(root / "old" / "step_000006", directory / "step_000006")
                ops = _crash_commit(directory, scratch / "step_000006", save_id, at)
            crashed, ops = comm.all_gather_object(ops)[0]
            if not crashed:  # `at` is past the last operation: every one was crashed at
                crashes[f"all_{kind}"] = ops
                break
            names = sorted(os.listdir(directory))
            step, kind_, message, resumed = _resume(directory)
            state = resumed.full_state_dict()
            which = [s for s, want in [(6, out["saved_6"]), (4, states[4])]
                     if all(torch.equal(state[k], want[k]) for k in state)]  # fmt: skip
            after = sorted(os.listdir(directory))
            crashes[name] = (ops, names, step, kind_, message, which, after)
            comm.barrier().wait()
    out["crashes"] = crashes

    # Rank 0's commit of a save of step 6 into steps 2 and 4 fails (EIO) at each operation.
    for case, fails in COMMIT_FAILURES.items():
        directory = fresh(f"commit_{case}")
        if case == "rename_again":  # step 6 saved before, with step 4's values
            if rank == 0:
                shutil.copytree(root / "old" / "step_000006", directory / "step_000006")
            comm.barrier().wait()
        out[f"commit_{case}"] = _failed_commit(directory, engine, fails, case.startswith("async"))
        comm.barrier().wait()
    return out


def _eio(path) -> OSError:
    return OSError(errno.EIO, os.strerror(errno.EIO), str(path))


def _failing(obj, name: str, when):
    """Set `obj.name` (on rank 0, through `_Undo`) to one that raises EIO where `when` holds
    for its first argument (the file, or a rename's source)."""
    real = getattr(obj, name)

    def fail(*args, **kwargs):
        if when(Path(args[0])):
            raise _eio(args[0])
        return real(*args, **kwargs)

    return lambda undo: undo.setattr(obj, name, fail)


def _tmp(path: Path) -> bool:
    return ".tmp-" in path.name


# What fails on rank 0 during a save's commit (and its prune, last: a warning)
COMMIT_FAILURES = {
    "marker": lambda d: _failing(_files(), "write_text", lambda p: p.name == "COMPLETE"),
    "fsync": lambda d: _failing(_files(), "fsync_dir", _tmp),
    "fsync_after_rename": lambda d: _failing(_files(), "fsync_dir", lambda p: p == d),
    "rename": lambda d: _failing(os, "rename", _tmp),
    "rename_again": lambda d: _failing(os, "rename", _tmp),
    "async_rename": lambda d: _failing(os, "rename", _tmp),
    "prune": lambda d: _failing(os, "rename", lambda p: p.name == "step_000002"),
}


def _files():
    from trainer.checkpoint import files

    return files


def _failed_commit(directory: Path, engine, fails, in_background: bool):
    """Save step 6 into `directory` (keep=2) with `fails` on rank 0: the save's error (kind,
    message), what rank 0 said, whether the files are as before, and the resume after it."""
    from trainer import checkpoint, comm
    from trainer.checkpoint import agree, background

    before = _listing(directory)
    said: list[str] = []
    undo = _Undo()
    if comm.rank() == 0:
        fails(directory)(undo)
        undo.setattr(agree, "say", said.append)
    try:
        checkpoint.save(directory, 6, engine, keep=2, in_background=in_background)
        while background._pending is not None:  # the check steps of the loop
            background.check(torch.device("cpu"))
        error = (None, None)
    except Exception as e:
        error = (type(e).__name__, str(e))
        background.drop()
    finally:
        undo.undo()
    unchanged = _listing(directory) == before
    names = sorted(os.listdir(directory))
    step, kind, message, resumed = _resume(directory)
    return error, said, unchanged, names, (step, kind, message), resumed.full_state_dict()


class _Crash(Exception):
    pass


def _crash_commit(directory: Path, new: Path, save_id: str, at: int) -> tuple[bool, str]:
    """Rank 0's commit of `new` (a complete save of step 6, copied under its temporary
    name, as every rank left it) into `directory`, crashing before its `at`-th operation
    (the marker, a rename, a delete): (whether it crashed, the operations done)."""
    from trainer.checkpoint import files, saving

    tmp = directory / f"step_000006.tmp-{save_id}"
    shutil.copytree(new, tmp)
    (tmp / files.MARKER).unlink()
    marker = json.loads((new / files.MARKER).read_text())
    done: list[str] = []

    def op(name: str, real):
        def run(*args, **kwargs):
            if len(done) == at:
                raise _Crash
            paths = args[:1] if name == "write" else args[:2]
            done.append(f"{name} {' '.join(Path(a).name for a in paths)}")
            return real(*args, **kwargs)

        return run

    undo = _Undo()
    undo.setattr(files, "write_text", op("write", files.write_text))
    undo.setattr(os, "rename", op("rename", os.rename))
    undo.setattr(shutil, "rmtree", op("rmtree", shutil.rmtree))
    try:
        saving._mark_and_commit(tmp, files.step_dir(directory, 6), marker, directory, 2, 6)
    except _Crash:
        return True, re.sub(r"-[0-9a-f]{8}\b", "-ID", ", ".join(done))
    finally:
        undo.undo()
    return False, re.sub(r"-[0-9a-f]{8}\b", "-ID", ", ".join(done))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("storage")
    rank0, rank1 = run_distributed(_storage_cases, 2, root)
    return root, rank0, rank1


@pytest.mark.parametrize(
    "case, file, name",
    [
        ("eio_on_rank1_index", "rank1.pt", "EIO"),
        ("estale_on_rank1_data", "rank1.bin", "ESTALE"),
        ("eacces_on_rank1_meta", "meta.pt", "EACCES"),
    ],
)
def test_a_storage_error_on_one_rank_fails_the_resume_on_every_rank(runs, case, file, name):
    root, rank0, rank1 = runs
    path = root / case / "step_000004" / file
    code = getattr(errno, name)
    want = (
        f"rank 1 cannot read {path}: {name} ({os.strerror(code)}), 4 attempts over 1.4 s (a "
        "storage error, not damage); nothing was set aside: resume again once the storage "
        "answers"
    )
    for got in (rank0[case], rank1[case]):
        step, kind, message, _, changed = got
        assert (step, kind, message) == (None, "StorageError", want)
        assert changed == [], "the resume renamed or changed files"


@pytest.mark.parametrize("case", ["eio_on_rank1_once", "estale_on_rank1_read_once"])
def test_a_storage_error_that_clears_on_the_second_attempt_resumes_normally(runs, case):
    _, rank0, rank1 = runs
    for got in (rank0[case], rank1[case]):
        step, kind, message, loaded, changed = got
        assert (step, kind, message) == (4, None, None)
        assert loaded, "resumed, but not with step 4's values"
        assert changed == ["lineage"]  # the resumed run claims the directory, no more


@pytest.mark.parametrize(
    "case, what", [("data_missing_on_rank1", "rank1.bin"), ("directory_missing_on_rank1", "")]
)
def test_a_file_missing_on_one_rank_only_is_a_storage_error(runs, case, what):
    root, rank0, rank1 = runs
    path = root / case / "step_000004" / what if what else root / case / "step_000004"
    want = (
        f"rank 1 does not find {path}, while rank 0 finds it: every rank must see one and the "
        "same ckpt.dir (a shared filesystem); nothing was set aside: resume again once the "
        "storage answers"
    )
    for got in (rank0[case], rank1[case]):
        assert got[:3] == (None, "StorageError", want)
        assert got[4] == [], "the resume renamed or changed files"


def test_damage_that_any_rank_proves_is_still_set_aside(runs):
    _, rank0, rank1 = runs
    for case in ("missing_everywhere", "damage_on_rank0_eio_on_rank1"):
        for got in (rank0[case], rank1[case]):
            step, kind, message, names = got
            assert (step, kind, message) == (2, None, None), (case, got)
            assert names[0] == "lineage" and names[1] == "step_000002", names
            assert names[2].startswith("step_000004.damaged-") and len(names) == 3, names


def test_a_skipped_newer_checkpoint_is_kept_when_that_step_is_saved_again(runs):
    _, rank0, _ = runs
    step, kind, message, names, kept = rank0["skipped"]
    assert (step, kind, message) == (2, None, None)  # step 4 (another model) was skipped
    assert names[:3] == ["lineage", "step_000002", "step_000004"]
    assert names[3].startswith("step_000004.replaced-") and len(names) == 4, names
    assert kept, "the skipped checkpoint was changed"


def test_no_crash_in_a_save_or_a_prune_loses_a_step(runs):
    """A crash before each operation of a save's commit and prune (step 6, keep=2): the
    resume finds step 6 once it is marked (or, saved again, its earlier copy), never less
    than the newest complete checkpoint before the save, and loads it."""
    _, rank0, rank1 = runs
    crashes = rank0["crashes"]
    # Every rename and delete of the commit and its prune, in order; each crashed before.
    prune = "rename step_000002 step_000002.old-ID, rmtree step_000002.old-ID"
    commit = "write COMPLETE, rename step_000006.tmp-ID step_000006"
    assert crashes.pop("all_new") == f"{commit}, {prune}"
    again = "write COMPLETE, rename step_000006 step_000006.replaced-ID"
    assert crashes.pop("all_again") == f"{again}, rename step_000006.tmp-ID step_000006, {prune}"
    assert sorted(crashes) == [f"crash_{k}_{i}" for k, n in (("again", 5), ("new", 4))
                               for i in range(n)]  # fmt: skip
    for name, (ops, names, step, kind, message, which, after) in crashes.items():
        assert (kind, message) == (None, None), (name, ops, message)
        assert not any(".damaged-" in n for n in after), (name, after)
        marked = ops != ""  # the marker is the first operation
        if "again" in name:
            assert step == 6, (name, ops, names, step)
            assert which == ([6] if marked else [4]), (name, ops, which)  # the new, or the old
            if "step_000006.replaced-" in ops:  # the old copy: kept
                assert any(n.startswith("step_000006.replaced-") for n in after), after
        else:
            assert step == (6 if marked else 4), (name, ops, names, step)
            assert which == [step], (name, ops, which)
        assert rank1["crashes"][name][2] == step


@pytest.mark.parametrize("case", [c for c in COMMIT_FAILURES if c != "prune"])
def test_a_failed_commit_on_rank_0_fails_the_save_on_every_rank_in_one_line(runs, case):
    """An EIO in rank 0's commit (the marker, an fsync, a rename; with ckpt.async too): every
    rank raises the same line at once, where rank 1 used to wait dist.timeout_s for rank 0
    and report a peer that stopped answering. Nothing saved before is changed, and
    resume=auto takes the newest of it."""
    root, rank0, rank1 = runs
    directory = root / f"commit_{case}"
    final = re.escape(str(directory / "step_000006"))
    tmp = final + r"\.tmp-[0-9a-f]{8}"
    what = {
        "marker": f"cannot write {tmp}/COMPLETE",
        "fsync": f"cannot fsync {tmp}",
        "fsync_after_rename": f"cannot fsync {re.escape(str(directory))}",
    }.get(case, f"cannot rename {tmp} to {final}")
    want = rf"rank 0 could not commit checkpoint {final}: {what}: EIO \(Input/output error\)"
    error, said, unchanged, names, resumed, state = rank0[f"commit_{case}"]
    assert error[0] == "StorageError" and re.fullmatch(want, error[1]), error
    assert rank1[f"commit_{case}"][0] == error  # the same line on every rank
    assert said == [], said
    assert unchanged, f"the failed save left {names}"
    again = case == "rename_again"  # step 6 was there before, with step 4's values
    assert resumed == (6 if again else 4, None, None)
    want_state = rank0["states"][4]
    assert all(torch.equal(v, want_state[k]) for k, v in state.items())


def test_a_failed_prune_warns_and_keeps_the_new_checkpoint(runs):
    root, rank0, rank1 = runs
    directory = root / "commit_prune"
    error, said, _, names, resumed, state = rank0["commit_prune"]
    assert error == (None, None) and rank1["commit_prune"][0] == (None, None)
    old = re.escape(str(directory / "step_000002"))
    want = (
        rf"warning: not pruning under {re.escape(str(directory))} this time: cannot rename "
        rf"{old} to {old}\.old-[0-9a-f]{{8}}: EIO \(Input/output error\)"
    )
    assert len(said) == 1 and re.fullmatch(want, said[0]), said
    assert names == ["step_000002", "step_000004", "step_000006"]
    assert resumed == (6, None, None) and rank1["commit_prune"][4] == (6, None, None)
