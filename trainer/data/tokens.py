"""Token files on disk, read through `np.memmap` (never whole), cut into training windows.

Formats, told apart per file (`data.format=auto`) or named (`raw`, `llmc`, `npy`):

- raw: headerless token ids, as `scripts/prepare_text.py` and nanoGPT write `train.bin` and
  `val.bin`. The dtype comes from `data.dtype`, else the directory's `meta.json`, else
  uint16 (nanoGPT's). The vocabulary size from `data.vocab_size`, `meta.json`, nanoGPT's
  `meta.pkl` (read without unpickling objects), else the largest id + 1.
- llmc: llm.c's shards: 256 int32 of header (magic, version, token count), then the
  tokens, uint16 for magic 20240520 and uint32 for 20240801. The count is checked against
  the file's size. `auto` takes a file whose first int32 is one of these magics as llm.c:
  read as headerless it would train on its header.
- npy: a 1-D integer `.npy` array (build-nanogpt's shards).

Several files (`data.path` as a glob) read as one stream, in sorted order. With
`doc_mask`, each file's document starts are read from `X.docs.npy` beside it and every
window comes with its documents ([Note: document starts]).
"""

from __future__ import annotations

import glob
import hashlib
import json
import pickle
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler

from trainer.data.text import read_tokenizer_file
from trainer.errors import ConfigError, NotResumable
from trainer.models.loss import IGNORE_INDEX

LLMC_MAGIC = {20240520: np.uint16, 20240801: np.uint32}  # llm.c's header magic -> token dtype
LLMC_HEADER = 256  # int32 values before the tokens
FORMATS = ("auto", "raw", "llmc", "npy")
DTYPES = ("uint16", "uint32")
TOKENIZERS = ("char", "bytes", "hf")  # what scripts/prepare_text.py writes
# [Note: what the data is]
# The position means something only on the same token stream, so the sampler's state
# holds what the training data is: its token count and a fingerprint, a hash of the ids
# of SAMPLE_PIECES pieces spread evenly over the stream (a few KB read, whatever the
# size). A resume refuses a stream whose count or fingerprint differs, whatever the
# config says. The paths are kept to name the data, not compared: the same tokens
# elsewhere (data moved to another disk, a copy per node, uint16 rewritten as uint32, the
# shards cut otherwise) draw the same windows, so they resume. An edit that no piece
# touches is not seen; other data is.
SAMPLE_PIECES, SAMPLE_TOKENS = 64, 64  # what the fingerprint reads ([Note: what the data is])
DOCS_SUFFIX = ".docs.npy"  # X.bin's document starts: X.docs.npy ([Note: document starts])
# [Note: document starts]
# Beside each token file X.bin (X.npy, ...) `scripts/prepare_text.py` writes X.docs.npy: a
# 1-D integer array, strictly ascending, of the offsets within that file's tokens (an
# llm.c header not counted) of the first token of every document that starts in the
# file; a document continued from the previous file has no entry at 0. The separator
# (an end-of-text token) is the last token of the document before a start. With
# `doc_mask=true` every window of T + 1 tokens yields, besides (inputs, targets):
#   segments (T,) int64: the document of each input position within the window, 0 for
#     the piece begun before the window (or at its first token), +1 at each later start;
#   targets set to IGNORE_INDEX (-100) where the target token starts a document, so no
#     position learns to guess the next document's first token from the last one
#     ([Note: what the loss is averaged over] in trainer/models/loss.py).
# The model keeps the documents apart ([Note: documents kept apart] in
# trainer/models/builtin.py). The arrays are read through mmap, checked whole once (a
# chunk at a time) when the data is opened; a window reads the few entries it spans.


