"""Text files or a corpus of records into token files for `train.py data=token_file data.dir=OUT`.

    python scripts/prepare_text.py notes/*.txt --out data/notes --tokenizer char
    python scripts/prepare_text.py book.txt --out data/book --tokenizer bytes --val-fraction 0.05
    python scripts/prepare_text.py old/*.txt --out data/old --encoding cp1252
    python scripts/prepare_text.py 'web/*.parquet' --out data/web --tokenizer tok_dir \\
        --workers 2 --shard-tokens 100000000
    python scripts/prepare_text.py dump.jsonl.zst saved_dataset_dir --out data/d --text-field body

Text files are one document each, read in chunks cut at line ends; the last `--val-fraction`
of their bytes is held out. Records (parquet, JSON lines also .gz or .zst, a directory of
`save_to_disk` or a dataset repository, `--split` of it) are one document each, their
`--text-field`, streamed by `datasets` (trainer/data/corpus.py); document i is held out when
floor((i + 1) f) > floor(i f), f the fraction. `--separator` goes between consecutive
documents (by default a Hugging Face tokenizer's EOS token, else a newline), as nanoGPT and
llm.c put the end-of-text token. `--workers N` tokenizes in N processes; the files are the
same whatever N. Writes OUT/train.bin and OUT/val.bin (headerless ids, uint16 where the
vocabulary fits, else uint32), or with `--shard-tokens N` llm.c shards train_000000.bin, ...
(a 256-int32 header, at most N tokens each); beside each X.bin, X.docs.npy: the offsets of
the documents' first tokens. OUT/meta.json records the vocabulary, the tokenizer, the counts
and what was read (a Hugging Face tokenizer's tokenizer.json is copied beside). Text files
are decoded with `--encoding` (UTF-8 by default): a byte that does not decode stops with one
line naming the file, line and byte; `--errors replace` turns each undecodable sequence into
U+FFFD and reports how many bytes were replaced.
"""

from __future__ import annotations

import argparse
import codecs
import contextlib
import json
import os
import re
import sys
from collections.abc import Iterator
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import numpy as np
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.data import corpus  # noqa: E402
from trainer.data.corpus import Corpus, SplitWriter  # noqa: E402
from trainer.data.text import (  # noqa: E402
    HF,
    Bytes,
    Chars,
    Codec,
    eos_token,
    hf_tokenizer,
    read_tokenizer_file,
)
from trainer.errors import ConfigError  # noqa: E402

CHUNK = 1 << 20  # bytes of text per read
# What a preparation writes (a token file and its .docs.npy, meta.json, tokenizer.json):
# files of these names in --out belong to it and are replaced as a whole.
TOKEN_FILE = re.compile(r"(train|val)(_[0-9]{6})?\.(bin|docs\.npy)")


