"""Fault injection for tests and scripts/chaos.py: kill, stall, stop or damage a rank at
chosen points of training or of a checkpoint save ([Note: fault injection]).

    faults.check(world_size)           # before joining the group: a bad schedule is refused,
                                       # a good one named in one line (rank 0)
    faults.fault("step", step, ckpt_dir)  # after each optimizer step (saving.maybe_save)
    faults.fault("save", step, path)   # halfway through writing a data file
    faults.fault("prune", step, path)  # removing a checkpoint that step's save prunes
"""

from __future__ import annotations

import os
import signal
import struct
import threading
import time
import zipfile
from functools import cache
from pathlib import Path
from typing import NamedTuple

from trainer import comm
from trainer.checkpoint import files
from trainer.errors import ConfigError

# [Note: fault injection]
# SHARDTRAIN_FAULT="RANK:STEP:ACTION[,RANK:STEP:ACTION...]" names the faults of a run; each
# entry fires on rank RANK at step STEP. ACTION is one of:
#   kill          SIGKILL after that step
#   hang          stop answering after that step (the peers time out: dist.timeout_s; a
#                 SIGTERM ends it)
#   pause         sleep after that step, saying so first: 10 s, or until the file
#                 SHARDTRAIN_FAULT_PAUSE_UNTIL names exists (at most 120 s); a slow step
#   term          SIGTERM after that step, as a preemption: the run stops at its next check
#                 step with a checkpoint ([Note: stopping on SIGTERM])
#   corrupt       after that step, flip a byte of this rank's part of the newest complete
#                 checkpoint (as a disk would), then SIGKILL
#   kill_in_save  SIGKILL halfway through streaming its data file of that step's checkpoint
#   fail_in_save  the write of that data file fails there with an OSError (a broken disk)
#   kill_in_prune SIGKILL halfway through removing a checkpoint that step's save prunes
#                 (rank 0 prunes: RANK must be 0)
#   nocommit      under ft, that step's commit fails in this rank's replica group (as if
#                 its cross-group AllReduce had failed): the step is redone, or healed;
#                 under ft.semi_sync, the commit of the fragment sync applied after that
#                 step: the sync is sent again
#   kill_in_sync  under ft.semi_sync, SIGKILL once the fragment sync sent after that step
#                 is on its way, before its result is waited for
# Under ft, RANK is the rank inside the replica group: set the variable in the
# environment of the group that is to meet the fault.
# Without SHARDTRAIN_FAULT_ONCE an entry fires every time its point is reached. With
# SHARDTRAIN_FAULT_ONCE=DIR each entry fires at most once: it leaves a file in DIR when it
# fires (`<index>-<rank>-<step>-<action>`, holding the time), so a group that torchrun
# restarts meets the next fault of the schedule, not the same one again. (DIR an existing
# file, the older single-fault form: nothing fires.) A run with SHARDTRAIN_FAULT set says
# so in its first line, on rank 0 (`check`, before the group): each entry, those fired.

FAULT_ENV, FAULT_ONCE_ENV = "SHARDTRAIN_FAULT", "SHARDTRAIN_FAULT_ONCE"
PAUSE_ENV = "SHARDTRAIN_FAULT_PAUSE_UNTIL"
POINTS = {
    "kill": "step",
    "hang": "step",
    "term": "step",
    "corrupt": "step",
    "kill_in_save": "save",
    "fail_in_save": "save",
    "kill_in_prune": "prune",
    "nocommit": "commit",
    "kill_in_sync": "sync",
    "pause": "step",
}


class Entry(NamedTuple):
    index: int
    rank: int
    step: int
    action: str

    @property
    def marker(self) -> str:
        return f"{self.index}-{self.rank}-{self.step}-{self.action}"


@cache
def parse(spec: str) -> tuple[Entry, ...]:
    """The entries of a SHARDTRAIN_FAULT value; ConfigError naming a bad one."""
    entries = []
    for i, text in enumerate(spec.split(",")):
        parts = text.strip().split(":")
        ok = len(parts) == 3 and parts[0].isdigit() and parts[1].isdigit()
        if not ok or parts[2] not in POINTS or int(parts[1]) < 1:
            raise ConfigError(
                f"{FAULT_ENV}={spec!r}: entry {text!r} is not RANK:STEP:ACTION with RANK >= 0, "
                f"STEP >= 1 and ACTION one of {', '.join(POINTS)} (entries separated by commas)"
            )
        entry = Entry(i, int(parts[0]), int(parts[1]), parts[2])
        if entry.action == "kill_in_prune" and entry.rank != 0:
            raise ConfigError(
                f"{FAULT_ENV}={spec!r}: entry {text!r} can never fire: rank 0 alone prunes "
                "checkpoints; use 0:STEP:kill_in_prune"
            )
        entries.append(entry)
    return tuple(entries)


