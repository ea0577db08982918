"""Saved weights read slice by slice, so that a rank reads only the elements it keeps.

`WeightFiles(directory)` opens a safetensors checkpoint: `model.safetensors`, or the
shards that `model.safetensors.index.json` maps keys to (what `save_pretrained` and
scripts/export_hf.py write). `Pretrained(directory)` is the `Source` (trainer/models/materialize.py)
that fills a model built on the meta device from them, checking first that the files'
keys and shapes are the model's.

Only safetensors is read. Its header gives each tensor's dtype, shape and byte offsets,
and `safe_open` maps the file, so a range of rows is read without the rest of the
tensor. `pytorch_model.bin` and our `final_model.pt` are pickles written by torch.save:
legacy ones load whole, and even a zip-format one gives no promise of reading a part of a
tensor without the rest. Rather than a second path that holds the whole model on some
ranks, they are refused with the one command that converts them (`save_pretrained`, or
scripts/export_hf.py for a run), done once.
"""

from __future__ import annotations

import json
import math
import re
import sys
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from trainer.errors import ConfigError
from trainer.models.materialize import Request, Source, check_requests, param_owners, qualified

SAFETENSORS = "model.safetensors"
INDEX = "model.safetensors.index.json"
PICKLES = ("pytorch_model.bin", "pytorch_model.bin.index.json", "final_model.pt")
SHOWN = 5  # keys named in a message; the rest are counted


class WeightFiles:
    """The tensors of a safetensors checkpoint in `directory`, read by ranges of their
    flattened elements. Keeps the files open (mapped) until close()."""

    def __init__(self, directory: str | Path) -> None:
        from safetensors import safe_open

        self.directory = Path(directory).expanduser()
        if not self.directory.is_dir():
            raise ConfigError(f"weights directory {directory} is not a directory")
        weight_map = _weight_map(self.directory)
        files = sorted(set(weight_map.values())) if weight_map else [SAFETENSORS]
        self._handles = {f: safe_open(str(self.directory / f), framework="pt") for f in files}
        self.elements_read = 0  # from the files so far: a slice's covering rows, no more
        # key -> its file: the index's map, else every key of the one file.
        self._where = weight_map or {k: SAFETENSORS for k in self._handles[SAFETENSORS].keys()}
        for key, f in self._where.items():
            if key not in self._handles[f].keys():
                raise ConfigError(f"{self.directory / INDEX} maps {key} to {f}, which lacks it")

    def keys(self) -> list[str]:
        return list(self._where)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._slice(key).get_shape())

    def read(self, key: str, start: int = 0, stop: int | None = None) -> Tensor:
        """Elements [start, stop) of the tensor's flattened values, 1-D, in the file's
        dtype. Only the rows (first-dimension indices) covering the range are read."""
        sl = self._slice(key)
        shape = sl.get_shape()
        numel = math.prod(shape)
        stop = numel if stop is None else stop
        if not 0 <= start <= stop <= numel:
            raise ValueError(f"{key}: range [{start}, {stop}) outside its {numel} elements")
        if not shape:  # a 0-dim tensor: one element
            self.elements_read += 1
            return self._handles[self._where[key]].get_tensor(key).reshape(-1)[start:stop]
        row = math.prod(shape[1:])
        if row == 0 or start == stop:
            return sl[0:0].reshape(-1)
        first, end = start // row, -(-stop // row)
        self.elements_read += (end - first) * row
        return sl[first:end].reshape(-1)[start - first * row : stop - first * row]

    def _slice(self, key: str) -> Any:
        if key not in self._where:
            raise KeyError(f"{key} is not in the weights of {self.directory}")
        return self._handles[self._where[key]].get_slice(key)

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self) -> WeightFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _weight_map(directory: Path) -> dict[str, str] | None:
    """The index's {key: file}; None: a single model.safetensors holds every key."""
    if (directory / INDEX).is_file():
        try:
            weight_map = json.loads((directory / INDEX).read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"{directory / INDEX} has no readable weight_map: {e}") from None
        for f in sorted(set(weight_map.values())):
            if not (directory / f).is_file():
                raise ConfigError(f"{directory / INDEX} names {f}, which is not in {directory}")
        return weight_map
    if (directory / SAFETENSORS).is_file():
        return None
    for name in PICKLES:
        if (directory / name).is_file():
            how = (
                f"write model.safetensors with `python scripts/export_hf.py {directory} OUT`"
                if name == "final_model.pt"
                else "convert it once: AutoModelForCausalLM.from_pretrained(DIR)"
                ".save_pretrained(OUT) writes safetensors"
            )
            raise ConfigError(
                f"{directory / name} is a pickle that cannot be read slice by slice; {how}, "
                "and load from OUT"
            )
    raise ConfigError(
        f"no weights in {directory}: looked for {SAFETENSORS} and {INDEX}"
        " (pytorch_model.bin and final_model.pt are not read: convert them to safetensors)"
    )


