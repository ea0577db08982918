"""Text <-> token ids for the three tokenizers `scripts/prepare_text.py` knows, and back
from what it wrote (`meta.json`, `tokenizer.json`) or what nanoGPT wrote (`meta.pkl`).

- char: the sorted set of characters of the text (nanoGPT's character-level example); the
  characters are kept in meta.json.
- bytes: UTF-8 bytes, vocabulary 256; nothing to keep.
- hf: a Hugging Face tokenizer from a local directory, run by the `tokenizers` library;
  its `tokenizer.json` is copied beside the tokens.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from trainer.errors import ConfigError


class Codec:
    """encode(text) -> ids (1-D int64 array), decode(ids) -> text, and its vocab_size."""

    kind = ""
    vocab_size = 0

    def encode(self, text: str) -> np.ndarray:
        raise NotImplementedError

    def decode(self, ids: list[int]) -> str:
        raise NotImplementedError

    def meta(self) -> dict[str, Any]:
        """What meta.json records of it (decode needs it back)."""
        return {"tokenizer": self.kind}


class Bytes(Codec):
    kind, vocab_size = "bytes", 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


class Chars(Codec):
    kind = "char"

    def __init__(self, chars: str) -> None:
        self.chars = "".join(sorted(set(chars)))
        self.vocab_size = len(self.chars)
        self._points = np.array([ord(c) for c in self.chars], dtype=np.int64)  # sorted

    def encode(self, text: str) -> np.ndarray:
        points = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32).astype(np.int64)
        ids = np.searchsorted(self._points, points)  # (n,) index of each character
        unknown = self._points[ids.clip(max=self.vocab_size - 1)] != points
        if unknown.any():
            c = chr(points[unknown.argmax()])
            raise ConfigError(f"character {c!r} is not in the character vocabulary")
        return ids

    def decode(self, ids: list[int]) -> str:
        # An id past the characters (a model with a padded vocabulary) shows as U+FFFD,
        # as an invalid byte does for Bytes.
        n = self.vocab_size
        return "".join(self.chars[i] if 0 <= i < n else "\ufffd" for i in ids)

    def meta(self) -> dict[str, Any]:
        return {"tokenizer": self.kind, "chars": self.chars}


class HF(Codec):
    kind = "hf"

    def __init__(self, tokenizer: Any) -> None:  # a tokenizers.Tokenizer
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.tokenizer.encode(text, add_special_tokens=False).ids, dtype=np.int64)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def save(self, directory: Path) -> None:
        self.tokenizer.save(str(Path(directory) / "tokenizer.json"))


def hf_tokenizer(directory: str | Path) -> HF:
    """The tokenizer of a local directory: its tokenizer.json, or (a model directory with
    only vocab files) the fast tokenizer transformers builds from them. Nothing is
    downloaded."""
    path = Path(directory).expanduser()
    if path.is_file():
        raise ConfigError(
            f"tokenizer {directory} is a file; give the directory that holds its tokenizer.json"
        )
    if not path.is_dir():
        raise ConfigError(
            f"tokenizer {directory} is not char, bytes or a local directory (nothing is "
            "downloaded: save the tokenizer with save_pretrained and give its directory)"
        )
    if (path / "tokenizer.json").is_file():
        return HF(read_tokenizer_file(path / "tokenizer.json"))
    try:
        from transformers import AutoTokenizer

        fast = AutoTokenizer.from_pretrained(str(path), local_files_only=True, use_fast=True)
        return HF(fast.backend_tokenizer)
    except Exception:
        raise ConfigError(
            f"tokenizer directory {directory} holds no tokenizer (no tokenizer.json, nor "
            "vocabulary files transformers can read)"
        ) from None


def read_tokenizer_file(path: Path) -> Any:
    """A `tokenizers.Tokenizer` from a tokenizer.json, or one line saying why not."""
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # the library raises a bare Exception with serde's message
        raise ConfigError(
            f"{path} is not a tokenizer the tokenizers library can read ({str(e).strip()}); "
            "write it with tokenizer.save_pretrained(DIR) or Tokenizer.save(PATH)"
        ) from None


def eos_token(directory: str | Path, tokenizer: Any) -> str | None:
    """The end-of-text token a Hugging Face tokenizer directory names: `eos_token` of its
    tokenizer_config.json or special_tokens_map.json, if the tokenizer knows it."""
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        file = Path(directory).expanduser() / name
        if not file.is_file():
            continue
        try:
            eos = json.loads(file.read_text(encoding="utf-8")).get("eos_token")
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
            raise ConfigError(f"{file} is not a JSON object ({e})") from None
        if isinstance(eos, dict):  # an AddedToken written out: {"content": "</s>", ...}
            eos = eos.get("content")
        if isinstance(eos, str) and tokenizer.token_to_id(eos) is not None:
            return eos
    return None


def codec_from_meta(meta: dict[str, Any], directory: Path) -> Codec | None:
    """The codec that wrote a token directory, from its meta.json or nanoGPT's meta.pkl;
    None when it cannot be told (token ids are then shown as numbers)."""
    kind = meta.get("tokenizer")
    if kind == "bytes":
        return Bytes()
    if kind == "char":
        return Chars(meta["chars"])
    if kind == "hf" and (Path(directory) / "tokenizer.json").is_file():
        return HF(read_tokenizer_file(Path(directory) / "tokenizer.json"))
    itos = meta.get("itos")  # nanoGPT's shakespeare_char: {id: character}
    if isinstance(itos, dict) and all(isinstance(v, str) for v in itos.values()):
        return Chars("".join(itos[i] for i in sorted(itos)))
    return None
