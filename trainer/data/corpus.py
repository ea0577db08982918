"""Corpora for `scripts/prepare_text.py`: the records of parquet and JSON lines files and of
local Hugging Face dataset directories, tokenized in worker processes and written as
token files with their document boundaries.

- `resolve(inputs)`: what the command line names (files, globs, directories) as a `Corpus`:
  text files, record files (.parquet, .jsonl, .jsonl.gz, .jsonl.zst), a directory
  written by `save_to_disk`, or a dataset repository directory (its files for `--split`,
  as `datasets` finds them, README configurations included).
- `records(corpus, field)`: the text of every record, in corpus order, streamed by the
  `datasets` library one file and one batch at a time (never the corpus whole). A missing
  field, a value that is not a string, a file that does not read is one line (ConfigError).
- `encode_in_order(items, codec, workers)`: token ids of chunks of documents, computed in
  `workers` processes, handed back in the order given ([Note: corpus order, bounded]).
- `SplitWriter`: one split's token files: `train.bin` (headerless), or llm.c shards
  `train_000000.bin`, ... of at most `shard_tokens` tokens; beside each, `X.docs.npy`
  ([Note: document boundaries]).

Nothing is downloaded: the library is told it is offline, and its cache (lock files of a
streaming read) goes to a temporary directory.
"""

from __future__ import annotations

import contextlib
import gc
import glob
import logging
import math
import multiprocessing
import os
import sys
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from trainer.data.text import HF, Bytes, Chars, Codec
from trainer.errors import ConfigError

T = TypeVar("T")
READ_BATCH = 1024  # records per batch read from the library
CHUNK_DOCS, CHUNK_CHARS = 256, 1 << 20  # a chunk of work for a worker: whichever comes first
MIN_SHARD_TOKENS = 1025  # one window of 1024 + 1 tokens
MAX_SHARD_TOKENS = (1 << 31) - 1  # llm.c's header holds the count as an int32
LLMC_HEADER = 256  # int32 values before the tokens of an llm.c shard
# llm.c's (magic, version) per token dtype, as its dev/data/data_common.py writes them
LLMC_FORMAT = {np.dtype(np.uint16): (20240520, 1), np.dtype(np.uint32): (20240801, 7)}
FORMATS = {".parquet": "parquet", ".jsonl": "json"}
COMPRESSIONS = {"": "", ".gz": "gzip-compressed ", ".zst": "zstd-compressed "}
NAMES = {"parquet": "parquet", "json": "JSON lines", "arrow": "Arrow (save_to_disk)"}


def record_format(path: Path) -> str | None:
    """The format of a record file by its name: parquet, or json for JSON lines (.jsonl,
    also compressed: .jsonl.gz, .jsonl.zst); None for anything else (a text file)."""
    name = path.name.lower()
    for suffix, fmt in FORMATS.items():
        for compression in COMPRESSIONS:
            if name.endswith(suffix + compression) and not (fmt == "parquet" and compression):
                return fmt
    return None


@dataclass
class Source:
    """Records read as one sequence: one file, or a save_to_disk split (its Arrow files);
    `label` names it in messages, record indices count from 0 within it."""

    label: str
    fmt: str  # parquet | json | arrow
    files: list[Path]
    rows: int | None = None  # the record count where it is known without reading


@dataclass
class Corpus:
    """What the command line names: text files (`kind` "text") or sources of records."""

    kind: str  # text | records | save_to_disk
    given: list[str]
    sources: list[Source] = field(default_factory=list)
    text_files: list[Path] = field(default_factory=list)
    split: str | None = None  # of a dataset directory

    @property
    def files(self) -> list[Path]:
        return self.text_files or [f for s in self.sources for f in s.files]

    @property
    def rows(self) -> int | None:
        counts = [s.rows for s in self.sources]
        return sum(c for c in counts if c is not None) if None not in counts else None

    def describe(self, text_field: str | None) -> dict[str, Any]:
        """meta.json's "input": what was read (a preparation into an existing directory
        must read the same)."""
        formats = sorted({s.fmt for s in self.sources}) or ["text"]
        return {
            "kind": self.kind if self.kind != "records" else "+".join(formats),
            "given": self.given,
            "files": [str(f.resolve()) for f in self.files],
            "text_field": text_field,
            "split": self.split,
        }