def open_tokens(path: Path, fmt: str = "auto", dtype: str | None = None) -> np.ndarray:
    """The token ids of one file as a read-only 1-D memmap (nothing is read yet)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"token file {path} does not exist")
    if path.stat().st_size == 0:
        raise ConfigError(f"token file {path} is empty")
    if fmt == "npy" or (fmt == "auto" and path.suffix == ".npy"):
        try:
            tokens = np.load(path, mmap_mode="r", allow_pickle=False)
        except ValueError as e:
            raise ConfigError(f"token file {path} is not a .npy array: {e}") from None
        if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
            raise ConfigError(
                f"token file {path} holds a {tokens.dtype} array of shape {tokens.shape}; "
                "a 1-D integer array is needed"
            )
        return tokens
    magic = int(np.fromfile(path, dtype=np.int32, count=1)[0]) if path.stat().st_size >= 4 else 0
    if fmt == "llmc" or (fmt == "auto" and magic in LLMC_MAGIC):
        return _llmc(path, magic, dtype)
    return _raw(path, dtype or "uint16")


def _llmc(path: Path, magic: int, dtype: str | None) -> np.ndarray:
    if magic not in LLMC_MAGIC:
        raise ConfigError(
            f"{path} is not an llm.c shard: magic {magic}, expected one of "
            f"{', '.join(map(str, LLMC_MAGIC))}"
        )
    header = np.fromfile(path, dtype=np.int32, count=LLMC_HEADER)
    token_dtype = np.dtype(LLMC_MAGIC[magic])
    if dtype is not None and np.dtype(dtype) != token_dtype:
        raise ConfigError(
            f"data.dtype={dtype} does not match llm.c shard {path}: its magic {magic} "
            f"means {token_dtype}"
        )
    count, held = int(header[2]), (path.stat().st_size - 4 * LLMC_HEADER) // token_dtype.itemsize
    if count <= 0 or count != held:
        raise ConfigError(
            f"llm.c shard {path}: its header says {count} tokens but the file holds {held}"
        )
    return np.memmap(path, dtype=token_dtype, mode="r", offset=4 * LLMC_HEADER, shape=(count,))


def _raw(path: Path, dtype: str) -> np.ndarray:
    if dtype not in DTYPES:
        raise ConfigError(f"data.dtype={dtype} is not one of {', '.join(DTYPES)}")
    size, item = path.stat().st_size, np.dtype(dtype).itemsize
    if size % item:
        raise ConfigError(
            f"token file {path} has {size} bytes, not a whole number of {dtype} tokens; "
            "is data.dtype (or meta.json's dtype) right?"
        )
    return np.memmap(path, dtype=dtype, mode="r")


def read_meta(directory: Path) -> dict[str, Any]:
    """`meta.json` (ours) or nanoGPT's `meta.pkl` in `directory`, else {}. The fields read
    from it (vocab_size, dtype, tokenizer, chars) are checked here: a wrong one is one line
    naming the file, never a number taken silently."""
    directory = Path(directory)
    if (directory / "meta.json").is_file():
        path = directory / "meta.json"
        try:
            meta = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            if isinstance(e, json.JSONDecodeError):
                why = f"{e.msg} at line {e.lineno} column {e.colno}"
            else:
                why = f"not UTF-8 at byte {e.start}"
            raise ConfigError(
                f"{path} is not JSON ({why}); it should be "
                "an object as scripts/prepare_text.py writes it, e.g. "
                '{"vocab_size": 65, "dtype": "uint16"}, or be removed'
            ) from None
    elif (directory / "meta.pkl").is_file():
        path = directory / "meta.pkl"
        with open(path, "rb") as f:
            try:
                meta = _PlainUnpickler(f).load()
            except pickle.UnpicklingError as e:
                raise ConfigError(f"{path}: {e}") from None
            except (EOFError, ValueError, IndexError, TypeError, AttributeError) as e:
                raise ConfigError(f"{path} is not a readable pickle ({e}); remove it") from None
        if not isinstance(meta, dict):
            return {}
    else:
        return {}
    check_meta(meta, path)
    return meta


def check_meta(meta: Any, path: Path) -> None:
    """The fields of a meta file that reading depends on have the types and values the
    reader can use; other keys are left alone."""
    if not isinstance(meta, dict):
        raise ConfigError(
            f"{path} holds a JSON {type(meta).__name__}, not an object; it should be an object "
            'as scripts/prepare_text.py writes it, e.g. {"vocab_size": 65, "dtype": "uint16"}'
        )
    vocab, dtype = meta.get("vocab_size"), meta.get("dtype")
    if vocab is not None and (isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1):
        raise ConfigError(f"{path}: vocab_size {vocab!r} must be a whole number >= 1")
    if dtype is not None and dtype not in DTYPES:
        raise ConfigError(f"{path}: dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if vocab is not None and vocab > 1 << 16 and (dtype or "uint16") == "uint16":
        raise ConfigError(
            f"{path}: vocab_size {vocab} does not fit dtype uint16 (ids up to 65535"
            f'{"" if dtype else ", the default"}); the token files need "dtype": "uint32"'
        )
    kind = meta.get("tokenizer")
    if kind is not None and kind not in TOKENIZERS:
        raise ConfigError(f"{path}: tokenizer {kind!r} is not one of {', '.join(TOKENIZERS)}")
    if kind == "char":
        chars = meta.get("chars")
        if not isinstance(chars, str) or not chars:
            raise ConfigError(
                f'{path}: tokenizer "char" needs "chars", the characters of the '
                "vocabulary in id order as one string"
            )
        if len(set(chars)) != len(chars) or list(chars) != sorted(chars):
            raise ConfigError(
                f"{path}: chars must be distinct characters in sorted order (id i is the "
                "i-th), as scripts/prepare_text.py writes them"
            )


class _PlainUnpickler(pickle.Unpickler):
    """Dicts, lists, strings and numbers only: no class is ever imported or called."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"holds an object of {module}.{name}; only plain data is read")


