"""A checkpoint's model written as safetensors, one tensor at a time, straight from the
checkpoint's files: no engine, no optimizer, no process group.

[Note: streamed export]
A safetensors file is a JSON header (per tensor: dtype, shape, byte range) and the bytes
of its tensors. Every shape and dtype is known from the checkpoint's meta and indexes
before a value is read, so the headers of all output shards are decided first and each
tensor is then read from the ranges of the ranks' data files that hold it (recutting.
model_tensors), cast if asked, written, and dropped. Memory: the largest tensor (twice
when cast), whatever the size of the model or of --max-shard-size.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable
from pathlib import Path

import torch

from trainer.checkpoint.recutting import model_entries, model_tensors
from trainer.errors import ConfigError

_CODES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str | int) -> int:
    """Bytes of a size as transformers writes it: 5GB (10^9), 5GiB (2^30), 20KB, 1000."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(text))
    if m is None or m.group(2).upper() not in _UNITS:
        raise ConfigError(f"--max-shard-size {text} is not a size such as 5GB, 500MB or 2GiB")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def write_model(
    checkpoint: Path,
    out: Path,
    rename: Callable[[str], str],
    tied: Callable[[list[str]], list[str]],
    dtype: torch.dtype | None = None,
    max_shard_bytes: int | None = None,
    stem: str = "model",
) -> list[str]:
    """Write the model of `checkpoint` into directory `out` as `stem.safetensors`, or, above
    `max_shard_bytes`, as `stem-00001-of-0000N.safetensors` shards with
    `stem.safetensors.index.json` ([Note: streamed export]). `rename` maps a state_dict key
    to the name written; `tied(keys)` picks which keys of one tied parameter to write;
    `dtype` casts floating tensors. Returns the files written."""
    entries = model_entries(checkpoint)
    by_param: dict[str, list[str]] = {}
    for key, name, _, _ in entries:
        if name is not None:
            by_param.setdefault(name, []).append(key)
    written = {k for keys in by_param.values() for k in tied(keys)}
    written |= {key for key, name, _, _ in entries if name is None}
    plan = []  # (key, name written, dtype, shape, bytes)
    for key, _, saved, shape in entries:
        if key in written:
            cast = dtype if dtype is not None and saved.is_floating_point else saved
            if cast not in _CODES:
                raise ConfigError(f"{key} has dtype {saved}, which safetensors cannot hold")
            plan.append((key, rename(key), cast, shape, math.prod(shape) * cast.itemsize))
    shards: list[list] = [[]]
    size = 0
    for item in plan:
        if shards[-1] and max_shard_bytes is not None and size + item[4] > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += item[4]
    n = len(shards)
    names = [f"{stem}.safetensors"] if n == 1 else []
    names = names or [f"{stem}-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    out.mkdir(parents=True, exist_ok=True)
    tensors = model_tensors(checkpoint, only={item[0] for item in plan})
    for name, shard in zip(names, shards, strict=True):
        _write_file(out / name, shard, tensors)
    if n > 1:
        index = {
            "metadata": {"total_size": sum(item[4] for item in plan)},
            "weight_map": {
                item[1]: name for name, s in zip(names, shards, strict=True) for item in s
            },
        }
        (out / f"{stem}.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        names.append(f"{stem}.safetensors.index.json")
    return names


def _write_file(path: Path, shard: list, tensors) -> None:
    header: dict = {"__metadata__": {"format": "pt"}}
    pos = 0
    for _, name, dtype, shape, nbytes in shard:
        header[name] = {
            "dtype": _CODES[dtype],
            "shape": list(shape),
            "data_offsets": [pos, pos + nbytes],
        }
        pos += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for key, _, dtype, _, _ in shard:
            value = _next(tensors, key)
            value = value.to(dtype).contiguous().reshape(-1)
            if value.numel():
                f.write(memoryview(value.view(torch.uint8).numpy()))
            del value
        f.flush()
        os.fsync(f.fileno())


def _next(tensors, key: str) -> torch.Tensor:
    """The tensor of `key` from the state_dict-ordered stream (skipping keys not written)."""
    for k, value in tensors:
        if k == key:
            return value
    raise AssertionError(f"{key} not in the checkpoint's keys")