class Reader:
    """The files' text in pieces, decoded with `encoding`; with errors="replace" it counts
    the bytes it replaced (`replaced`)."""

    def __init__(self, files: list[Path], encoding: str = "utf-8", errors: str = "strict"):
        try:
            codecs.lookup(encoding)
        except LookupError:
            raise ConfigError(
                f"--encoding {encoding} is not an encoding Python knows (e.g. utf-8, "
                "utf-8-sig, latin-1, cp1252, utf-16)"
            ) from None
        if errors not in ("strict", "replace"):
            raise ConfigError(f"--errors {errors} is not one of strict, replace")
        self.files, self.encoding, self.errors = files, encoding, errors
        self.replaced = 0
        # Python's "replace" with a count: one U+FFFD per undecodable sequence, as "replace".
        codecs.register_error("prepare_text.replace", self._replace)

    def _replace(self, e: UnicodeError) -> tuple[str, int]:
        if not isinstance(e, UnicodeDecodeError):
            raise e
        self.replaced += e.end - e.start
        return "\ufffd", e.end

    def pieces(self, val_from: int) -> Iterator[tuple[int, str, bool, int]]:
        """(file index, text, is_val, bytes read) of the files in order, cut after a
        newline, split where the byte position `val_from` falls. Each file has its own
        incremental decoder, so a cut inside a character (a very long line, a
        multi-byte encoding) loses nothing."""
        pos = 0
        errors = "prepare_text.replace" if self.errors == "replace" else "strict"
        for index, file in enumerate(self.files):
            decoder = codecs.getincrementaldecoder(self.encoding)(errors)
            at, lines = 0, 0  # bytes and newlines of this file before the current piece
            for piece, is_val in _cut(file, pos, val_from):
                last = at + len(piece) == file.stat().st_size
                held = len(decoder.getstate()[0])  # bytes of a character cut at the last piece
                try:
                    text = decoder.decode(piece, final=last)
                except UnicodeDecodeError as e:
                    offset = at - held + e.start
                    line = lines + piece[: max(e.start - held, 0)].count(b"\n") + 1
                    raise ConfigError(self._not_decodable(file, e, offset, line)) from None
                yield index, text, is_val, len(piece)
                at, lines, pos = at + len(piece), lines + piece.count(b"\n"), pos + len(piece)

    def _not_decodable(self, file: Path, e: UnicodeDecodeError, offset: int, line: int) -> str:
        bad = e.object[e.start : e.end].hex(" ")
        with open(file, "rb") as f:
            head = f.read(4)
        hint = "--encoding latin-1 or cp1252 for Western European text"
        if head.startswith((b"\xff\xfe", b"\xfe\xff")):
            hint = "--encoding utf-16: the file starts with a UTF-16 byte order mark"
        return (
            f"{file} is not {self.encoding}: byte {offset} (line {line}) is 0x{bad} "
            f"({e.reason}); give its encoding ({hint}), or --errors replace to replace "
            "undecodable bytes with U+FFFD"
        )


def _cut(file: Path, pos: int, val_from: int) -> Iterator[tuple[bytes, bool]]:
    """(bytes, is_val) pieces of one file that starts at byte `pos` of all the text, cut
    after a newline (a very long line anywhere), split at the newline after `val_from`."""
    with open(file, "rb") as f:
        rest = b""
        while True:
            block = f.read(CHUNK)
            data = rest + block
            if not data:
                return
            cut = data.rfind(b"\n") + 1 if block else len(data)
            if not cut and len(data) > 8 * CHUNK:  # a very long line: the decoder holds
                cut = len(data)  # a character cut in two
            piece, rest = (data[:cut], data[cut:]) if cut else (b"", data)
            if not piece:
                continue
            if pos < val_from < pos + len(piece):  # the split falls in this piece
                at = piece.find(b"\n", val_from - pos) + 1 or len(piece)
                yield piece[:at], False
                if piece[at:]:
                    yield piece[at:], True
            else:
                yield piece, pos >= val_from
            pos += len(piece)


def separator_of(option: str, eos: str | None = None) -> str | None:
    """The text between two files: `option` (escapes such as \\n read as such), none, or
    for "auto" the tokenizer's EOS token `eos`, else a newline."""
    if option == "none":
        return None
    if option == "auto":
        return eos or "\n"
    try:
        text = option.encode("latin-1", "backslashreplace").decode("unicode_escape")
    except UnicodeDecodeError as e:
        raise ConfigError(f"--separator {option!r} has a bad escape ({e.reason})") from None
    if not text:
        raise ConfigError("--separator is empty; use --separator none for no separator")
    return text


def separator_ids(text: str | None, codec: Codec, option: str) -> np.ndarray:
    if text is None:
        return np.zeros(0, dtype=np.int64)
    if isinstance(codec, HF) and codec.tokenizer.token_to_id(text) is not None:
        return np.array([codec.tokenizer.token_to_id(text)], dtype=np.int64)  # one token
    ids = codec.encode(text)
    if not len(ids):
        raise ConfigError(f"--separator {option!r} encodes to no tokens with this tokenizer")
    return ids