def resolve(inputs: list[str | Path], split: str) -> Corpus:
    """The corpus the inputs name, in the order given (a glob's matches sorted)."""
    texts: list[Path] = []
    sources: list[Source] = []
    dirs = 0
    for given in map(str, inputs):
        paths = [Path(given)]
        if not paths[0].exists() and glob.has_magic(given):
            paths = [Path(p) for p in sorted(glob.glob(os.path.expanduser(given)))]
            if not paths:
                raise ConfigError(f"{given} matches no file")
        for path in paths:
            fmt = record_format(path)
            if path.is_dir():
                sources += _directory(path, split)
                dirs += 1
            elif not path.is_file():
                what = f"{NAMES[fmt]} file" if fmt else "text file"
                raise ConfigError(f"{what} {path} does not exist")
            elif fmt is not None:
                sources.append(Source(str(path), fmt, [path], _rows(path, fmt)))
            else:
                texts.append(path)
    if texts and sources:
        raise ConfigError(
            f"text files ({texts[0]}, ...) and records ({sources[0].label}, ...) given together; "
            "prepare one kind at a time (text files are one document each, records one per record)"
        )
    if texts:
        return Corpus("text", list(map(str, inputs)), text_files=texts)
    kind = "save_to_disk" if sources and all(s.fmt == "arrow" for s in sources) else "records"
    return Corpus(kind, list(map(str, inputs)), sources, split=split if dirs else None)


def _rows(path: Path, fmt: str) -> int | None:
    """A parquet file's record count from its footer (for the progress bar; a footer that
    does not read is reported when the file is read)."""
    if fmt != "parquet":
        return None
    import pyarrow.parquet as pq

    try:
        return pq.read_metadata(path).num_rows
    except Exception:
        return None


def _directory(path: Path, split: str) -> list[Source]:
    """A save_to_disk directory's split, or a dataset repository's files of `split`."""
    datasets = _datasets()
    if (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():
        with _quiet():
            try:
                loaded = datasets.load_from_disk(str(path))
            except Exception as e:
                raise ConfigError(
                    f"{path} is not a readable save_to_disk directory ({_why(e)})"
                ) from None
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise ConfigError(
                    f"{path} has no split {split!r}; its splits: {', '.join(loaded)} (--split)"
                )
            loaded, label = loaded[split], f"{path} (split {split})"
        elif split != "train":
            raise ConfigError(
                f"--split {split}: {path} holds one dataset (save_to_disk of a Dataset), "
                "without splits; leave --split out"
            )
        else:
            label = str(path)
        files = [Path(f["filename"]) for f in loaded.cache_files]
        return [Source(label, "arrow", files, len(loaded))]
    with _quiet(), _cache() as cache:
        try:
            builder = datasets.load_dataset_builder(str(path), cache_dir=cache)
        except Exception as e:  # no data files, several configurations and no default, ...
            if isinstance(e, datasets.data_files.EmptyDatasetError) or "doesn't contain" in str(e):
                builder = None
            else:
                raise ConfigError(f"{path} is not a dataset directory ({_why(e)})") from None
    if builder is None or builder.name not in ("parquet", "json"):
        raise ConfigError(
            f"text file {path} is a directory; give the files in it ({path}/*.txt) (no "
            "dataset directory either: not written by save_to_disk, and no parquet or JSON "
            "lines files in it)"
        )
    found = builder.config.data_files or {}
    if split not in found:
        raise ConfigError(
            f"{path} has no split {split!r}; its splits: {', '.join(map(str, found))} (--split)"
        )
    files = [Path(f) for f in found[split]]  # of the one format the library chose
    return [Source(str(f), builder.name, [f], _rows(f, builder.name)) for f in files]


def _datasets() -> Any:
    """The `datasets` library, told that it is offline and not to count downloads (it
    would ask the Hub on every load otherwise)."""
    try:
        import datasets
    except ImportError:
        raise ConfigError(
            "reading parquet, JSON lines or dataset directories needs the datasets library: "
            "pip install -e .[data]"
        ) from None
    datasets.config.HF_HUB_OFFLINE = True
    datasets.config.HF_DATASETS_OFFLINE = True
    datasets.config.HF_UPDATE_DOWNLOAD_COUNTS = False
    return datasets


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """The library's own log lines and progress bars silenced (our one line says it all);
    torch left unimported where it is not yet (each streaming dataset would import it, 4 s
    and 600 MB, to share an epoch counter with torch's data loader workers)."""
    datasets = _datasets()
    loggers = [logging.getLogger(name) for name in ("datasets", "huggingface_hub", "fsspec")]
    levels = [lg.level for lg in loggers]
    bars = datasets.utils.logging.is_progress_bar_enabled()
    torch = datasets.config.TORCH_AVAILABLE
    for lg in loggers:
        lg.setLevel(logging.CRITICAL + 1)
    datasets.disable_progress_bars()
    datasets.config.TORCH_AVAILABLE = torch and "torch" in sys.modules
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)
        if bars:
            datasets.enable_progress_bars()
        datasets.config.TORCH_AVAILABLE = torch


