"""The file `mode.offload=disk` keeps a rank's state in between optimizer steps: allocated
in full when the run starts, read and written region by region on background threads.

One file per rank, `<mode.offload_dir>/rank<r>.offload`: every block reserved at start (a
disk without room fails the run then, in one line), opened with O_DIRECT (no page cache),
each read checked, removed when the run ends. Why each, and what a file system without
O_DIRECT gets: [Note: the offload file], beside `OffloadFile`. What goes into the file
and when: [Note: offloaded state] in state.py.
"""

from __future__ import annotations

import bisect
import errno
import os
import shutil
import warnings
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from trainer.errors import StorageError

ALIGN = 4096  # what O_DIRECT asks of offsets, sizes and memory
SLOT_BYTES = 32 * 2**20  # one staging slot per I/O thread, at most

# A region's tensors: (tensor, its first byte within the region), in byte order
Parts = Sequence[tuple[torch.Tensor, int]]


def aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("the offload file reads and writes contiguous CPU tensors only")
    return t.detach().reshape(-1).view(torch.uint8)


class _Slot:
    """A page-aligned staging buffer; `view` is its memory as writable bytes for the OS."""

    def __init__(self, nbytes: int):
        self._raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
        skip = -self._raw.data_ptr() % ALIGN
        self.tensor = self._raw[skip : skip + nbytes]
        self.view = memoryview(self.tensor.numpy())  # never resized: numpy may see it


