"""The on-disk format of a checkpoint: where it lives, checksummed writes, checked reads.

One directory per checkpoint under `ckpt.dir` (default `<run dir>/checkpoints`):

    step_000120/
      meta.pt    step, config (YAML), layout (mode, world size, per group: parameter
                 names, shapes, offsets, padded size, each rank's range; an expert group
                 also each parameter's full shape and each rank's EP position), optimizer class
                 and hyperparameters, sampler (and other) state, which buffers and frozen
                 parameters rank0.bin holds, checksum
      rank0.bin  this rank's data ([Note: streamed checkpoint files] in stream.py): its
      rank1.bin  slice of every sharded group (zero buckets, fsdp units) and of its
      ...        per-element optimizer state; rank 0 also holds unsharded groups (ddp's
                 whole model: ddp writes it once) and the buffers and frozen parameters
      rank0.pt   the index of rank0.bin (entries, size, a CRC32 per block) and this rank's
      ...        step counters and RNG states; checksum
      COMPLETE   written last (JSON: step, save id, run lineage): only a directory
                 holding it counts as a checkpoint
    lineage      (beside the step directories) the id of the run that owns them

Every file is checked as it is read, and only plain values are unpickled:
[Note: checked checkpoint files], beside `read`. How a save writes them: saving.py.
"""

from __future__ import annotations

import errno
import io
import json
import os
import pickle
import stat
import zlib
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from trainer.checkpoint import agree, storage, stream
from trainer.errors import ConfigError, Damaged, Missing, TrainingError

FORMAT = 3  # 2: optimizer step counters per parameter name; 3: data streamed to rank*.bin


MARKER, LINEAGE = "COMPLETE", "lineage"


def step_dir(directory: Path, step: int) -> Path:
    return Path(directory) / f"step_{step:06d}"


def checkpoint_dir(cfg: DictConfig, run_dir: Path) -> Path:
    return Path(cfg.ckpt.dir) if cfg.ckpt.get("dir") else Path(run_dir) / "checkpoints"


def find_checkpoints(directory: Path) -> list[Path]:
    """Checkpoints under `directory`, newest first: directories with a final name and
    the marker a save writes last. load() checks that every file is there and intact."""
    found = [
        p for p in Path(directory).glob("step_*") if p.name[5:].isdigit() and marker(p) is not None
    ]
    return sorted(found, key=step_of, reverse=True)


def step_of(path: Path) -> int:
    return int(path.name[5:])


def marker(path: Path) -> dict[str, Any] | None:
    """The COMPLETE marker of checkpoint `path`, or None when it has none (unfinished: no
    file, or one cut short). A marker the storage does not let us read raises
    StorageError ([Note: storage errors are not damage]): taking it for "none" would pass
    over a complete checkpoint."""
    try:
        marker = json.loads(storage.read_bytes(Path(path) / MARKER))
    except Missing:
        return None
    except ValueError:
        return None
    return marker if isinstance(marker, dict) else None


def lineage(directory: Path) -> str | None:
    """The run lineage that owns `directory` ([Note: run lineage]); None if unclaimed.
    StorageError when the storage does not let us read it."""
    try:
        return storage.read_bytes(Path(directory) / LINEAGE).decode().strip() or None
    except Missing:
        return None
    except ValueError:  # not text: unclaimed, as a lineage never written
        return None


def write(path: Path, obj: dict[str, Any]) -> None:
    obj["checksum"] = checksum(obj)
    write_file(path, obj, atomic=False)  # atomic already: the directory is renamed


def write_file(path: Path, obj: Any, atomic: bool = True) -> None:
    """torch.save `obj` to `path` and fsync it. `atomic`: through `<path>.tmp`, renamed
    at the end. A failed write leaves no partial or temporary file and raises
    TrainingError; a full disk is named as such (torch itself says only
    `[enforce fail at inline_container.cc:672] . unexpected pos 5952 vs 5846`)."""
    path = Path(path)
    target = path.with_name(path.name + ".tmp") if atomic else path
    sink = None
    try:
        with open(target, "wb") as f:
            sink = Sink(f)
            torch.save(obj, sink)
            f.flush()
            os.fsync(f.fileno())
        if atomic:
            os.replace(target, path)
    except (OSError, RuntimeError) as e:
        target.unlink(missing_ok=True)
        cause = next((x for x in (e, e.__context__, sink and sink.error) if _is_full(x)), None)
        if cause is not None:
            raise stream.full_disk(path, _tensor_bytes(obj)) from None
        raise TrainingError(f"cannot write {path}: {agree.line(e)}") from None


def write_data(
    path: Path, entries: list[stream.Entry], buffer_bytes: int, halfway=None
) -> dict[str, Any]:
    """Stream `entries` into data file `path` ([Note: streamed checkpoint files]) and
    return its index. A failed write raises TrainingError (a full disk named as such,
    with the size it needs) and leaves no file."""
    sink: list[Sink] = []

    def sink_type(f):
        sink.append(Sink(f))
        return sink[0]

    try:
        return stream.write_entries(path, entries, buffer_bytes, sink_type, halfway)
    except (OSError, RuntimeError) as e:
        path.unlink(missing_ok=True)
        error = sink[0].error if sink else None
        if any(_is_full(x) for x in (e, e.__context__, error)):
            raise stream.full_disk(path, stream.planned_bytes(entries)) from None
        raise TrainingError(f"cannot write {path}: {agree.line(e)}") from None