def check(world_size: int) -> None:
    """Refuse a bad SHARDTRAIN_FAULT, or one naming a rank this run does not have; on
    rank 0 (torchrun's RANK), say in one line that faults are armed, and which."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    for e in parse(spec):
        if e.rank >= world_size:
            raise ConfigError(
                f"{FAULT_ENV}={spec!r}: entry {e.rank}:{e.step}:{e.action} names rank {e.rank}, "
                f"but this run has ranks 0..{world_size - 1}"
            )
    if int(os.environ.get("RANK", "0")) == 0:  # before the group: no rank to ask yet
        print(describe(spec), flush=True)


WHAT = {
    "kill": "SIGKILL after step {}",
    "hang": "hangs after step {}",
    "pause": "pauses after step {}",
    "term": "SIGTERM after step {}",
    "corrupt": "damages the newest checkpoint after step {}, then SIGKILL",
    "kill_in_save": "SIGKILL halfway through saving step {}",
    "fail_in_save": "a failed write saving step {}",
    "kill_in_prune": "SIGKILL halfway through a prune at step {}",
    "nocommit": "fails the commit of step {}",
    "kill_in_sync": "SIGKILL inside the fragment sync sent after step {}",
}


def describe(spec: str) -> str:
    """One line naming the faults of `spec` and, under SHARDTRAIN_FAULT_ONCE, which of
    them have fired already (a restarted group meets the rest)."""
    once = os.environ.get(FAULT_ONCE_ENV)
    fired = set()
    if once and Path(once).is_dir():
        fired = {p.name for p in Path(once).iterdir()}
    entries = [
        f"rank {e.rank} {WHAT[e.action].format(e.step)}" + (" (fired)" if e.marker in fired else "")
        for e in parse(spec)
    ]
    if not once:
        how = "each every time its point is reached"
    elif Path(once).is_file():
        how = f"none fires: {FAULT_ONCE_ENV}={once} is a file"
    else:
        how = f"each once, {FAULT_ONCE_ENV}={once}"
    return f"warning: fault injection is on, {FAULT_ENV}={spec}: {'; '.join(entries)} ({how})"


def armed() -> bool:
    return bool(os.environ.get(FAULT_ENV))


def fault(where: str, step: int, path: Path | None = None) -> bool:
    """[Note: fault injection]. Free unless SHARDTRAIN_FAULT is set. Returns whether a
    fault that lets the process go on (`nocommit`) fired."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return False
    rank = comm.rank()
    for entry in parse(spec):
        if (entry.rank, entry.step, POINTS[entry.action]) == (rank, step, where) and _claim(entry):
            _fire(entry, spec, path)
            return True
    return False


def _claim(entry: Entry) -> bool:
    """Whether `entry` fires now: always without SHARDTRAIN_FAULT_ONCE, else once only."""
    once = os.environ.get(FAULT_ONCE_ENV)
    if not once:
        return True
    directory = Path(once)
    if directory.is_file():
        return False
    directory.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(directory / entry.marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    os.write(fd, f"{time.time():.3f}\n".encode())
    os.fsync(fd)
    os.close(fd)
    return True


def _fire(entry: Entry, spec: str, path: Path | None) -> None:
    action = entry.action
    if action == "nocommit":  # the caller fails the commit
        return
    if action == "hang":
        # Stalled: the peers time out (dist.timeout_s) and end; the SIGTERM with which
        # torchrun then stops the group ends this rank too, as it would end one stuck in
        # a collective of the torn-down group (preempt's flag-only handler would keep it
        # waiting out torchrun's 30 s before a SIGKILL).
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        while True:
            time.sleep(60)
    if action == "pause":
        until = os.environ.get(PAUSE_ENV)
        print(f"fault: rank {entry.rank} pauses after step {entry.step}", flush=True)
        end = time.monotonic() + (120 if until else 10)
        while time.monotonic() < end and not (until and Path(until).exists()):
            time.sleep(0.05)
        return
    if action == "term":
        os.kill(os.getpid(), signal.SIGTERM)  # the handler only sets a flag: training goes on
        return
    if action == "fail_in_save":
        raise OSError(f"injected write failure ({FAULT_ENV} entry {entry.marker})")
    if action == "kill_in_prune" and path is not None:
        (path / "meta.pt").unlink()  # as if killed in the middle of deleting it
    if action == "corrupt" and path is not None:
        _corrupt_newest(path, entry.rank)
    os.kill(os.getpid(), signal.SIGKILL)


def _corrupt_newest(directory: Path, rank: int) -> None:
    """Flip one byte of `rank`'s part of the newest complete checkpoint under `directory`:
    the middle of its data file, or (a ddp rank > 0 writes none) of the largest tensor in
    its index file."""
    found = files.find_checkpoints(directory)
    if not found:
        return
    data, index = found[0] / f"rank{rank}.bin", found[0] / f"rank{rank}.pt"
    if data.is_file() and data.stat().st_size > 0:
        _flip(data, data.stat().st_size // 2)
        return
    with zipfile.ZipFile(index) as z:
        info = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    with open(index, "rb") as f:
        f.seek(info.header_offset + 26)  # local header: the name and extra field lengths
        name_len, extra_len = struct.unpack("<HH", f.read(4))
    _flip(index, info.header_offset + 30 + name_len + extra_len + info.file_size // 2)


def _flip(file: Path, pos: int) -> None:
    with open(file, "r+b") as f:
        f.seek(pos)
        byte = f.read(1)[0]
        f.seek(pos)
        f.write(bytes([byte ^ 0xFF]))
        f.flush()
        os.fsync(f.fileno())