@contextlib.contextmanager
def _cache() -> Iterator[str]:
    """A cache directory of our own for the library, removed after (nothing under ~/.cache)."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="prepare_text-") as tmp:
        yield tmp


def _why(e: BaseException) -> str:
    text = " ".join(str(e).split()) or "no message"
    return f"{type(e).__name__}: {text[:300]}"


# -- records --------------------------------------------------------------------------------


def records(corpus: Corpus, text_field: str) -> Iterator[str]:
    """The text of every record, in corpus order. A field missing from a source, a value
    that is not a string (null included) and a file that does not read stop with one line
    naming the file (and the record, counted from 0 within its source)."""
    datasets = _datasets()
    with _quiet(), _cache() as cache:
        for source in corpus.sources:
            index = 0
            for file in source.files:
                for values in _read(datasets, source, file, text_field, cache):
                    for value in values:
                        if type(value) is not str:
                            raise ConfigError(_not_text(source, index, text_field, value))
                        index += 1
                    yield from values


def _read(datasets: Any, source: Source, file: Path, name: str, cache: str) -> Iterator[list]:
    """The values of field `name` of one file's records, a batch at a time. Each file is
    read by a dataset of its own: one over several files casts every file to the first
    one's types (an integer becomes a string without a word)."""
    what = NAMES[source.fmt]
    if source.fmt == "json":
        what = COMPRESSIONS.get(file.suffix, "") + what
        if file.suffix == ".zst":
            _check_zst(file)
        if file.stat().st_size == 0:
            return
    load = dict(data_files=[str(file)], split="train", streaming=True, cache_dir=cache)
    if source.fmt == "parquet":
        # Arrow's pre-buffering keeps every byte range it read until the file's scan ends:
        # a whole parquet file in memory (2 GB for one of FineWeb's). Read as needed instead.
        from pyarrow.dataset import ParquetFragmentScanOptions

        load["fragment_scan_options"] = ParquetFragmentScanOptions(pre_buffer=False)
    try:
        try:
            ds = datasets.load_dataset(source.fmt, **load)
        except StopIteration:  # JSON lines without a record: nothing to infer types from
            return
        names = list(ds.features or {})
        if name not in names:
            raise ConfigError(
                f"{source.label} has no field {name!r}; its records have "
                f"{', '.join(map(repr, names)) or 'no fields'} (--text-field)"
            )
        if source.fmt == "parquet":
            ds = datasets.load_dataset("parquet", columns=[name], **load)
        elif source.fmt == "json":
            # Every column as JSON: a later block's value keeps its own type (the library
            # would cast 5 to "5", or refuse another column's change of type).
            # Blocks of 1 MB: the library holds several copies of a block at once.
            json_types = datasets.Features({n: datasets.Json() for n in names})
            ds = datasets.load_dataset("json", features=json_types, chunksize=1 << 20, **load)
        batches = iter(ds.select_columns([name]).iter(batch_size=READ_BATCH))
    except ConfigError:
        raise
    except Exception as e:
        raise ConfigError(f"{file} is not a readable {what} file ({_why(e)})") from None
    done = False
    try:
        while True:
            try:
                batch = next(batches)
            except StopIteration:
                done = True
                return
            except Exception as e:
                raise ConfigError(f"{file} is not a readable {what} file ({_why(e)})") from None
            yield batch[name]
    finally:
        if not done:  # [Note: a scan left unfinished]
            batches.close()
            del batches, ds
            gc.collect()