class Sink:
    """The file torch.save writes through: keeps the OSError of a failed write, which
    torch replaces with a message of its own ("unexpected pos ...")."""

    def __init__(self, f) -> None:
        self.f, self.error = f, None

    def write(self, data: bytes) -> int:
        try:
            return self.f.write(data)
        except OSError as e:
            self.error = e
            raise

    def flush(self) -> None:
        self.f.flush()


def _is_full(e: BaseException | None) -> bool:
    return isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)


def _tensor_bytes(obj: Any) -> int:
    if torch.is_tensor(obj):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def write_text(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_meta(path: Path) -> dict[str, Any]:
    path = Path(path)
    absent = f"checkpoint {path} does not exist or is not a directory"
    if not stat.S_ISDIR(storage.stat(path, missing=absent).st_mode):
        raise ConfigError(absent)
    meta = read(path / "meta.pt")
    for key in ("step", "layout", "optim_hparams", "replicated", "state"):
        if key not in meta:
            raise ConfigError(f"{path / 'meta.pt'} is not a checkpoint's meta.pt (no {key!r})")
    return meta


def read_rank(path: Path, rank: int, meta: dict[str, Any]) -> dict[str, Any]:
    """Rank `rank`'s index, checked to belong to the checkpoint that `meta` describes."""
    file = Path(path) / f"rank{rank}.pt"
    data = read(file)
    layout, want = data.get("layout", {}), meta["layout"]
    if layout != want or data.get("rank") != rank or data.get("id") != meta.get("id"):
        if layout.get("mode") != want["mode"] or layout.get("world_size") != want["world_size"]:
            what = (
                f"a shard of mode {layout.get('mode')} over {layout.get('world_size')} ranks, "
                f"while meta.pt describes mode {want['mode']} over {want['world_size']} ranks"
            )
        elif layout != want:
            what = "a shard of another parameter layout than meta.pt describes"
        elif data.get("rank") != rank:
            what = f"rank {data.get('rank')}'s shard"
        else:
            what = f"a shard of another save (id {data.get('id')}, meta.pt has {meta.get('id')})"
        raise ConfigError(f"{file} does not belong to this checkpoint: it holds {what}")
    if data.get("step") != meta["step"]:
        raise ConfigError(f"{file} is from step {data.get('step')}, meta.pt from {meta['step']}")
    return data


# [Note: checked checkpoint files]
# Every .pt file holds plain tensors and Python values only: `torch.load(weights_only=True)`
# reads it, and that is the only way a checkpoint file is loaded; .bin files are raw bytes
# that the index describes. Each carries CRC32s over its contents, so a truncated or
# corrupted file is named rather than silently loaded; a read that the storage fails is
# retried, then named as a storage error, never as damage
# ([Note: storage errors are not damage] in storage.py).
def read(file: Path) -> dict[str, Any]:
    """A checkpoint .pt file, checked. Damaged when its bytes are wrong (they do not
    unpickle, or fail the checksum) or it is missing (Missing); StorageError when the
    storage does not let us read it, after a few attempts ([Note: storage errors are not
    damage] in storage.py). The file is read whole first, so that torch.load parses bytes
    in memory: whatever it raises is about the bytes, never about the storage (a .pt file
    holds an index, counters and RNG states; the data is in the .bin files)."""
    raw = storage.read_bytes(file)
    try:
        data = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        if "weights only load failed" not in str(e).lower():
            raise Damaged(f"{file} is truncated or corrupted: {agree.line(e)}") from None
        # torch's message suggests weights_only=False, which would run that code.
        raise ConfigError(
            f"{file} holds objects other than tensors and plain values; it was not loaded, "
            "for safety (unpickling it could run code)"
        ) from None
    except Exception as e:
        raise Damaged(f"{file} is truncated or corrupted: {agree.line(e)}") from None
    if not isinstance(data, dict) or "checksum" not in data or "format" not in data:
        raise ConfigError(f"{file} is not a checkpoint file of this trainer (format {FORMAT})")
    if data["format"] != FORMAT:
        raise ConfigError(
            f"{file} is of checkpoint format {data['format']}; this trainer reads format "
            f"{FORMAT} only: resume or consolidate it with the version that wrote it"
        )
    stored = data.pop("checksum")
    if checksum(data) != stored:
        raise Damaged(f"{file} is corrupted: its contents do not match their checksum")
    return data


def checksum(obj: Any, crc: int = 0) -> int:
    """CRC32 over a nested structure: tensors by dtype, shape and bytes, the rest by repr."""
    if torch.is_tensor(obj):
        t = obj.detach().cpu().contiguous().reshape(-1)
        crc = zlib.crc32(f"{t.dtype}{tuple(obj.shape)}".encode(), crc)
        return zlib.crc32(t.view(torch.uint8).numpy(), crc)
    if isinstance(obj, dict):
        for k, v in obj.items():
            crc = checksum(v, zlib.crc32(repr(k).encode(), crc))
        return crc
    if isinstance(obj, list | tuple):
        crc = zlib.crc32(f"{type(obj).__name__}{len(obj)}".encode(), crc)
        for v in obj:
            crc = checksum(v, crc)
        return crc
    return zlib.crc32(repr(obj).encode(), crc)