def decode_pass(reader: Reader, separator: str | None, find_chars: bool) -> Chars | None:
    """One pass over the text files that decodes them all (so a byte that does not decode
    stops before anything is written) and, for char, finds the characters, the
    separator's among them."""
    seen: set[str] = set(separator or "")
    for _, text, _, _ in reader.pieces(val_from=1 << 62):
        if find_chars:
            seen.update(text)
    return Chars("".join(seen)) if find_chars else None


def record_chars(source: Corpus, text_field: str, separator: str | None) -> Chars:
    """The characters of every record (and of the separator): a first pass for char."""
    seen: set[str] = set(separator or "")
    for text in corpus.records(source, text_field):
        seen.update(text)
    return Chars("".join(seen))


def prepare(
    files: list[Path | str],
    out: Path,
    tokenizer: str,
    val_fraction: float,
    separator: str = "auto",
    encoding: str = "utf-8",
    errors: str = "strict",
    *,
    text_field: str = "text",
    split: str = "train",
    workers: int = 1,
    shard_tokens: int = 0,
) -> dict:
    """Tokenize `files` (text files, record files, globs, dataset directories) into `out`;
    returns what meta.json holds."""
    out = Path(out)
    if not 0 <= val_fraction < 1:
        raise ConfigError(f"--val-fraction {val_fraction} must be from 0 to below 1")
    if workers < 1:
        raise ConfigError(f"--workers {workers} must be at least 1 (1: tokenize in this process)")
    lo, hi = corpus.MIN_SHARD_TOKENS, corpus.MAX_SHARD_TOKENS
    if shard_tokens != 0 and not lo <= shard_tokens <= hi:
        raise ConfigError(
            f"--shard-tokens {shard_tokens} must be 0 (one train.bin and val.bin) or from {lo} "
            f"(one window of 1024 + 1 tokens) to {hi} (llm.c's header counts in an int32)"
        )
    source = corpus.resolve(files, split)
    if source.kind == "text":
        _refuse_options(
            [("--text-field", text_field, "text"), ("--split", split, "train")],
            "applies to records (parquet, JSON lines, dataset directories), not to text "
            "files; leave it out",
        )
        total = sum(f.stat().st_size for f in source.text_files)
        if total == 0:
            raise ConfigError(
                f"the text files ({', '.join(map(str, source.text_files))}) are empty"
            )
    else:
        _refuse_options(
            [("--encoding", encoding, "utf-8"), ("--errors", errors, "strict")],
            "applies to text files; records are read as the Unicode text their files hold "
            "(JSON and parquet strings are UTF-8)",
        )
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file; give a directory to write the tokens into")
    described = source.describe(None if source.kind == "text" else text_field)
    refuse_other_corpus(out, described)
    reader = Reader(source.text_files, encoding, errors)
    codec: Codec | None = None
    if tokenizer == "bytes":
        codec = Bytes()
    elif tokenizer != "char":
        codec = hf_tokenizer(tokenizer)
    refuse_other_tokenizer(out, tokenizer, codec)
    if codec is None:  # char: the separator's characters join the vocabulary
        sep_text = separator_of(separator)
        if source.kind == "text":
            codec = decode_pass(reader, sep_text, find_chars=True)
        else:
            codec = record_chars(source, text_field, sep_text)
    else:
        if source.kind == "text":
            decode_pass(reader, None, find_chars=False)
        eos = eos_token(tokenizer, codec.tokenizer) if isinstance(codec, HF) else None
        sep_text = separator_of(separator, eos)
    assert codec is not None
    sep = separator_ids(sep_text, codec, separator)
    dtype = np.uint16 if codec.vocab_size <= 1 << 16 else np.uint32
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"--out {out} cannot be created: {e.strerror}") from None
    # Everything is written beside the outputs and renamed at the end: a preparation that
    # fails halfway (here or in a worker) leaves a directory prepared before as it was.
    writers = {s: SplitWriter(out, s, dtype, shard_tokens) for s in ("train", "val")}
    extra = {name: out / f".{name}.tmp" for name in ("meta.json", "tokenizer.json")}
    try:
        if source.kind == "text":
            documents = _write_text(reader, writers, codec, sep, val_fraction, workers)
        else:
            documents = _write_records(
                source, text_field, writers, codec, sep, val_fraction, workers
            )
        for w in writers.values():
            w.close()
        if writers["train"].tokens == 0:
            raise ConfigError("no training tokens: lower --val-fraction or give more text")
        if isinstance(codec, HF):
            codec.tokenizer.save(str(extra["tokenizer.json"]))
        meta = {
            "vocab_size": codec.vocab_size,
            "dtype": np.dtype(dtype).name,
            **codec.meta(),
            "tokens": {s: w.tokens for s, w in writers.items()},
            "source_files": [str(f) for f in source.files],
            "separator": sep_text,  # between consecutive documents; null: none
            "separator_ids": sep.tolist(),
            "encoding": encoding,
            "replaced_bytes": reader.replaced,  # undecodable bytes made U+FFFD (--errors replace)
            "input": described,
            "documents": {s: w.documents for s, w in writers.items()},
            **documents,  # records: how many were empty (no tokens), skipped
            "shard_tokens": shard_tokens,  # 0: one headerless file per split
            "token_files": {s: w.files for s, w in writers.items()},
        }
        if tokenizer not in ("char", "bytes"):
            meta["tokenizer_source"] = tokenizer
        extra["meta.json"].write_text(json.dumps(meta, indent=1, ensure_ascii=False))
        written = {final.name for w in writers.values() for final in w.temp.values()}
        for path in out.iterdir():  # an earlier preparation's files that this one has not
            if TOKEN_FILE.fullmatch(path.name) and path.name not in written:
                path.unlink()
        for w in writers.values():
            for tmp, final in w.temp.items():
                os.replace(tmp, final)
        for name, path in extra.items():
            if path.exists():
                os.replace(path, out / name)
    finally:
        for w in writers.values():
            w.discard()
        for path in extra.values():
            path.unlink(missing_ok=True)
    return meta