# [Note: a scan left unfinished]
# An Arrow scan of a parquet file that is still going when the interpreter exits (a bad
# record stopped the reading halfway) can hang the exit for ever, in Arrow's thread pool
# shutdown, or abort it (apache/arrow#45214; `datasets` works around it only for pyarrow up
# to 24). The reading of a file that stops early is therefore closed and its objects freed
# at once, cycles too (gc.collect()), before the one line is printed.


def _check_zst(file: Path) -> None:
    """A zstd file decompresses to its end. The reader the library uses stops silently where
    a truncated file ends, which can fall at a line end: whole records lost, no error. (A
    pass of its own: zstd decompresses about a GB/s, tokenizing is far slower.)"""
    import zstandard

    with open(file, "rb") as f:
        frame, fed = zstandard.ZstdDecompressor().decompressobj(), False
        try:
            while data := f.read(1 << 16):
                while data:
                    frame.decompress(data)  # the output is not kept
                    fed, data = True, b""
                    if frame.eof:  # a frame ends: the rest is the next one
                        data, fed = frame.unused_data, False
                        frame = zstandard.ZstdDecompressor().decompressobj()
        except zstandard.ZstdError as e:
            raise ConfigError(
                f"{file} is not a readable zstd-compressed file ({_why(e)})"
            ) from None
    if fed:
        raise ConfigError(
            f"{file} is not a readable zstd-compressed file (it ends inside a frame: truncated)"
        )


def _not_text(source: Source, index: int, name: str, value: Any) -> str:
    kind = "null" if value is None else type(value).__name__
    shown = "" if value is None else f" ({repr(value)[:40]})"
    return (
        f"record {index} of {source.label}: {name} is {kind}{shown}, not a string; give "
        "--text-field the field that holds each document's text"
    )


def held_out(index: int, fraction: float) -> bool:
    """Whether document `index` is held out: evenly spread, `fraction` of the documents."""
    return math.floor((index + 1) * fraction) > math.floor(index * fraction)


def chunks(texts: Iterable[str], fraction: float) -> Iterator[tuple[list[bool], list[str]]]:
    """(held out?, text) of consecutive documents, grouped into chunks of work."""
    flags: list[bool] = []
    batch: list[str] = []
    size = 0
    for index, text in enumerate(texts):
        flags.append(held_out(index, fraction))
        batch.append(text)
        size += len(text)
        if len(batch) >= CHUNK_DOCS or size >= CHUNK_CHARS:
            yield flags, batch
            flags, batch, size = [], [], 0
    if batch:
        yield flags, batch


# -- tokenizing in worker processes ---------------------------------------------------------


def codec_state(codec: Codec) -> tuple:
    """What a worker process needs to rebuild `codec`."""
    if isinstance(codec, HF):
        return ("hf", codec.tokenizer.to_str())
    if isinstance(codec, Chars):
        return ("char", codec.chars)
    return ("bytes",)


def codec_from_state(state: tuple) -> Codec:
    if state[0] == "hf":
        from tokenizers import Tokenizer

        return HF(Tokenizer.from_str(state[1]))
    return Chars(state[1]) if state[0] == "char" else Bytes()