def open_docs(token_file: Path, count: int, chunk: int = 1 << 22) -> np.ndarray:
    """The document starts of `token_file` (which holds `count` tokens), from its
    X.docs.npy as a read-only memmap, checked ([Note: document starts])."""
    path = token_file.with_suffix(DOCS_SUFFIX)
    if not path.is_file():
        raise ConfigError(
            f"data.doc_mask=true: {path}, the document starts of {token_file.name}, does not "
            "exist; re-prepare the data with scripts/prepare_text.py, or set data.doc_mask=false"
        )
    try:
        docs = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise ConfigError(f"{path} is not a .npy array: {e}") from None
    if docs.ndim != 1 or docs.dtype.kind not in "iu":
        raise ConfigError(
            f"{path} holds a {docs.dtype} array of shape {docs.shape}; the document starts "
            "are a 1-D integer array; re-prepare the data with scripts/prepare_text.py"
        )
    for lo in range(0, len(docs), chunk):
        piece = docs[max(lo - 1, 0) : lo + chunk].astype(np.int64)  # one entry of overlap
        if (outside := (piece < 0) | (piece >= count)).any():
            i = max(lo - 1, 0) + int(outside.argmax())
            raise ConfigError(
                f"{path}: offset {int(docs[i])} at index {i} is outside {token_file.name}'s "
                f"{count} tokens (0..{count - 1}); re-prepare the data with "
                "scripts/prepare_text.py"
            )
        if (back := np.diff(piece) <= 0).any():
            i = max(lo - 1, 0) + int(back.argmax()) + 1
            raise ConfigError(
                f"{path}: offset {int(docs[i])} at index {i} follows {int(docs[i - 1])}; the "
                "document starts must be strictly ascending; re-prepare the data with "
                "scripts/prepare_text.py"
            )
    return docs


def max_token(arrays: list[np.ndarray], chunk: int = 1 << 24) -> int:
    """The largest id over every array, read a chunk at a time."""
    return max(int(a[i : i + chunk].max()) for a in arrays for i in range(0, len(a), chunk))


