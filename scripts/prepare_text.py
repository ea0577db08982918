"""Turn local text files into token files for `train.py data=token_file data.dir=OUT`.

    python scripts/prepare_text.py notes/*.txt --out data/notes --tokenizer char
    python scripts/prepare_text.py book.txt --out data/book --tokenizer bytes --val-fraction 0.05
    python scripts/prepare_text.py corpus.txt --out data/c --tokenizer path/to/hf_tokenizer_dir

Writes OUT/train.bin and OUT/val.bin (headerless token ids, uint16 where the vocabulary
fits, else uint32) and OUT/meta.json (vocab size, dtype, tokenizer, token counts, source
files); a Hugging Face tokenizer's tokenizer.json is copied beside them. The files are
read in chunks cut at line ends, never whole; the last `--val-fraction` of the text (by
bytes, over the files in the order given) is the held-out part.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.data.text import Bytes, Chars, Codec, hf_tokenizer  # noqa: E402
from trainer.errors import ConfigError  # noqa: E402

CHUNK = 1 << 20  # bytes of text per read


def chunks(files: list[Path], val_from: int) -> Iterator[tuple[bytes, bool]]:
    """(text, is_val) pieces of the files in order, cut after a newline (never inside a
    character), split where the byte position `val_from` falls."""
    pos = 0
    for file in files:
        with open(file, "rb") as f:
            rest = b""
            while True:
                block = f.read(CHUNK)
                data = rest + block
                if not data:
                    break
                cut = data.rfind(b"\n") + 1 if block else len(data)
                if not cut and len(data) > 8 * CHUNK:  # a very long line: cut between characters
                    cut = next(i for i in range(len(data) - 1, 0, -1) if data[i] & 0xC0 != 0x80)
                piece, rest = (data[:cut], data[cut:]) if cut else (b"", data)
                if not piece:
                    continue
                if pos < val_from < pos + len(piece):  # the split falls in this piece
                    at = piece.find(b"\n", val_from - pos) + 1 or len(piece)
                    yield piece[:at], False
                    yield piece[at:], True
                else:
                    yield piece, pos >= val_from
                pos += len(piece)


def build_codec(spec: str, files: list[Path]) -> Codec:
    if spec == "bytes":
        return Bytes()
    if spec == "char":  # one pass to find the characters
        seen: set[str] = set()
        for piece, _ in chunks(files, val_from=sum(f.stat().st_size for f in files)):
            seen.update(piece.decode("utf-8"))
        return Chars("".join(seen))
    return hf_tokenizer(spec)


def prepare(files: list[Path], out: Path, tokenizer: str, val_fraction: float) -> dict:
    for f in files:
        if not f.is_file():
            raise ConfigError(f"text file {f} does not exist")
    if not 0 <= val_fraction < 1:
        raise ConfigError(f"--val-fraction {val_fraction} must be from 0 to below 1")
    total = sum(f.stat().st_size for f in files)
    if total == 0:
        raise ConfigError(f"the text files ({', '.join(map(str, files))}) are empty")
    codec = build_codec(tokenizer, files)
    dtype = np.uint16 if codec.vocab_size <= 1 << 16 else np.uint32
    out.mkdir(parents=True, exist_ok=True)
    counts = {"train": 0, "val": 0}
    val_from = total - int(total * val_fraction) if val_fraction else total
    with (
        open(out / "train.bin", "wb") as train,
        open(out / "val.bin", "wb") as val,
        tqdm(total=total, unit="B", unit_scale=True, desc="tokenizing") as bar,
    ):
        for piece, is_val in chunks(files, val_from):
            try:
                ids = codec.encode(piece.decode("utf-8"))
            except UnicodeDecodeError as e:
                raise ConfigError(f"the text is not UTF-8: {e}") from None
            ids.astype(dtype).tofile(val if is_val else train)
            counts["val" if is_val else "train"] += len(ids)
            bar.update(len(piece))
    if counts["train"] == 0:
        raise ConfigError("no training tokens: lower --val-fraction or give more text")
    if hasattr(codec, "save"):
        codec.save(out)
    meta = {
        "vocab_size": codec.vocab_size,
        "dtype": np.dtype(dtype).name,
        **codec.meta(),
        "tokens": counts,
        "source_files": [str(f) for f in files],
    }
    if tokenizer not in ("char", "bytes"):
        meta["tokenizer_source"] = tokenizer
    (out / "meta.json").write_text(json.dumps(meta, indent=1, ensure_ascii=False))
    return meta


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path, help="text files (UTF-8)")
    parser.add_argument("--out", type=Path, required=True, help="directory to write")
    parser.add_argument(
        "--tokenizer", default="char", help="char | bytes | a local Hugging Face tokenizer dir"
    )
    parser.add_argument("--val-fraction", type=float, default=0.1)
    args = parser.parse_args(argv)
    try:
        meta = prepare(args.files, args.out, args.tokenizer, args.val_fraction)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    t = meta["tokens"]
    print(
        f"{args.out}: {t['train']} train + {t['val']} val tokens, vocab {meta['vocab_size']} "
        f"({meta['tokenizer']}, {meta['dtype']})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
