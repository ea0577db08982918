"""A rank's checkpoint data: tensors streamed to a raw file within one bounded buffer, and
ranges of it read back, each checked against its checksums.

[Note: streamed checkpoint files]
Each rank writes `rank{r}.bin`: the bytes of its tensors one after another (each entry
starts at a multiple of ALIGN bytes), and then `rank{r}.pt`, a small index (a torch file
that `weights_only` loads) giving per entry its dtype, shape, byte offset and length, the
file's size, and one CRC32 per BLOCK bytes of the file, computed on the bytes as they are
written. No copy of the state is made to write it: a contiguous CPU tensor is written
from its own memory; a CUDA tensor, or one that is cast (an fp16 buffer kept as fp32), goes
through one staging buffer of `ckpt.buffer_mb` (pinned on CUDA), a chunk at a time. So a
save needs that buffer and no more, whatever the size of the model.
The file is allocated in full before the first byte is written: a full disk fails there,
with the size it needed, not halfway.
A read of any range reads the blocks around it, one at a time into a block-sized buffer,
checks each against its CRC, and copies the range's part into its destination: a re-cut
reads only the ranges it needs and still finds a flipped byte in them, and memory stays
one block. A read the storage fails is retried, then named as a storage error, not
damage ([Note: storage errors are not damage] in storage.py).
"""

from __future__ import annotations

import errno
import os
import zlib
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from trainer.checkpoint import storage
from trainer.errors import ConfigError, Damaged, TrainingError
from trainer.offload.disk import OnDisk

BLOCK = 1 << 20  # bytes per CRC32
ALIGN = 64  # entries start at multiples of this: no element straddles two blocks
_ZEROS = bytes(BLOCK)

# One segment of an entry: a tensor's elements (any device, any dtype: cast to the
# entry's), a count of zero elements (padding, pieces without optimizer state), or values
# in an offload file (mode.offload=disk: read through the staging buffer, a chunk at a time).
Segment = torch.Tensor | int | OnDisk


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ConfigError(f"unknown dtype {name!r} in a checkpoint index")
    return dtype


class Entry:
    """What will be written under one name: dtype, shape and its segments in order."""

    def __init__(
        self, name: str, dtype: torch.dtype, shape: Iterable[int], segments: list[Segment]
    ) -> None:
        self.name, self.dtype, self.shape, self.segments = name, dtype, list(shape), segments
        self.numel = sum(s if isinstance(s, int) else s.numel() for s in segments)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def planned_bytes(entries: list[Entry]) -> int:
    pos = 0
    for e in entries:
        pos = _aligned(pos) + e.nbytes
    return pos