# [Note: the offload file]
# One file per rank, `<mode.offload_dir>/rank<r>.offload` (by default under the run
# directory): a name tied to the run and the rank, never to a Python object, so a run started
# again in the same directory replaces its own file instead of adding one, and nothing else
# ever looks in it (checkpoints copy the values out of it, not the file).
# - Its size is known before the first step (the optimizer's per-element state and the
#   masters it moves, state.py) and `posix_fallocate` reserves every block at once: a disk
#   without room fails the run at start, in one line with the bytes needed and free, never
#   mid-run with SIGBUS or a short write. The file is never memory-mapped.
# - It is opened with O_DIRECT: reads and writes go between the disk and this process's
#   memory, not through the page cache, so the file does not turn into cached memory as
#   large as the state it moved out (with buffered I/O every region is dirty again each
#   step, and the kernel keeps it all: measured, the whole file stayed cached). O_DIRECT
#   wants page-aligned memory, offsets and sizes: regions start at multiples of ALIGN and
#   are whole multiples of it (state.py lays them out so), and the bytes go through one
#   page-aligned staging slot per thread (`SLOT_BYTES`), a copy at memory speed beside the
#   disk's. A file system without O_DIRECT (tmpfs) gets buffered I/O with
#   `posix_fadvise(DONTNEED)` after each region instead, said once in a warning.
# - What the file holds is checked: a read that returns fewer bytes than asked (the file
#   truncated under the run), or a file that is no longer at its path (removed or replaced),
#   is a StorageError naming the file and the region, never zeros or another run's values.
# - The file is removed when the run ends (`close`, from Engine.close); a run killed before
#   that leaves it, and the next run in that directory truncates it first.
class OffloadFile:
    """`nbytes` (a multiple of ALIGN) reserved at `path` ([Note: the offload file]), with
    one reader and one writer thread, each with its own staging slot: `read_async` and
    `write_async` return futures whose `result()` raises what the I/O raised."""

    def __init__(self, path: Path | str, nbytes: int, slot_bytes: int = SLOT_BYTES):
        self.path, self.nbytes = Path(path), int(nbytes)
        if self.nbytes % ALIGN:
            raise ValueError(f"an offload file's size must be a multiple of {ALIGN}")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # O_TRUNC: a file left by a killed run of this directory is replaced, not grown
        flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC
        try:
            fd = os.open(self.path, flags | os.O_DIRECT, 0o600)
            self.direct = True
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise StorageError(
                    f"mode.offload=disk: cannot create {self.path} "
                    f"({errno.errorcode.get(e.errno, e.errno)}: {e.strerror})"
                ) from None
            fd = os.open(self.path, flags, 0o600)
            self.direct = False
            warnings.warn(
                f"mode.offload=disk: {self.path.parent} does not take O_DIRECT; the offload "
                "file goes through the page cache, dropped region by region",
                stacklevel=2,
            )
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
        self._slot_bytes = slot_bytes
        self._slots: dict[str, _Slot] = {}  # made by each thread at its first use
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="offload-read")
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="offload-write")

    # -- regions, in the I/O threads -------------------------------------------------------
    def _slot(self, name: str) -> _Slot:
        if name not in self._slots:
            self._slots[name] = _Slot(self._slot_bytes)
        return self._slots[name]

    def _chunks(self, offset: int, nbytes: int) -> Iterator[tuple[int, int]]:
        for start in range(0, nbytes, self._slot_bytes):
            yield start, min(self._slot_bytes, nbytes - start)

    def _write_region(self, offset: int, nbytes: int, parts: Parts) -> None:
        """Bytes [offset, offset + nbytes) of the file (both multiples of ALIGN), made of
        `parts`; bytes no part covers are left as the slot had them (no tensor's)."""
        slot = self._slot("write")
        for start, n in self._chunks(offset, nbytes):
            _gather(slot.tensor[:n], start, parts)
            self._pwrite(slot.view[:n], offset + start)

    def _read_region(self, offset: int, nbytes: int, parts: Parts) -> None:
        """`parts` filled from bytes [offset, offset + nbytes) of the file."""
        slot = self._slot("read")
        for start, n in self._chunks(offset, nbytes):
            self._pread(slot.view[:n], offset + start)
            _scatter(slot.tensor[:n], start, parts)

    def _pwrite(self, view: memoryview, offset: int) -> None:
        done = 0
        try:
            while done < len(view):
                done += os.pwrite(self._fd(), view[done:], offset + done)
            if not self.direct:
                os.posix_fadvise(self._fd(), offset, len(view), os.POSIX_FADV_DONTNEED)
        except OSError as e:
            raise self._error("write", offset, len(view), e) from None

    def _pread(self, view: memoryview, offset: int) -> None:
        done = 0
        try:
            while done < len(view):
                got = os.preadv(self._fd(), [view[done:]], offset + done)
                size = os.fstat(self._fd()).st_size if got < len(view) - done else None
                if size is not None and size < offset + len(view):
                    raise StorageError(
                        f"mode.offload=disk: {self.path} ends at byte {size}, but "
                        f"bytes [{offset}, {offset + len(view)}) of the state are kept there: "
                        "the file was truncated while the run used it"
                    )
                done += got
            if not self.direct:
                os.posix_fadvise(self._fd(), offset, len(view), os.POSIX_FADV_DONTNEED)
        except OSError as e:
            raise self._error("read", offset, len(view), e) from None

    # -- what the step and checkpoints call --------------------------------------------------
    def read_async(self, regions: list[tuple[int, int, Parts]]) -> Future:
        """Each (offset, nbytes, parts) region read into its parts, on the reader."""
        return self._reader.submit(lambda: [self._read_region(*r) for r in regions])

    def write_async(self, regions: list[tuple[int, int, Parts]]) -> Future:
        """Each (offset, nbytes, parts) region written from its parts, on the writer."""
        return self._writer.submit(lambda: [self._write_region(*r) for r in regions])

    def read(self, out: torch.Tensor, offset: int) -> None:
        """Any bytes [offset, offset + out's bytes) into contiguous CPU tensor `out`."""
        lo = offset // ALIGN * ALIGN
        hi = aligned(offset + out.numel() * out.element_size())
        self.read_async([(lo, hi - lo, [(out, offset - lo)])]).result()

    def write(self, t: torch.Tensor, offset: int) -> None:
        """Contiguous CPU tensor `t` as the whole aligned region at `offset`."""
        nbytes = aligned(t.numel() * t.element_size())
        self.write_async([(offset, nbytes, [(t, 0)])]).result()

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
        self._slots.clear()
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


def _overlaps(start: int, n: int, parts: Parts) -> Iterator[tuple[torch.Tensor, int, int, int]]:
    """(part's bytes, from, to within the chunk, from within the part) of each part that
    overlaps chunk [start, start + n) of a region; parts are in byte order."""
    firsts = [r for _, r in parts]
    i = max(0, bisect.bisect_right(firsts, start) - 1)
    for t, r in parts[i:]:
        if r >= start + n:
            break
        b = _as_bytes(t)
        a, z = max(r, start), min(r + b.numel(), start + n)
        if a < z:
            yield b, a - start, z - start, a - r


def _gather(chunk: torch.Tensor, start: int, parts: Parts) -> None:
    for b, lo, hi, at in _overlaps(start, chunk.numel(), parts):
        chunk[lo:hi].copy_(b[at : at + hi - lo])


def _scatter(chunk: torch.Tensor, start: int, parts: Parts) -> None:
    for b, lo, hi, at in _overlaps(start, chunk.numel(), parts):
        b[at : at + hi - lo].copy_(chunk[lo:hi])


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
