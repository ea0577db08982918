"""Reading checkpoint files from storage that may fail for a moment: each read retried a
few times, then named by its file and errno, never taken for damage.

[Note: storage errors are not damage]
Only what proves a checkpoint's bytes wrong is damage (errors.Damaged, which resume=auto
sets aside for an older checkpoint): a CRC32 that does not match, a .pt file that does
not unpickle, a data file that ends early or whose size is not its index's, a file that
no rank finds. A read that fails for the storage's sake says nothing about the bytes: an
OSError such as EIO or ESTALE (a network file system), EACCES, or a file that one rank
does not find while another does (a ckpt.dir that is not one shared filesystem, a stale
attribute cache). Taking that for damage would set aside every good checkpoint of the
run, one after the other, and start it again from step 0.
So every open, stat and read of a checkpoint file goes through `retried`: an OSError is
tried again after each of DELAYS_S (a file handle gone stale is looked up again by the
next open), and if it still fails the read raises errors.StorageError naming the file,
the errno and the attempts. ENOENT is not retried: it raises errors.Missing, which
resume turns into damage only when no rank finds the file (resume.py, `_verdict`).
A StorageError fails the resume on every rank with that one line, and nothing on disk is
renamed: the next attempt (torchrun's restart, or the same command again) may read it.
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from trainer.errors import Missing, StorageError

# The waits between attempts: four attempts within 1.4 s. Short, since a resume that
# will fail anyway should say so at once; long enough for a stale handle or a dropped
# connection to come back.
DELAYS_S = (0.1, 0.3, 1.0)

T = TypeVar("T")


def _sleep(seconds: float) -> None:  # a function of its own: tests record the waits
    time.sleep(seconds)


def retried(read: Callable[[], T], file: Path, missing: str | None = None) -> T:
    """`read()`, tried again after each of DELAYS_S while it raises an OSError other than
    ENOENT; then StorageError naming `file` and the errno. ENOENT raises Missing at once
    (`missing`: its message; by default that `file` is missing)."""
    for delay in (*DELAYS_S, None):
        try:
            return read()
        except FileNotFoundError:
            message = missing or f"{file} is missing: the checkpoint is incomplete"
            raise Missing(message, str(file)) from None
        except OSError as e:
            if delay is None:
                raise StorageError(unreadable(file, e)) from None
            _sleep(delay)
    raise AssertionError("unreachable")


def unreadable(file: Path, e: OSError) -> str:
    return (
        f"cannot read {file}: {describe(e)}, {len(DELAYS_S) + 1} attempts over "
        f"{sum(DELAYS_S):.1f} s (a storage error, not damage)"
    )


def describe(e: OSError) -> str:
    """`EIO (Input/output error)`: the errno's name and what it means."""
    name = errno.errorcode.get(e.errno, f"errno {e.errno}") if e.errno else type(e).__name__
    return f"{name} ({e.strerror or str(e) or type(e).__name__})"


def read_bytes(file: Path) -> bytes:
    """The whole of `file` (a .pt file: an index, counters, RNG states; small)."""

    def read() -> bytes:
        with open(file, "rb") as f:
            return f.read()

    return retried(read, file)


def stat(file: Path, missing: str | None = None) -> os.stat_result:
    return retried(lambda: os.stat(file), file, missing)


def found(file: Path) -> bool | None:
    """Whether this rank finds `file`: True, False (ENOENT), None (the storage does not
    say: another OSError)."""
    try:
        os.stat(file)
    except FileNotFoundError:
        return False
    except OSError:
        return None
    return True
