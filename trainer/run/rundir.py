"""One owner per run directory: a lock that a second launch finds at start.

    owner = rundir.claim({"hydra.run.dir": run_dir, "ckpt.dir": ckpt_dir})  # every rank
    ...
    owner.release()                               # at the end (a dead process's goes by itself)

[Note: run directory lock]
Rank 0 holds an exclusive `flock` on `<dir>/.lock` for the whole run and writes who it
is into the file (host, pid, start time, SLURM job). The kernel drops the lock when the
process ends, however it ends (kill -9 included), so a lock is never stale in effect: a
file naming a holder whose lock is free was left by a dead job, and the next run takes
it over with one line saying so. A second launch on a held directory stops before it
writes anything of its own (Hydra has already written its `.hydra/` record there). The
lock is as good as the filesystem's flock: local filesystems and NFSv4 honour it.
"""

from __future__ import annotations

import atexit
import fcntl
import json
import os
import socket
import time
from pathlib import Path

from trainer import comm
from trainer.errors import ConfigError

LOCK = ".lock"


class Owner:
    """The locks rank 0 holds (none on other ranks)."""

    def __init__(self, fds: list[int]) -> None:
        self.fds = fds
        # Also when the run ends with an error: the lock file is emptied, so the next
        # run does not take it for a dead job's. (A SIGKILL skips this, as it should.)
        atexit.register(self.release)

    def release(self) -> None:
        for fd in self.fds:
            os.ftruncate(fd, 0)  # an empty file: released cleanly, not by a dead job
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
        self.fds = []


def claim(directories: dict[str, Path]) -> Owner:
    """Lock each of `directories` (by the config key that names it; created if needed)
    for this run; every rank calls it and every rank raises ConfigError alike when one
    is held by another run or cannot be written."""
    result: list = [None]
    if comm.rank() == 0:
        fds: list[int] = []
        names = {Path(os.path.abspath(d)): key for key, d in directories.items()}
        try:
            for d in _outermost(list(directories.values())):
                fds.append(lock_directory(d, names[d]))
            result = [None]
        except ConfigError as e:
            for fd in fds:
                os.close(fd)
            result = [str(e)]
        owner = Owner(fds)
    else:
        owner = Owner([])
    comm.broadcast_object(result)
    if result[0] is not None:
        raise ConfigError(result[0])
    return owner


def _outermost(directories: list[Path]) -> list[Path]:
    """The directories to lock: one inside another is covered by the outer one's lock."""
    paths = [Path(os.path.abspath(d)) for d in directories]
    return [
        p
        for i, p in enumerate(paths)
        if not any(q in (p, *p.parents) for q in paths[:i])
        and not any(q in p.parents for q in paths[i + 1 :])
    ]


def lock_directory(directory: Path, key: str) -> int:
    """Take `directory`'s lock ([Note: run directory lock]) and write this process into
    it; return the open descriptor that holds it. `key` names the directory's option in
    the one line that refuses a held or unwritable directory."""
    path = directory / LOCK
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise ConfigError(f"{key} {directory} is not writable: {e.strerror}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _describe(os.pread(fd, 4096, 0))
        os.close(fd)
        raise ConfigError(
            f"{directory} is in use by another run ({holder}); wait for it to end, or give "
            "this run another hydra.run.dir (or ckpt.dir)"
        ) from None
    stale = os.pread(fd, 4096, 0)
    if stale:
        _say(f"note: {directory} was locked by a run that has ended ({_describe(stale)})")
    me = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "since": time.strftime("%Y-%m-%d %H:%M:%S"),
        "slurm_job": os.environ.get("SLURM_JOB_ID"),
    }
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(me).encode(), 0)
    os.fsync(fd)
    return fd


def held_by(directory: Path) -> str | None:
    """Who holds `directory`'s lock now, or None: a look before Hydra writes `.hydra/` into
    a run directory (its files would overwrite the holder's); the lock itself is taken
    later, by `claim`."""
    path = Path(directory) / LOCK
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # no lock file, or none we can read: nobody to protect
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _describe(os.pread(fd, 4096, 0))
    finally:
        os.close(fd)  # also drops the shared lock taken just to look
    return None


def _describe(raw: bytes) -> str:
    try:
        h = json.loads(raw)
        job = f", SLURM job {h['slurm_job']}" if h.get("slurm_job") else ""
        return f"pid {h['pid']} on {h['host']} since {h['since']}{job}"
    except (ValueError, KeyError, TypeError):
        return "holder unknown"


def _say(line: str) -> None:
    from tqdm import tqdm

    tqdm.write(line)