def encode(codec: Codec, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """The ids of `texts` concatenated (uint32) and the count of each."""
    if isinstance(codec, HF):
        tok = codec.tokenizer
        batch = getattr(tok, "encode_batch_fast", tok.encode_batch)  # no offsets computed
        ids = [e.ids for e in batch(texts, add_special_tokens=False)]
        lengths = np.array([len(i) for i in ids], dtype=np.int64)
        flat = np.fromiter((t for i in ids for t in i), dtype=np.uint32, count=int(lengths.sum()))
        return flat, lengths
    parts = [codec.encode(t) for t in texts]
    lengths = np.array([len(p) for p in parts], dtype=np.int64)
    flat = np.concatenate(parts).astype(np.uint32) if parts else np.zeros(0, np.uint32)
    return flat, lengths


_WORKER_CODEC: Codec | None = None


def _start_worker(state: tuple) -> None:
    global _WORKER_CODEC
    # One thread per worker: the processes are the parallelism, and the tokenizers
    # library's own thread pool is not to be shared across processes.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _WORKER_CODEC = codec_from_state(state)


def _encode_in_worker(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    assert _WORKER_CODEC is not None
    return encode(_WORKER_CODEC, texts)


# [Note: corpus order, bounded]
# The output must not depend on the worker count, so results are taken in the order the
# chunks were handed out, never as they finish: the oldest pending chunk's future is waited
# on first, and later ones that finish early wait in the queue. The reader runs only when a
# slot is free: at most 2 x workers chunks are pending (queued or being tokenized), so the
# memory held is that many chunks of text and their ids, whatever the corpus size; the
# second N keeps every worker busy while the oldest is written. (Pool.imap would read the
# corpus ahead without bound: its feeder thread submits everything it can.) Workers start
# with "spawn": a fork would copy the reader's Arrow threads and the tokenizers library's
# thread pool, which are not safe to use in a forked child.
def encode_in_order(
    items: Iterable[tuple[T, list[str]]], codec: Codec, workers: int
) -> Iterator[tuple[T, np.ndarray, np.ndarray]]:
    """(tag, ids, counts) of each (tag, texts) item, in the order given, tokenized in
    `workers` processes (in this one for 1) ([Note: corpus order, bounded])."""
    if workers == 1:
        for tag, texts in items:
            yield (tag, *encode(codec, texts))
        return
    pool = ProcessPoolExecutor(
        workers,
        mp_context=multiprocessing.get_context("spawn"),
        initializer=_start_worker,
        initargs=(codec_state(codec),),
    )
    pending: deque[tuple[T, Future]] = deque()
    try:
        for tag, texts in items:
            pending.append((tag, pool.submit(_encode_in_worker, texts)))
            if len(pending) >= 2 * workers:
                tag, future = pending.popleft()
                yield (tag, *future.result())
        while pending:
            tag, future = pending.popleft()
            yield (tag, *future.result())
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


# -- writing --------------------------------------------------------------------------------


# [Note: document boundaries]
# Beside each token file X.bin, X.docs.npy: a 1-D int64 array, strictly ascending, of the
# offsets (in the file's tokens, an llm.c header not counted) of the first token of every
# document that starts in that file. A document continued from the file before has no entry
# at 0. The separator goes between consecutive documents of a split and belongs to the
# document before it, so an entry is a document's own first token; a document without
# tokens has none (so no two entries are equal). The offsets go to disk as they come, in
# blocks, not kept in memory.
class SplitWriter:
    """One split's token files in `out`, written under temporary names (`temp` maps each to
    its final name; renaming them is the caller's): `{split}.bin`, headerless, for
    `shard_tokens` 0 (always written, empty too), else llm.c shards `{split}_000000.bin`,
    ... of at most `shard_tokens` tokens (none empty); each with its `.docs.npy`."""

    def __init__(self, out: Path, split: str, dtype: Any, shard_tokens: int = 0) -> None:
        self.out, self.split, self.shard_tokens = out, split, shard_tokens
        self.dtype = np.dtype(dtype)
        self.temp: dict[Path, Path] = {}  # temporary path -> final path
        self.tokens = self.documents = self.files = 0
        self._file: Any = None
        self._in_file = 0  # tokens in the open file
        self._starting = False  # the next token written is a document's first
        self._starts: list[int] = []  # offsets not yet on disk
        self._starts_file: Any = None  # raw int64 offsets of the open file, on disk
        if not shard_tokens:
            self._open(f"{split}.bin")

    def start_document(self) -> None:
        self._starting = True

    def write(self, ids: np.ndarray, separator: bool = False) -> None:
        """Append token ids; `separator`: they end the document before (a document that
        was started and wrote no token has no first token to record)."""
        if separator:
            self._starting = False
        while len(ids):
            if self._file is None or (self.shard_tokens and self._in_file == self.shard_tokens):
                self._next_shard()
            room = self.shard_tokens - self._in_file if self.shard_tokens else len(ids)
            piece, ids = ids[:room], ids[room:]
            if self._starting:
                self._starts.append(self._in_file)
                self._starting, self.documents = False, self.documents + 1
                if len(self._starts) >= 1 << 12:
                    self._flush_starts()
            self._file.write(piece.astype(self.dtype).tobytes())
            self._in_file += len(piece)
            self.tokens += len(piece)

    def close(self) -> None:
        if self._file is not None:
            self._finish()

    def discard(self) -> None:
        """Close and remove every temporary file written (a failed preparation)."""
        for f in (self._file, self._starts_file):
            if f is not None:
                f.close()
        self._file = self._starts_file = None
        for path in self.temp:
            path.unlink(missing_ok=True)
            _raw(path).unlink(missing_ok=True)

    def _next_shard(self) -> None:
        if self._file is not None:
            self._finish()
        if self.files == 10**6:  # the names would no longer sort in order
            raise ConfigError(
                f"the {self.split} split needs more than 1000000 shards of --shard-tokens "
                f"{self.shard_tokens}; give a larger --shard-tokens"
            )
        self._open(f"{self.split}_{self.files:06d}.bin")

    def _open(self, name: str) -> None:
        tmp = self.out / f".{name}.tmp"
        docs = name.removesuffix(".bin") + ".docs.npy"
        self.temp[tmp] = self.out / name
        self.temp[self.out / f".{docs}.tmp"] = self.out / docs
        self._file = open(tmp, "wb")
        self._starts_file = open(_raw(self.out / f".{docs}.tmp"), "wb")
        if self.shard_tokens:
            self._file.write(bytes(4 * LLMC_HEADER))  # the header, written at the end
        self._in_file, self.files = 0, self.files + 1

    def _flush_starts(self) -> None:
        np.asarray(self._starts, dtype="<i8").tofile(self._starts_file)
        self._starts = []

    def _finish(self) -> None:
        if self.shard_tokens:
            header = np.zeros(LLMC_HEADER, dtype="<i4")
            header[:3] = *LLMC_FORMAT[self.dtype], self._in_file
            self._file.seek(0)
            self._file.write(header.tobytes())
        self._file.close()
        self._flush_starts()
        raw = self._starts_file.name
        self._starts_file.close()
        self._file = self._starts_file = None
        docs = Path(raw).with_suffix("")  # .X.docs.npy.tmp.raw -> .X.docs.npy.tmp
        count = Path(raw).stat().st_size // 8
        with open(docs, "wb") as out, open(raw, "rb") as offsets:
            header = {"descr": "<i8", "fortran_order": False, "shape": (count,)}
            np.lib.format.write_array_header_1_0(out, header)
            while block := offsets.read(1 << 20):
                out.write(block)
        Path(raw).unlink()


def _raw(docs_tmp: Path) -> Path:
    return docs_tmp.with_name(docs_tmp.name + ".raw")
