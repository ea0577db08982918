"""Turn local text files into token files for `train.py data=token_file data.dir=OUT`.

    python scripts/prepare_text.py notes/*.txt --out data/notes --tokenizer char
    python scripts/prepare_text.py book.txt --out data/book --tokenizer bytes --val-fraction 0.05
    python scripts/prepare_text.py corpus.txt --out data/c --tokenizer path/to/hf_tokenizer_dir
    python scripts/prepare_text.py old/*.txt --out data/old --encoding cp1252

Writes OUT/train.bin and OUT/val.bin (headerless token ids, uint16 where the vocabulary
fits, else uint32) and OUT/meta.json (vocab size, dtype, tokenizer, token counts, source
files, separator, encoding); a Hugging Face tokenizer's tokenizer.json is copied beside
them. The files are read in chunks cut at line ends, never whole; the last
`--val-fraction` of the text (by bytes, over the files in the order given) is the
held-out part.

Each file is one document: `--separator` goes between consecutive files so that one
does not run into the next inside a training window (nanoGPT and llm.c put the end-of-text
token between documents). By default that is the tokenizer's EOS token for a Hugging Face
tokenizer (a newline where it names none) and a newline for char and bytes.

The files are decoded with `--encoding` (UTF-8 by default). A byte that does not decode
stops with one line naming the file, line and byte; `--errors replace` instead turns
each undecodable sequence into U+FFFD and reports how many bytes were replaced.
"""

from __future__ import annotations

import argparse
import codecs
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.data.text import HF, Bytes, Chars, Codec, eos_token, hf_tokenizer  # noqa: E402
from trainer.errors import ConfigError  # noqa: E402

CHUNK = 1 << 20  # bytes of text per read
OUTPUTS = ("train.bin", "val.bin", "meta.json", "tokenizer.json")


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


def build_codec(spec: str, reader: Reader, separator: str | None) -> Codec:
    """The tokenizer, after one pass over the text that decodes it all (so a byte that
    does not decode stops before anything is written) and, for char, finds the
    characters, the separator's among them."""
    codec = Bytes() if spec == "bytes" else None if spec == "char" else hf_tokenizer(spec)
    seen: set[str] = set(separator or "")
    for _, text, _, _ in reader.pieces(val_from=1 << 62):
        if codec is None:
            seen.update(text)
    return Chars("".join(seen)) if codec is None else codec


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


def prepare(
    files: list[Path],
    out: Path,
    tokenizer: str,
    val_fraction: float,
    separator: str = "auto",
    encoding: str = "utf-8",
    errors: str = "strict",
) -> dict:
    for f in files:
        if f.is_dir():
            raise ConfigError(f"text file {f} is a directory; give the files in it ({f}/*.txt)")
        if not f.is_file():
            raise ConfigError(f"text file {f} does not exist")
    if not 0 <= val_fraction < 1:
        raise ConfigError(f"--val-fraction {val_fraction} must be from 0 to below 1")
    total = sum(f.stat().st_size for f in files)
    if total == 0:
        raise ConfigError(f"the text files ({', '.join(map(str, files))}) are empty")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file; give a directory to write the tokens into")
    reader = Reader(files, encoding, errors)
    if tokenizer == "char":  # the separator's characters join the vocabulary
        sep_text = separator_of(separator)
        codec = build_codec(tokenizer, reader, sep_text)
    else:
        codec = build_codec(tokenizer, reader, None)
        eos = eos_token(tokenizer, codec.tokenizer) if isinstance(codec, HF) else None
        sep_text = separator_of(separator, eos)
    sep = separator_ids(sep_text, codec, separator)
    dtype = np.uint16 if codec.vocab_size <= 1 << 16 else np.uint32
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"--out {out} cannot be created: {e.strerror}") from None
    counts = {"train": 0, "val": 0}
    val_from = total - int(total * val_fraction) if val_fraction else total
    reader.replaced = 0  # counted over the tokenizing pass alone
    # Written beside the outputs and renamed at the end: a file that fails halfway
    # leaves a directory prepared before as it was.
    tmp = {name: out / f".{name}.tmp" for name in OUTPUTS}
    try:
        with (
            open(tmp["train.bin"], "wb") as train,
            open(tmp["val.bin"], "wb") as val,
            tqdm(total=total, unit="B", unit_scale=True, desc="tokenizing") as bar,
        ):
            current = 0
            for index, text, is_val, nbytes in reader.pieces(val_from):
                target, part = (val, "val") if is_val else (train, "train")
                if index != current:  # a new document starts
                    current = index
                    sep.astype(dtype).tofile(target)
                    counts[part] += len(sep)
                ids = codec.encode(text)
                ids.astype(dtype).tofile(target)
                counts[part] += len(ids)
                bar.update(nbytes)
        if counts["train"] == 0:
            raise ConfigError("no training tokens: lower --val-fraction or give more text")
        if isinstance(codec, HF):
            codec.tokenizer.save(str(tmp["tokenizer.json"]))
        meta = {
            "vocab_size": codec.vocab_size,
            "dtype": np.dtype(dtype).name,
            **codec.meta(),
            "tokens": counts,
            "source_files": [str(f) for f in files],
            "separator": sep_text,  # between consecutive files; null: none
            "separator_ids": sep.tolist(),
            "encoding": encoding,
            "replaced_bytes": reader.replaced,  # undecodable bytes made U+FFFD (--errors replace)
        }
        if tokenizer not in ("char", "bytes"):
            meta["tokenizer_source"] = tokenizer
        tmp["meta.json"].write_text(json.dumps(meta, indent=1, ensure_ascii=False))
        for name, path in tmp.items():
            if path.exists():
                os.replace(path, out / name)
    finally:
        for path in tmp.values():
            path.unlink(missing_ok=True)
    return meta


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path, help="text files, one document each")
    parser.add_argument("--out", type=Path, required=True, help="directory to write")
    parser.add_argument(
        "--tokenizer", default="char", help="char | bytes | a local Hugging Face tokenizer dir"
    )
    parser.add_argument("--val-fraction", type=float, default=0.1)
    parser.add_argument(
        "--separator",
        default="auto",
        help="text between files: auto (a Hugging Face tokenizer's EOS token, else a "
        "newline), none, or any text (\\n, \\t read as escapes)",
    )
    parser.add_argument("--encoding", default="utf-8", help="of the text files (default utf-8)")
    parser.add_argument(
        "--errors",
        default="strict",
        choices=("strict", "replace"),
        help="undecodable bytes: stop (strict) or replace each sequence with U+FFFD and count them",
    )
    args = parser.parse_args(argv)
    try:
        meta = prepare(
            args.files, args.out, args.tokenizer, args.val_fraction,
            args.separator, args.encoding, args.errors,
        )  # fmt: skip
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    t, sep = meta["tokens"], meta["separator"]
    between = "no separator" if sep is None else f"separator {sep!r}"
    if meta["tokenizer"] == "hf" and args.separator == "auto" and sep == "\n":
        between += " (the tokenizer names no EOS token)"
    between += " between files"
    if args.errors == "replace":
        between += f", {meta['replaced_bytes']} undecodable bytes replaced"
    print(
        f"{args.out}: {t['train']} train + {t['val']} val tokens, vocab {meta['vocab_size']} "
        f"({meta['tokenizer']}, {meta['dtype']}), {between}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