def _aligned(pos: int) -> int:
    return -(-pos // ALIGN) * ALIGN


def stage_entries(entries: list[Entry], host: torch.Tensor) -> list[Entry]:
    """`entries` copied into `host` (uint8, at least planned_bytes(entries)) laid out as
    the data file will be, each as one contiguous CPU tensor of its dtype: what an async
    save writes while training goes on ([Note: async save] in checkpoint/background.py).
    Zero segments are filled; casts happen in the copy."""
    staged, pos = [], 0
    for e in entries:
        pos = _aligned(pos)
        out = host[pos : pos + e.nbytes].view(e.dtype)
        i = 0
        for s in e.segments:
            if isinstance(s, int):
                out[i : i + s].zero_()
                i += s
            else:
                n = s.numel()
                out[i : i + n].copy_(s.detach().reshape(-1), non_blocking=True)
                i += n
        staged.append(Entry(e.name, e.dtype, e.shape, [out]))
        pos += e.nbytes
    return staged


def write_entries(
    path: Path,
    entries: list[Entry],
    buffer_bytes: int,
    sink_type: Callable[[Any], Any],
    halfway: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Stream `entries` into `path`, fsync it, and return its index (see the note).
    `sink_type` wraps the file (files.Sink, which keeps the OSError of a failed write);
    `halfway` is called once half the bytes are written (fault injection). OSError and
    RuntimeError propagate: the caller names them."""
    total = planned_bytes(entries)
    with open(path, "wb") as f:
        _allocate(f.fileno(), total)
        writer = _Writer(sink_type(f), buffer_bytes, total, halfway)
        index = {}
        for e in entries:
            writer.pad_to(_aligned(writer.pos))
            index[e.name] = [dtype_name(e.dtype), e.shape, writer.pos, e.nbytes]
            for s in e.segments:
                if isinstance(s, int):
                    writer.zeros(s * e.dtype.itemsize)
                else:
                    writer.tensor(s, e.dtype)
        crcs = writer.finish()
        f.flush()
        os.fsync(f.fileno())
    return {"entries": index, "size": total, "block": BLOCK, "crcs": crcs}


def _allocate(fd: int, size: int) -> None:
    if size == 0:
        return
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:  # a filesystem without it: the writes find a full disk instead
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise


class _Writer:
    def __init__(self, sink, buffer_bytes: int, total: int, halfway) -> None:
        self.sink, self.buffer_bytes, self.total, self.halfway = sink, buffer_bytes, total, halfway
        self.pos, self.crc, self.crcs = 0, 0, []
        self.staging: torch.Tensor | None = None  # made at the first use only

    def _write(self, data: memoryview) -> None:
        i = 0
        while i < len(data):  # a CRC per BLOCK bytes of the file
            part = data[i : i + BLOCK - self.pos % BLOCK]
            self.crc = zlib.crc32(part, self.crc)
            i += len(part)
            self.pos += len(part)
            if self.pos % BLOCK == 0:
                self.crcs.append(self.crc)
                self.crc = 0
        self.sink.write(data)
        if self.halfway is not None and self.pos >= self.total // 2:
            self.halfway, halfway = None, self.halfway
            halfway()

    def zeros(self, n: int) -> None:
        while n > 0:
            k = min(n, BLOCK)
            self._write(memoryview(_ZEROS)[:k])
            n -= k

    def pad_to(self, pos: int) -> None:
        self.zeros(pos - self.pos)

    def tensor(self, t: torch.Tensor | OnDisk, dtype: torch.dtype) -> None:
        if isinstance(t, OnDisk):  # from the offload file, as the state's own dtype
            for chunk in t.chunks(self._staging(torch.device("cpu"))):
                self._write(_bytes(chunk.to(dtype)))
            return
        t = t.detach()
        if t.numel() == 0:
            return
        if t.device.type == "cpu" and t.dtype == dtype and t.is_contiguous():
            self._write(_bytes(t))  # from the tensor's own memory
            return
        # Through the staging buffer, a chunk at a time. (A non-contiguous tensor, which
        # the modes never make of what they shard, is flattened first: one tensor's copy.)
        flat = t.reshape(-1)
        staging = self._staging(t.device)
        per = max(1, staging.numel() // dtype.itemsize)
        for a in range(0, flat.numel(), per):
            chunk = flat[a : a + per]
            out = staging[: chunk.numel() * dtype.itemsize].view(dtype)
            out.copy_(chunk)  # device to host (synchronous), and the cast
            self._write(_bytes(out))

    def _staging(self, device: torch.device) -> torch.Tensor:
        if self.staging is None:
            pinned = device.type == "cuda"
            self.staging = torch.empty(self.buffer_bytes, dtype=torch.uint8, pin_memory=pinned)
        return self.staging

    def finish(self) -> list[int]:
        if self.halfway is not None:  # nothing to write: "halfway" is the end
            self.halfway()
        if self.pos % BLOCK:
            self.crcs.append(self.crc)
        return self.crcs


def _bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


class DataFile:
    """Ranges of one rank's data file, read and checked against its index."""

    def __init__(self, path: Path, index: dict[str, Any]) -> None:
        self.path, self.index = Path(path), index
        size = storage.stat(self.path).st_size  # [Note: storage errors are not damage]
        if size != index["size"]:
            raise Damaged(
                f"{self.path} is truncated or corrupted: {size} bytes, its index says "
                f"{index['size']}"
            )
        self.block, self.crcs = index["block"], index["crcs"]
        self.buffer = bytearray(self.block)
        self.cached = -1  # the block the buffer holds, checked
        self.file = None

    def has(self, name: str) -> bool:
        return name in self.index["entries"]

    def entry(self, name: str) -> tuple[torch.dtype, list[int], int, int]:
        dtype, shape, offset, nbytes = self.index["entries"][name]
        return dtype_of(dtype), shape, offset, nbytes

    def read(self, name: str, start: int, out: torch.Tensor | None, count: int = 0) -> None:
        """Elements [start, start + n) of entry `name` into `out` (1-D, n elements, any
        device and dtype: cast from the stored one); `out` None: check `count` of them only."""
        dtype, _, offset, nbytes = self.entry(name)
        size = dtype.itemsize
        n = out.numel() if out is not None else count
        a, b = offset + start * size, offset + (start + n) * size
        if start < 0 or b > offset + nbytes:
            raise ConfigError(f"{self.path}: elements {start}..{start + n} outside {name}")
        for blk in range(a // self.block, -(-b // self.block)):
            data = self._block(blk)
            lo = blk * self.block
            x, y = max(a, lo), min(b, lo + len(data))
            if out is not None:
                src = torch.frombuffer(data, dtype=dtype, count=(y - x) // size, offset=x - lo)
                out[(x - a) // size : (y - a) // size].copy_(src)

    def _block(self, blk: int) -> memoryview:
        lo = blk * self.block
        n = min(self.block, self.index["size"] - lo)
        view = memoryview(self.buffer)[:n]
        if blk == self.cached:
            return view
        if storage.retried(lambda: self._read_into(view, lo), self.path) != n:
            raise Damaged(f"{self.path} is truncated: it ends before byte {lo + n}")
        if zlib.crc32(view) != self.crcs[blk]:
            self.cached = -1
            raise Damaged(
                f"{self.path} is corrupted: bytes {lo}..{lo + n} do not match their checksum"
            )
        self.cached = blk
        return view

    def _read_into(self, view: memoryview, lo: int) -> int:
        try:
            if self.file is None:
                self.file = open(self.path, "rb")  # noqa: SIM115 (closed by close())
            self.file.seek(lo)
            return self.file.readinto(view)
        except OSError:
            self.close()  # the next attempt opens it again: a stale handle is looked up anew
            raise

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


def full_disk(path: Path, needed: int) -> TrainingError:
    return TrainingError(
        f"no space left on device writing {path} (it needs about {megabytes(needed)}; "
        "free some, or set a ckpt.dir with room)"
    )


def megabytes(n: int) -> str:
    return f"{n / 2**20:.1f} MB" if n >= 2**20 else f"{n / 2**10:.1f} kB"
