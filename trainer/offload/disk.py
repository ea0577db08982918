"""The file `mode.offload=disk` keeps a rank's state in between optimizer steps: allocated
in full when the run starts, read and written region by region on background threads.

[Note: the offload file]
One file per rank, `<mode.offload_dir>/rank<r>.offload` (by default under the run
directory): a name tied to the run and the rank, never to a Python object, so a run started
again in the same directory replaces its own file instead of adding one, and nothing else
ever looks in it (checkpoints copy the values out of it, not the file).
- Its size is known before the first step (the optimizer's per-element state and the
  masters it moves, state.py) and `posix_fallocate` reserves every block at once: a disk
  without room fails the run at start, in one line with the bytes needed and free, never
  mid-run with SIGBUS or a short write. The file is never memory-mapped.
- Reads and writes are `preadv`/`pwrite` straight into and out of the tensors' own memory;
  after each, `posix_fadvise(DONTNEED)` asks the kernel to drop those pages, so that the
  file does not turn into page cache as large as the state it moved out (a dirty page is
  dropped once written back: the read of that region in the next step drops it at last).
  O_DIRECT would skip the cache altogether but needs 4 KiB-aligned memory, which torch's
  CPU allocator does not promise.
- What the file holds is checked: a read that returns fewer bytes than asked (the file
  truncated under the run), or a file that is no longer at its path (removed or replaced),
  is a StorageError naming the file and the region, never zeros or another run's values.
- The file is removed when the run ends (`close`, from Engine.close); a run killed before
  that leaves it, and the next run in that directory truncates it first.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from trainer.errors import StorageError

ALIGN = 4096  # regions start at multiples of a page


def aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _bytes(t: torch.Tensor) -> memoryview:
    """The memory of contiguous CPU tensor `t` as writable bytes, no copy. Not through
    numpy: a storage numpy has seen can never be resized, and offloading frees a tensor's
    memory by resizing its storage to 0 ([Note: offloaded state] in state.py)."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("the offload file reads and writes contiguous CPU tensors only")
    n = t.numel() * t.element_size()
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


class OffloadFile:
    """`nbytes` reserved at `path` ([Note: the offload file]), with one reader and one
    writer thread: `read_async`/`write_async` return futures whose `result()` raises what
    the I/O raised."""

    def __init__(self, path: Path | str, nbytes: int):
        self.path, self.nbytes = Path(path), int(nbytes)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # O_TRUNC: a file left by a killed run of this directory is replaced, not grown
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            if self.nbytes:
                os.posix_fallocate(fd, 0, self.nbytes)
        except OSError as e:
            os.close(fd)
            self.path.unlink(missing_ok=True)
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                free = shutil.disk_usage(self.path.parent).free
                raise StorageError(
                    f"mode.offload=disk: {self.path} needs {_size(self.nbytes)} "
                    f"({self.nbytes} bytes) and its file system has {_size(free)} free; "
                    "free some, or set mode.offload_dir to a disk with room"
                ) from None
            raise StorageError(
                f"mode.offload=disk: cannot reserve {_size(self.nbytes)} for {self.path} "
                f"({errno.errorcode.get(e.errno, e.errno)}: {e.strerror})"
            ) from None
        self.fd: int | None = fd
        self.inode = os.fstat(fd).st_ino
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="offload-read")
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="offload-write")

    # -- one region ------------------------------------------------------------------------
    def write(self, t: torch.Tensor, offset: int) -> None:
        """The bytes of contiguous CPU tensor `t` at `offset`."""
        view, done = _bytes(t), 0
        try:
            while done < len(view):
                done += os.pwrite(self._fd(), view[done:], offset + done)
            os.posix_fadvise(self._fd(), offset, len(view), os.POSIX_FADV_DONTNEED)
        except OSError as e:
            raise self._error("write", offset, len(view), e) from None

    def read(self, t: torch.Tensor, offset: int) -> None:
        """Bytes at `offset` into contiguous CPU tensor `t`, all of them or an error."""
        view, done = _bytes(t), 0
        try:
            while done < len(view):
                got = os.preadv(self._fd(), [view[done:]], offset + done)
                if got == 0:
                    raise StorageError(
                        f"mode.offload=disk: {self.path} ends at byte {offset + done}, but "
                        f"bytes [{offset}, {offset + len(view)}) of the state are kept there: "
                        "the file was truncated while the run used it"
                    )
                done += got
            os.posix_fadvise(self._fd(), offset, len(view), os.POSIX_FADV_DONTNEED)
        except OSError as e:
            raise self._error("read", offset, len(view), e) from None

    def read_async(self, jobs: list[tuple[torch.Tensor, int]]) -> Future:
        return self._reader.submit(lambda: [self.read(t, o) for t, o in jobs])

    def write_async(self, jobs: list[tuple[torch.Tensor, int]]) -> Future:
        return self._writer.submit(lambda: [self.write(t, o) for t, o in jobs])

    # -- the file as a whole ---------------------------------------------------------------
    def check(self) -> None:
        """Raise StorageError if the file is no longer the one at its path (removed or
        replaced) or is shorter than reserved: once per step, before it is read."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            raise StorageError(
                f"mode.offload=disk: {self.path} was removed while the run keeps its "
                "optimizer state there; the run cannot go on (resume from a checkpoint)"
            ) from None
        if st.st_ino != self.inode:
            raise StorageError(
                f"mode.offload=disk: {self.path} was replaced by another file while the run "
                "keeps its optimizer state there; the run cannot go on (resume from a checkpoint)"
            )
        if st.st_size < self.nbytes:
            raise StorageError(
                f"mode.offload=disk: {self.path} holds {st.st_size} bytes, the run keeps "
                f"{self.nbytes} there: it was truncated; the run cannot go on (resume from a "
                "checkpoint)"
            )

    def allocated_bytes(self) -> int:
        """Bytes of disk the file takes now (its allocated blocks)."""
        return os.fstat(self._fd()).st_blocks * 512

    def close(self) -> None:
        """Join the threads, close and remove the file (idempotent)."""
        if self.fd is None:
            return
        self._reader.shutdown(wait=True)
        self._writer.shutdown(wait=True)
        os.close(self.fd)
        self.fd = None
        try:
            if os.stat(self.path).st_ino == self.inode:  # not another run's file
                self.path.unlink()
        except FileNotFoundError:
            pass

    def _fd(self) -> int:
        if self.fd is None:
            raise StorageError(f"mode.offload=disk: {self.path} was already closed")
        return self.fd

    def _error(self, what: str, offset: int, n: int, e: OSError) -> StorageError:
        code = errno.errorcode.get(e.errno, e.errno)
        return StorageError(
            f"mode.offload=disk: {what} of bytes [{offset}, {offset + n}) of {self.path} "
            f"failed ({code}: {e.strerror})"
        )


class OnDisk:
    """`numel` values of `dtype` at `offset` of an offload file: a checkpoint segment that
    is streamed from the file through the writer's staging buffer, never whole in memory."""

    def __init__(self, file: OffloadFile, offset: int, numel: int, dtype: torch.dtype):
        self.file, self.offset, self._numel, self.dtype = file, offset, numel, dtype

    def numel(self) -> int:
        return self._numel

    def chunks(self, staging: torch.Tensor) -> Iterator[torch.Tensor]:
        """The values, a staging buffer's worth at a time (each chunk valid until the next)."""
        per = max(1, staging.numel() // self.dtype.itemsize)
        for a in range(0, self._numel, per):
            out = staging[: min(per, self._numel - a) * self.dtype.itemsize].view(self.dtype)
            self.file.read(out, self.offset + a * self.dtype.itemsize)
            yield out