# --------------------------------------------------------------------------------------
# Pretrained: the Source


class Pretrained(Source):
    """Values from the safetensors checkpoint in `path`, slice by slice.

    `prefix`: what the model's names have in front of the files' keys; None: "hf." for a
    CausalLM (its Hugging Face model is `self.hf`, and save_pretrained writes that
    model's keys), "" otherwise (our own models: scripts/export_hf.py writes the module's
    keys). A tied parameter is read once, from whichever of its names the files hold
    (save_pretrained keeps one of a tied pair). Keys Hugging Face lets a checkpoint lack
    (`_keys_to_ignore_on_load_missing`) take their values from `init` (e.g.
    SeededInit(seed)); without one they are refused like any other missing key.

    Persistent buffers come from the files; non-persistent ones are not saved, so they
    must be real already (build under empty_weights()): a meta one is refused."""

    def __init__(
        self, path: str | Path, prefix: str | None = None, init: Source | None = None
    ) -> None:
        self.files = WeightFiles(path)
        self.prefix = prefix
        self.init = init
        self._planned: tuple[weakref.ref, dict[str, str | None]] | None = None

    def check(self, root: nn.Module) -> dict[str, str | None]:
        """Refuse a model whose parameters and persistent buffers do not match the files
        (missing or unexpected keys, other shapes), in one line. Returns the model's
        canonical names (parameters as root.named_parameters() names them, persistent
        buffers) -> the file key holding their values (None: left to `init`)."""
        if self._planned is not None and self._planned[0]() is root:
            return self._planned[1]
        plan = _plan(root, self.files, self._prefix(root), self.init is not None)
        self._planned = (weakref.ref(root), plan)
        return plan

    def fill(
        self,
        root: nn.Module,
        modules: Sequence[tuple[str, nn.Module]],
        requests: Sequence[Request],
        device: torch.device | str,
    ) -> None:
        device = torch.device(device)
        check_requests(requests)
        plan = self.check(root)
        later: list[Request] = []
        for r in requests:
            key = plan[r.name]
            if key is None:
                later.append(r)
            else:
                r.out.copy_(self.files.read(key, r.start, r.stop))
        later_modules = []
        for mod_name, module in modules:
            for b, t in list(module._buffers.items()):
                if t is None:
                    continue
                name = qualified(mod_name, b)
                if b in module._non_persistent_buffers_set:
                    if t.is_meta:
                        raise ConfigError(
                            f"buffer {name} is on the meta device and is not saved "
                            "(non-persistent), so no weights file has it: build the model under "
                            "trainer.models.materialize.empty_weights(), which keeps buffers real"
                        )
                    continue
                key = plan[name]
                if key is None:
                    if t.is_meta:
                        later_modules.append((mod_name, module))
                    continue
                value = self.files.read(key).view(t.shape)
                if t.is_meta:
                    module._buffers[b] = value.to(device=device, dtype=t.dtype)
                else:
                    with torch.no_grad():
                        t.copy_(value)
        if later or later_modules:
            assert self.init is not None  # check() refused them otherwise
            self.init.fill(root, later_modules, later, device)

    def _prefix(self, root: nn.Module) -> str:
        if self.prefix is not None:
            return self.prefix
        from trainer.models.lm import CausalLM

        return "hf." if isinstance(root, CausalLM) else ""