class TokenData(Dataset):
    """Windows of `block_size + 1` tokens of a token stream, as (inputs, targets), each of
    shape (T,), int64; with `doc_mask`, (inputs, targets, segments), the targets that
    start a document ignored ([Note: document starts]). Training item i starts at token i
    (the sampler picks the starts, [Note: windows drawn from the step]); evaluation item
    i at token i * (T + 1).

    `dir`: a directory with train.bin / val.bin (and meta.json or meta.pkl); or `path`: a
    file or a glob of shards for training and `val_path` for evaluation. `block_size`
    None: the model's, set by the trainer (trainer/models/build.py) before the first item.
    """

    def __init__(
        self,
        dir: str | None = None,
        path: str | None = None,
        val_path: str | None = None,
        block_size: int | None = None,
        vocab_size: int | None = None,
        dtype: str | None = None,
        format: str = "auto",
        doc_mask: bool = False,
        train: bool = True,
    ) -> None:
        if not isinstance(doc_mask, bool):
            raise ConfigError(f"data.doc_mask={doc_mask!r} must be true or false")
        if format not in FORMATS:
            raise ConfigError(f"data.format={format} is not one of {', '.join(FORMATS)}")
        if block_size is not None and (not isinstance(block_size, int) or block_size < 1):
            raise ConfigError(f"data.block_size={block_size!r} must be a whole number >= 1")
        files, self.meta = _files(dir, path, val_path, train)
        tokenizer_file = files[0].parent / "tokenizer.json"
        if train and self.meta.get("tokenizer") == "hf" and tokenizer_file.is_file():
            # The run's samples decode with it (rank 0): every rank refuses a broken one here.
            read_tokenizer_file(tokenizer_file)
        meta_dtype = self.meta.get("dtype")
        if dtype is not None and meta_dtype is not None and dtype != meta_dtype:
            raise ConfigError(
                f"data.dtype={dtype} does not match {self.meta['source']}'s dtype {meta_dtype}"
            )
        self.files = files
        if named := [f.name for f in files if f.name.endswith(DOCS_SUFFIX)]:
            raise ConfigError(  # X.docs.npy read as tokens would train on offsets
                f"{named[0]} holds document starts, not tokens, yet the token files include "
                f"it ({len(named)} such); give data.path a glob that matches the token "
                "files only (e.g. 'shard_*[0-9].npy')"
            )
        self.arrays = [open_tokens(f, format, dtype or meta_dtype) for f in files]
        # each file's document starts ([Note: document starts]); None: not read
        self.docs = None
        if doc_mask:
            self.docs = [open_docs(f, len(a)) for f, a in zip(files, self.arrays, strict=True)]
        self.ends = np.cumsum([len(a) for a in self.arrays])  # (files,) token counts, summed
        self.train = train
        self.block_size = block_size
        given = vocab_size or self.meta.get("vocab_size")
        self.vocab_size = int(given) if given else None  # None: the largest id + 1 (max_token)
        self._max: int | None = None

    @property
    def tokens(self) -> int:
        return int(self.ends[-1])

    def max_token(self) -> int:
        """The largest id in the files (read once, a chunk at a time)."""
        if self._max is None:
            self._max = max_token(self.arrays)
        return self._max

    def data_vocab_size(self) -> int:
        return self.vocab_size if self.vocab_size is not None else self.max_token() + 1

    def _window(self) -> int:
        if self.block_size is None:
            raise ConfigError("data.block_size is not set and no model gave one")
        if self.tokens < self.block_size + 1:
            raise ConfigError(
                f"{self._name()} holds {self.tokens} tokens, fewer than one window of "
                f"data.block_size + 1 = {self.block_size + 1}; lower data.block_size "
                "(or model.block_size)"
            )
        return self.block_size + 1

    def _name(self) -> str:
        return str(self.files[0]) if len(self.files) == 1 else f"{len(self.files)} token files"

    def __len__(self) -> int:
        w = self._window()
        return self.tokens - w + 1 if self.train else self.tokens // w

    def __getitem__(self, i: int) -> tuple[torch.Tensor, ...]:
        w = self._window()
        start = i if self.train else i * w
        seq = torch.from_numpy(self.read(start, w).astype(np.int64))  # (T+1,)
        if self.docs is None:
            return seq[:-1], seq[1:]
        # [Note: document starts]: starts at window offsets 1..T (one at 0 changes nothing)
        starts = torch.zeros(w, dtype=torch.bool)  # (T+1,)
        starts[torch.from_numpy(self.doc_starts(start + 1, w - 1) - start)] = True
        segments = starts[:-1].cumsum(0)  # (T,) int64: starts at offsets 1..t
        targets = seq[1:].masked_fill(starts[1:], IGNORE_INDEX)  # (T,)
        return seq[:-1], targets, segments

    def doc_starts(self, start: int, n: int) -> np.ndarray:
        """The stream offsets of the documents that start in tokens [start, start + n),
        ascending, int64, across file boundaries (`doc_mask` only)."""
        out, f = [], int(np.searchsorted(self.ends, start, side="right"))
        while n > 0:
            base = int(self.ends[f - 1]) if f else 0
            lo, hi = start - base, min(start - base + n, len(self.arrays[f]))
            docs = self.docs[f]
            a, b = np.searchsorted(docs, lo), np.searchsorted(docs, hi)
            out.append(np.asarray(docs[a:b], dtype=np.int64) + base)
            start, n, f = start + hi - lo, n - (hi - lo), f + 1
        return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)

    def read(self, start: int, n: int) -> np.ndarray:
        """Tokens [start, start + n) of the stream, across file boundaries."""
        out, f = [], int(np.searchsorted(self.ends, start, side="right"))
        while n > 0:
            lo = start - (int(self.ends[f - 1]) if f else 0)
            piece = self.arrays[f][lo : lo + n]
            out.append(piece)
            start, n, f = start + len(piece), n - len(piece), f + 1
        return np.concatenate(out) if len(out) > 1 else np.asarray(out[0])

    def batch_sampler(
        self, global_batch: int, rank: int, world_size: int, seed: int
    ) -> WindowSampler:
        window = self._window()
        sampler = WindowSampler(self.tokens, window, global_batch, rank, world_size, seed)
        sampler.data = self.identity()
        return sampler

    def identity(self) -> dict[str, Any]:
        """What the token stream is ([Note: what the data is]): its files (resolved), its
        token count and the fingerprint of its ids."""
        n = min(SAMPLE_TOKENS, self.tokens)
        starts = np.linspace(0, self.tokens - n, SAMPLE_PIECES).astype(np.int64)  # (pieces,)
        digest = hashlib.sha256()
        for start in np.unique(starts):
            digest.update(self.read(int(start), n).astype("<i8").tobytes())  # the ids, any dtype
        return {
            "files": [str(f.resolve()) for f in self.files],
            "tokens": self.tokens,
            "fingerprint": digest.hexdigest()[:16],
        }