def _write_text(
    reader: Reader,
    writers: dict[str, SplitWriter],
    codec: Codec,
    sep: np.ndarray,
    val_fraction: float,
    workers: int,
) -> dict:
    """The text files' tokens: each file a document, the separator before each file but
    the first (in the split where that file begins, as always), the last `val_fraction`
    of the bytes held out (cut at a line end)."""
    total = sum(f.stat().st_size for f in reader.files)
    val_from = total - int(total * val_fraction) if val_fraction else total
    reader.replaced = 0  # counted over the tokenizing pass alone
    pieces = (
        ((index, is_val, nbytes), [text]) for index, text, is_val, nbytes in reader.pieces(val_from)
    )
    current, started = 0, False
    with (
        contextlib.closing(corpus.encode_in_order(pieces, codec, workers)) as encoded,
        tqdm(total=total, unit="B", unit_scale=True, desc="tokenizing") as bar,
    ):
        for (index, is_val, nbytes), ids, _ in encoded:
            target = writers["val" if is_val else "train"]
            new = not started or index != current  # a piece of the file before goes on
            if index != current:
                current = index
                target.write(sep, separator=True)  # it ends the file before
            if new:
                target.start_document()
                started = True
            target.write(ids)
            bar.update(nbytes)
            _show_rate(bar, writers)
    return {}