def _plan(
    root: nn.Module, files: WeightFiles, prefix: str, has_init: bool
) -> dict[str, str | None]:
    """The model's canonical names -> file key (see Pretrained.check), or a ConfigError."""
    hf = _hf_model(root, prefix)
    # Regular expressions, searched in the files' keys, as from_pretrained does.
    missing_ok = list(getattr(hf, "_keys_to_ignore_on_load_missing", None) or [])
    unexpected_ok = list(getattr(hf, "_keys_to_ignore_on_load_unexpected", None) or [])
    if hf is not None:
        # Keys of older checkpoints that transformers 5 ignores when the model keeps the
        # buffer non-persistent (from_pretrained's _adjust_missing_and_unexpected_keys).
        buffers = [n for n, _ in hf.named_buffers()]
        if any(n.endswith("rotary_emb.inv_freq") for n in buffers):
            unexpected_ok.append(r"rotary_emb\.inv_freq")
        if any(n.endswith("position_ids") for n in buffers):
            unexpected_ok.append(r"(^|\.)position_ids$")
    ignore_missing, ignore_unexpected = _patterns(missing_ok), _patterns(unexpected_ok)
    partners: dict[str, set[str]] = {}
    for target, source in (getattr(hf, "all_tied_weights_keys", None) or {}).items():
        partners.setdefault(target, set()).add(source)
        partners.setdefault(source, set()).add(target)

    def key(name: str) -> str | None:
        return name[len(prefix) :] if name.startswith(prefix) else None

    # Each parameter once, with every name it is reachable by; then persistent buffers.
    owners = param_owners(root)
    aliases: dict[int, list[str]] = {}
    for name, p in root.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    entries: list[tuple[str, tuple[int, ...], list[str]]] = []
    for name, p in root.named_parameters():
        assert qualified(*owners[id(p)]) == name
        entries.append((name, tuple(p.shape), aliases[id(p)]))
    for mod_name, module in root.named_modules():
        for b, t in module._buffers.items():
            if t is not None and b not in module._non_persistent_buffers_set:
                entries.append((qualified(mod_name, b), tuple(t.shape), [qualified(mod_name, b)]))

    in_files = set(files.keys())
    plan: dict[str, str | None] = {}
    used: set[str] = set()
    missing, mismatched, allowed = [], [], 0
    for name, shape, names in entries:
        candidates = [k for n in names if (k := key(n)) is not None]
        candidates += sorted(set().union(*(partners.get(k, set()) for k in candidates)))
        present = [k for k in candidates if k in in_files]
        used.update(present)
        if present:
            plan[name] = present[0]
            if files.shape(present[0]) != shape:
                mismatched.append(f"{present[0]} (file {files.shape(present[0])}, model {shape})")
        elif candidates and ignore_missing and all(ignore_missing.search(k) for k in candidates):
            if has_init:
                plan[name] = None
                continue
            missing.append(candidates[0])
            allowed += 1
        else:
            missing.append(candidates[0] if candidates else name)
    unexpected = sorted(
        k for k in in_files - used if not (ignore_unexpected and ignore_unexpected.search(k))
    )
    problems = []
    if missing:
        problems.append(f"missing {_few(missing)}")
        if allowed:
            problems.append(
                f"transformers lets {allowed} of them be missing: "
                "Pretrained(..., init=SeededInit(seed)) initialises those"
            )
    if unexpected:
        problems.append(f"unexpected (not in the model) {_few(unexpected)}")
    if problems:
        raise ConfigError(
            f"the weights in {files.directory} do not fit the model: {'; '.join(problems)}"
            + (f" (file keys are the model's names without {prefix!r})" if prefix else "")
        )
    if mismatched:
        raise ConfigError(
            f"the weights in {files.directory} have other shapes than the model: {_few(mismatched)}"
        )
    return plan


def _hf_model(root: nn.Module, prefix: str) -> nn.Module | None:
    """The Hugging Face PreTrainedModel whose keys the files hold, if there is one."""
    transformers = sys.modules.get("transformers")
    if transformers is None:
        return None
    try:
        model = root.get_submodule(prefix.rstrip(".")) if prefix else root
    except AttributeError:
        return None
    return model if isinstance(model, transformers.PreTrainedModel) else None


def _patterns(patterns: list[str]) -> re.Pattern | None:
    patterns = [p for p in patterns if p]
    return re.compile("|".join(f"({p})" for p in patterns)) if patterns else None


def _few(keys: list[str]) -> str:
    shown = ", ".join(keys[:SHOWN])
    more = f" and {len(keys) - SHOWN} more" if len(keys) > SHOWN else ""
    return f"{len(keys)} key{'s' if len(keys) != 1 else ''}: {shown}{more}"