def _files(
    dir: str | None, path: str | None, val_path: str | None, train: bool
) -> tuple[list[Path], dict[str, Any]]:
    """The files to read, and the metadata beside them."""
    if (dir is None) == (path is None):
        raise ConfigError("data=token_file needs one of data.dir=DIR or data.path=FILE_OR_GLOB")
    if dir is not None:
        root = Path(dir).expanduser()
        if not root.is_dir():
            raise ConfigError(f"data.dir={dir} is not a directory")
        files = _split_files(root, "train" if train else "val", dir)
    else:
        pattern = path if train else val_path
        key = "data.path" if train else "data.val_path"
        if pattern is None:
            raise ConfigError(
                "no held-out tokens: set data.val_path=FILE_OR_GLOB, or train.eval_every=0"
            )
        files = [Path(p) for p in sorted(glob.glob(str(Path(pattern).expanduser())))]
        if not files:
            missing = "matches no file" if glob.has_magic(pattern) else "does not exist"
            raise ConfigError(f"{key}={pattern} {missing}")
        root = files[0].parent
    meta = read_meta(root)
    meta["source"] = str(root / ("meta.json" if (root / "meta.json").is_file() else "meta.pkl"))
    return files, meta


def _split_files(root: Path, split: str, given: str) -> list[Path]:
    """A directory's files of one split: `train.bin` (one file), or the shards
    `train_000000.bin`, `train_000001.bin`, ... that `scripts/prepare_text.py --shard-tokens`
    writes, in order."""
    whole, shards = root / f"{split}.bin", sorted(root.glob(f"{split}_[0-9]*.bin"))
    if whole.is_file() and shards:
        raise ConfigError(
            f"data.dir={given} holds both {whole.name} and {len(shards)} {split}_*.bin shards; "
            "keep one of them (each is the whole split)"
        )
    if not whole.is_file() and not shards:
        hint = "" if split == "train" else "; set train.eval_every=0 to train without evaluation"
        raise ConfigError(f"data.dir={given} has no {split}.bin or {split}_*.bin shards{hint}")
    return [whole] if whole.is_file() else shards