def _write_records(
    source: Corpus,
    text_field: str,
    writers: dict[str, SplitWriter],
    codec: Codec,
    sep: np.ndarray,
    val_fraction: float,
    workers: int,
) -> dict:
    """The records' tokens: each record a document, document i held out when
    floor((i + 1) f) > floor(i f), the separator between consecutive documents of a split.
    A record whose text has no tokens is no document (counted as empty)."""
    empty = records = 0
    texts = contextlib.closing(corpus.records(source, text_field))
    with (
        texts as stream,
        contextlib.closing(
            corpus.encode_in_order(corpus.chunks(stream, val_fraction), codec, workers)
        ) as encoded,
        tqdm(total=source.rows, unit="doc", desc="tokenizing") as bar,
    ):
        for held, ids, lengths in encoded:
            ends = np.cumsum(lengths)
            for is_val, end, n in zip(held, ends, lengths, strict=True):
                if not n:
                    empty += 1
                    continue
                target = writers["val" if is_val else "train"]
                if target.documents:
                    target.write(sep, separator=True)
                target.start_document()
                target.write(ids[end - n : end])
            records += len(held)
            bar.update(len(held))
            _show_rate(bar, writers)
    if records == empty:
        files = ", ".join(str(f) for f in source.files[:3]) + (
            ", ..." if len(source.files) > 3 else ""
        )
        raise ConfigError(
            f"the corpus ({files}) holds no documents: "
            + (f"its {records} records have no text in {text_field!r}" if records else "no records")
        )
    return {"empty_documents": empty}


def _show_rate(bar: tqdm, writers: dict[str, SplitWriter]) -> None:
    elapsed = bar.format_dict["elapsed"] or 1e-9
    tokens = sum(w.tokens for w in writers.values())
    bar.set_postfix_str(f"{tokens:,} tokens, {tokens / elapsed:,.0f} tokens/s", refresh=False)


def refuse_other_corpus(out: Path, described: dict) -> None:
    """An --out that holds another corpus's tokens is refused: replacing them would leave a
    run that trains on the directory with other data than it thinks (the same corpus again,
    prepared with other options, is replaced as a whole)."""
    if not out.is_dir():
        return
    tokens = sorted(p.name for p in out.iterdir() if TOKEN_FILE.fullmatch(p.name))
    remedy = "give another --out, or remove the directory to prepare this corpus there"
    if not (out / "meta.json").is_file():
        if tokens:
            raise ConfigError(
                f"--out {out} holds token files ({tokens[0]}, ...) without a meta.json, not "
                f"written by this script; {remedy}"
            )
        return
    theirs = _read_meta(out)
    before = theirs.get("input")
    if before is None:  # written before meta.json described its input: text files
        files = [str(Path(f).resolve()) for f in theirs.get("source_files", [])]
        before = {"kind": "text", "files": files, "text_field": None, "split": None}
    keys = ("kind", "files", "text_field", "split")
    if any(before.get(k) != described[k] for k in keys):
        raise ConfigError(
            f"--out {out} holds another corpus: {_corpus_named(before)} (its meta.json), not "
            f"{_corpus_named(described)}; {remedy}"
        )


def refuse_other_tokenizer(out: Path, tokenizer: str, codec: Codec | None) -> None:
    """The same corpus in --out tokenized otherwise is refused too (another kind, another
    Hugging Face tokenizer)."""
    if not (out / "meta.json").is_file():
        return
    theirs = _read_meta(out)
    kind = "hf" if isinstance(codec, HF) else tokenizer
    same = theirs.get("tokenizer") == kind
    if same and isinstance(codec, HF):
        saved = out / "tokenizer.json"
        same = saved.is_file() and read_tokenizer_file(saved).to_str() == codec.tokenizer.to_str()
    if not same:
        named = theirs.get("tokenizer_source") or theirs.get("tokenizer")
        raise ConfigError(
            f"--out {out} holds this corpus tokenized with another tokenizer ({named}, its "
            f"meta.json), not {tokenizer}; give another --out, or remove the directory to "
            "prepare the corpus there with this tokenizer"
        )