# [Note: windows drawn from the step]
# Training step s takes `global_batch` windows of block_size + 1 tokens (inputs, then the
# targets one token on), drawn from `np.random.default_rng([seed, s])` alone: a random
# shift, then distinct windows of the grid that starts there, so the windows of one step
# share no token. Rank r takes windows [r*b, (r+1)*b) of the step, b = global_batch / P:
# the ranks' parts are disjoint, and their concatenation is the batch one process draws.
# Nothing depends on what came before, so the position is the step and nothing else: a
# resumed run (in any world size) continues bitwise. Evaluation reads the held-out tokens
# as consecutive windows, in order.
class WindowSampler(Sampler[list[int]]):
    """This rank's window starts for each step, forever ([Note: windows drawn from the
    step]). The position (`step`: the next global batch) is all its state."""

    def __init__(
        self, tokens: int, window: int, global_batch: int, rank: int, world_size: int, seed: int
    ) -> None:
        if global_batch % world_size:
            raise ConfigError(
                f"global batch {global_batch} is not divisible by world size {world_size}"
            )
        fewest = (tokens - window + 1) // window  # windows of the grid at the largest shift
        if fewest < global_batch:
            raise ConfigError(
                f"the token data holds {tokens} tokens: {fewest} windows of {window}, fewer "
                f"than train.batch_size={global_batch}; lower train.batch_size or data.block_size"
            )
        self.tokens, self.window, self.global_batch = tokens, window, global_batch
        self.rank, self.local = rank, global_batch // world_size
        self.seed = seed
        self.step = 0
        self.data: dict[str, Any] | None = None  # what TokenData.identity() says

    def starts(self, step: int) -> np.ndarray:
        """The first token of each window of global batch `step`: (global_batch,)."""
        rng = np.random.default_rng([self.seed, step])
        shift = int(rng.integers(self.window))
        grid = (self.tokens - shift) // self.window
        return shift + self.window * rng.choice(grid, size=self.global_batch, replace=False)

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            step, self.step = self.step, self.step + 1  # the position names the next batch
            yield self.starts(step)[self.rank * self.local : (self.rank + 1) * self.local].tolist()

    def batch_of(self, position: int, ranks: Sequence[int]) -> list[int]:
        """The window starts that `ranks` take of global batch `position`, concatenated in
        the order given ([Note: constant global batch] in comm/replicas.py)."""
        starts, n = self.starts(position), self.local
        return [int(s) for r in ranks for s in starts[r * n : (r + 1) * n]]

    def seek(self, batches_done: int) -> None:
        self.step = batches_done

    def state_dict(self) -> dict[str, int]:
        return {
            "step": self.step,
            "seed": self.seed,
            "global_batch": self.global_batch,
            "tokens": self.tokens,
            "window": self.window,
            **({} if self.data is None else {"data": self.data}),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue at `state`'s position; refuses (NotResumable) another token stream
        ([Note: what the data is]) or another cutting of it into batches."""
        if "shares" in state:  # a MixSampler's (trainer/data/mix.py): several streams
            here = _files_named(self.data) if self.data else f"{self.tokens:,} tokens"
            raise NotResumable(
                f"the checkpoint was trained on a data.mix of {len(state['shares'])} token "
                f"directories, not on the token data {here}: the data order would not "
                "continue; resume with that data.mix, or start a fresh run in a new "
                "hydra.run.dir (without resume)"
            )
        theirs, mine = state.get("data"), self.data
        content = ("tokens", "fingerprint")  # not the files: [Note: what the data is]
        if theirs is not None and mine is not None:  # (a state saved before: no data)
            if any(theirs[k] != mine[k] for k in content):
                raise NotResumable(
                    f"the token data {_files_named(mine)} is not the data the checkpoint "
                    f"was trained on, {_files_named(theirs)}: the data order would not "
                    "continue; resume with data.dir or data.path naming that data, or start "
                    "a fresh run in a new hydra.run.dir (without resume)"
                )
        for key in ("seed", "global_batch", "tokens", "window"):
            if state.get(key) != getattr(self, key):
                raise NotResumable(
                    f"sampler state has {key}={state.get(key)} but this run has "
                    f"{key}={getattr(self, key)}; the data position cannot be resumed"
                )
        self.step = int(state["step"])


def _files_named(data: dict[str, Any]) -> str:
    """`data`'s files, count and fingerprint in a few words: '/d/train.bin (1,024 tokens,
    fingerprint 3f2a...)'."""
    files = data["files"]
    where = files[0] if len(files) == 1 else f"{files[0]} and {len(files) - 1} more files"
    return f"{where} ({data['tokens']:,} tokens, fingerprint {data['fingerprint']})"