def _read_meta(out: Path) -> dict:
    try:
        meta = json.loads((out / "meta.json").read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(
            f"--out {out} holds a meta.json that is not JSON ({e}); give another --out, or "
            "remove the directory"
        ) from None
    if not isinstance(meta, dict):
        raise ConfigError(f"--out {out} holds a meta.json that is not an object; remove it")
    return meta


def _corpus_named(described: dict) -> str:
    files = described.get("files") or []
    where = (
        files[0]
        if len(files) == 1
        else f"{files[0]} and {len(files) - 1} more"
        if files
        else "no files"
    )
    extra = "".join(
        f", {k} {described[k]!r}" for k in ("text_field", "split") if described.get(k) is not None
    )
    return f"{described.get('kind')} {where}{extra}"


def _refuse_options(given: list[tuple[str, str, str]], why: str) -> None:
    """One line for the first (option, value, default) set to other than its default."""
    for option, value, default in given:
        if value != default:
            raise ConfigError(f"{option} {value} {why}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "files",
        nargs="+",
        help="text files (one document each), or parquet / JSON lines files (.jsonl, "
        ".jsonl.gz, .jsonl.zst), globs of them, dataset directories (one document a record)",
    )
    parser.add_argument("--out", type=Path, required=True, help="directory to write")
    parser.add_argument(
        "--tokenizer", default="char", help="char | bytes | a local Hugging Face tokenizer dir"
    )
    parser.add_argument("--val-fraction", type=float, default=0.1)
    parser.add_argument(
        "--separator",
        default="auto",
        help="text between documents: auto (a Hugging Face tokenizer's EOS token, else a "
        "newline), none, or any text (\\n, \\t read as escapes)",
    )
    parser.add_argument("--encoding", default="utf-8", help="of the text files (default utf-8)")
    parser.add_argument(
        "--errors",
        default="strict",
        choices=("strict", "replace"),
        help="undecodable bytes: stop (strict) or replace each sequence with U+FFFD and count them",
    )
    parser.add_argument("--text-field", default="text", help="of records: the document's text")
    parser.add_argument("--split", default="train", help="of a dataset directory (default train)")
    parser.add_argument(
        "--workers", type=int, default=1, help="tokenizing processes (the output is the same)"
    )
    parser.add_argument(
        "--shard-tokens",
        type=int,
        default=0,
        help="0: one train.bin and val.bin; N: llm.c shards of at most N tokens each",
    )
    args = parser.parse_args(argv)
    try:
        meta = prepare(
            args.files, args.out, args.tokenizer, args.val_fraction, args.separator,
            args.encoding, args.errors, text_field=args.text_field, split=args.split,
            workers=args.workers, shard_tokens=args.shard_tokens,
        )  # fmt: skip
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except BrokenProcessPool:
        print(
            f"error: a tokenizing worker process ended abruptly (killed, or out of memory?); "
            f"nothing was written to {args.out}",
            file=sys.stderr,
        )
        return 1
    t, sep = meta["tokens"], meta["separator"]
    records = meta["input"]["kind"] != "text"
    between = "no separator" if sep is None else f"separator {sep!r}"
    if meta["tokenizer"] == "hf" and args.separator == "auto" and sep == "\n":
        between += " (the tokenizer names no EOS token)"
    between += " between documents" if records else " between files"
    if args.errors == "replace":
        between += f", {meta['replaced_bytes']} undecodable bytes replaced"
    counted = ""
    if records:
        d = meta["documents"]
        counted = f" ({d['train']} + {d['val']} documents)"
    if args.shard_tokens:
        f = meta["token_files"]
        counted += f" in {f['train']} + {f['val']} shards"
    print(
        f"{args.out}: {t['train']} train + {t['val']} val tokens{counted}, vocab "
        f"{meta['vocab_size']} ({meta['tokenizer']}, {meta['dtype']}), {between}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
