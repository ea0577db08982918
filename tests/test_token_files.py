"""Token files (trainer/data/tokens.py), scripts/prepare_text.py and the bad input around them.
No processes: every file is written here, read back and compared exactly."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import warm_cli

from trainer.data.datasets import make_loader
from trainer.data.text import Bytes, Chars, codec_from_meta, hf_tokenizer
from trainer.data.tokens import LLMC_HEADER, TokenData, WindowSampler, open_tokens, read_meta
from trainer.errors import ConfigError, NotResumable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from prepare_text import prepare  # noqa: E402

TEXT = "".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(400))


def _llmc(path: Path, tokens: np.ndarray, magic: int, count: int | None = None) -> None:
    header = np.zeros(LLMC_HEADER, dtype=np.int32)
    header[:3] = magic, 1 if magic == 20240520 else 2, len(tokens) if count is None else count
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(tokens.tobytes())


# -- formats read back exactly --------------------------------------------------------------


def test_nanogpt_bin_and_meta_pkl(tmp_path):
    ids = np.arange(1000, dtype=np.uint16) % 65
    ids.tofile(tmp_path / "train.bin")
    ids[:300].tofile(tmp_path / "val.bin")
    itos = {i: chr(32 + i) for i in range(65)}
    with open(tmp_path / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": 65, "itos": itos, "stoi": {c: i for i, c in itos.items()}}, f)
    data = TokenData(dir=str(tmp_path), block_size=8)
    assert data.vocab_size == 65 and data.tokens == 1000
    assert np.array_equal(data.read(0, 1000), ids)
    x, y = data[5]
    assert x.tolist() == ids[5:13].tolist() and y.tolist() == ids[6:14].tolist()
    held_out = TokenData(dir=str(tmp_path), block_size=8, train=False)
    assert len(held_out) == 300 // 9 and held_out[1][0].tolist() == ids[9:17].tolist()
    assert codec_from_meta(read_meta(tmp_path), tmp_path).decode([0, 1]) == " !"


def test_meta_pkl_with_an_object_is_not_unpickled(tmp_path):
    with open(tmp_path / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": 65, "x": Path("/")}, f)  # a class: refused, never imported
    with pytest.raises(ConfigError, match="only plain data is read"):
        read_meta(tmp_path)


@pytest.mark.parametrize("magic, dtype", [(20240520, np.uint16), (20240801, np.uint32)])
def test_llmc_shards_both_dtypes_as_one_stream(tmp_path, magic, dtype):
    a = (np.arange(500) * 7 % 70000).astype(dtype) if dtype == np.uint32 else np.arange(500) % 9
    a, b = a.astype(dtype), (np.arange(300) % 11).astype(dtype)
    _llmc(tmp_path / "s_train_000.bin", a, magic)
    _llmc(tmp_path / "s_train_001.bin", b, magic)
    assert open_tokens(tmp_path / "s_train_000.bin").dtype == dtype
    data = TokenData(path=str(tmp_path / "s_train_*.bin"), block_size=16)
    assert data.tokens == 800
    assert np.array_equal(data.read(0, 800), np.concatenate([a, b]))  # no header inside
    x, _ = data[495]  # a window across the two files
    assert x.tolist() == np.concatenate([a, b])[495:511].tolist()


def test_npy_shards_and_our_own_files(tmp_path):
    ids = (np.arange(2000) % 300).astype(np.uint16)
    np.save(tmp_path / "shard_0.npy", ids[:1200])
    np.save(tmp_path / "shard_1.npy", ids[1200:])
    assert np.array_equal(TokenData(path=str(tmp_path / "*.npy"), block_size=4).read(0, 2000), ids)

    (tmp_path / "a.txt").write_text(TEXT)
    meta = prepare([tmp_path / "a.txt"], tmp_path / "char", "char", 0.1)
    chars = Chars(meta["chars"])
    train = np.fromfile(tmp_path / "char" / "train.bin", dtype=meta["dtype"])
    val = np.fromfile(tmp_path / "char" / "val.bin", dtype=meta["dtype"])
    assert chars.decode(np.concatenate([train, val]).tolist()) == TEXT  # nothing lost
    assert meta["tokens"] == {"train": len(train), "val": len(val)}
    assert 0.09 < len(val) / len(TEXT) < 0.11 and chars.decode(val.tolist()).startswith("line")
    assert TokenData(dir=str(tmp_path / "char"), block_size=8).vocab_size == chars.vocab_size


def test_prepare_bytes_hf_and_uint32(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    (tmp_path / "a.txt").write_text(TEXT)
    meta = prepare([tmp_path / "a.txt"], tmp_path / "b", "bytes", 0.0)
    assert meta["vocab_size"] == 256 and meta["tokens"]["val"] == 0
    assert (
        np.fromfile(tmp_path / "b" / "train.bin", np.uint16).tobytes()
        == np.frombuffer(TEXT.encode(), np.uint8).astype(np.uint16).tobytes()
    )

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok.train(
        [str(tmp_path / "a.txt")], trainers.BpeTrainer(vocab_size=300, initial_alphabet=alphabet)
    )
    (tmp_path / "tok").mkdir()
    tok.save(str(tmp_path / "tok" / "tokenizer.json"))
    meta = prepare([tmp_path / "a.txt"], tmp_path / "hf", str(tmp_path / "tok"), 0.1)
    codec = codec_from_meta(read_meta(tmp_path / "hf"), tmp_path / "hf")
    ids = [np.fromfile(tmp_path / "hf" / f, np.uint16) for f in ("train.bin", "val.bin")]
    assert codec.decode(np.concatenate(ids).tolist()) == TEXT
    assert meta["vocab_size"] == 300

    wide = "".join(chr(0x10000 + i) for i in range(70000))  # more characters than uint16 holds
    (tmp_path / "wide.txt").write_text(wide)
    meta = prepare([tmp_path / "wide.txt"], tmp_path / "wide", "char", 0.0)
    assert meta["dtype"] == "uint32"
    ids = np.fromfile(tmp_path / "wide" / "train.bin", np.uint32)
    # id 0 is the separator "\n": in the vocabulary though one file needs none
    assert meta["chars"][0] == "\n" and ids.min() == 1 and ids.max() == 70000
    assert Chars(meta["chars"]).decode(ids.tolist()) == wide
    assert Bytes().decode(Bytes().encode("é").tolist()) == "é"


# -- windows drawn from (seed, step) ----------------------------------------------------------


@pytest.mark.parametrize("world", [1, 2, 4])
def test_ranks_take_disjoint_parts_of_the_one_process_batch(world):
    tokens, window, batch = 10_000, 17, 16
    one = WindowSampler(tokens, window, batch, 0, 1, seed=3)
    ranks = [iter(WindowSampler(tokens, window, batch, r, world, seed=3)) for r in range(world)]
    for step in range(5):
        whole = one.starts(step).tolist()
        parts = [next(it) for it in ranks]
        assert sum(parts, []) == whole  # rank order concatenated: the one-process batch
        covered = np.concatenate([np.arange(s, s + window) for s in whole])
        assert len(np.unique(covered)) == len(covered)  # no token in two windows of a step
        assert max(whole) + window <= tokens


def test_resumed_sampler_continues_exactly_in_another_world_size():
    two = WindowSampler(5000, 9, 8, 1, 2, seed=0)
    for _ in zip(range(3), iter(two), strict=False):  # three steps taken
        pass
    state = two.state_dict()
    assert state["step"] == 3
    four = [WindowSampler(5000, 9, 8, r, 4, seed=0) for r in range(4)]
    for s in four:
        s.load_state_dict(state)
    assert sum((next(iter(s)) for s in four), []) == two.starts(3).tolist()
    with pytest.raises(ConfigError, match="window=9 but this run has window=5"):
        WindowSampler(5000, 5, 8, 0, 1, seed=0).load_state_dict(state)


def test_the_sampler_state_says_what_the_data_is(tmp_path):
    ids = (np.arange(100_000) * 7919 % 50_000).astype(np.uint16)
    ids.tofile(tmp_path / "train.bin")
    saved = TokenData(dir=str(tmp_path), block_size=8).batch_sampler(4, 0, 1, seed=0)
    state = saved.state_dict()
    assert state["data"]["files"] == [str((tmp_path / "train.bin").resolve())]
    assert state["data"]["tokens"] == 100_000

    def sampler(path: str) -> WindowSampler:
        return TokenData(path=path, block_size=8).batch_sampler(4, 0, 1, seed=0)

    # The same ids elsewhere, as uint32, cut into two shards: the same data
    (tmp_path / "copy").mkdir()
    ids[:30_001].astype(np.uint32).tofile(tmp_path / "copy" / "a.bin")
    ids[30_001:].astype(np.uint32).tofile(tmp_path / "copy" / "b.bin")
    (tmp_path / "copy" / "meta.json").write_text(json.dumps({"dtype": "uint32"}))
    same = sampler(str(tmp_path / "copy" / "*.bin"))
    same.load_state_dict({**state, "step": 5})
    assert same.step == 5
    # One id changed in a piece the fingerprint reads; the count is the same
    other = ids.copy()
    other[-1] += 1
    other.tofile(tmp_path / "other.bin")
    with pytest.raises(NotResumable) as e:
        sampler(str(tmp_path / "other.bin")).load_state_dict(state)
    assert str(e.value) == (
        f"the token data {(tmp_path / 'other.bin').resolve()} (100,000 tokens, fingerprint "
        f"{sampler(str(tmp_path / 'other.bin')).data['fingerprint']}) is not the data the "
        f"checkpoint was trained on, {(tmp_path / 'train.bin').resolve()} (100,000 tokens, "
        f"fingerprint {state['data']['fingerprint']}): the data order would not continue; "
        "resume with data.dir or data.path naming that data, or start a fresh run in a new "
        "hydra.run.dir (without resume)"
    )
    # A state saved without the data's identity still loads (its count is checked)
    old = {k: v for k, v in state.items() if k != "data"}
    sampler(str(tmp_path / "other.bin")).load_state_dict(old)


def test_loader_yields_the_sampler_windows(tmp_path):
    ids = (np.arange(3000) % 50).astype(np.uint16)
    ids.tofile(tmp_path / "train.bin")
    data = TokenData(dir=str(tmp_path), block_size=8)
    loader = make_loader(data, 4, rank=1, world_size=2, seed=5)
    x, y = next(iter(loader))
    starts = loader.batch_sampler.starts(0)[2:4]
    assert x.dtype == torch.int64 and x.shape == (2, 8)
    assert x.tolist() == [ids[s : s + 8].tolist() for s in starts]
    assert torch.equal(x[:, 1:], y[:, :-1])


# -- bad input: one line each ----------------------------------------------------------------


def _bad(tmp_path: Path) -> list[tuple[dict, str]]:
    (tmp_path / "empty.bin").write_bytes(b"")
    (tmp_path / "odd.bin").write_bytes(b"\x01\x02\x03")
    (tmp_path / "short").mkdir()
    np.arange(5, dtype=np.uint16).tofile(tmp_path / "short" / "train.bin")
    _llmc(tmp_path / "count.bin", np.arange(10, dtype=np.uint16), 20240520, count=12)
    np.arange(10, dtype=np.uint16).tofile(tmp_path / "plain.bin")
    (tmp_path / "meta").mkdir()
    np.arange(10, dtype=np.uint16).tofile(tmp_path / "meta" / "train.bin")
    (tmp_path / "meta" / "meta.json").write_text(json.dumps({"dtype": "uint16"}))
    return [
        ({"path": str(tmp_path / "nope.bin")}, "nope.bin does not exist"),
        ({"path": str(tmp_path / "x*.bin")}, "matches no file"),
        ({"path": str(tmp_path / "empty.bin")}, "empty.bin is empty"),
        ({"dir": str(tmp_path / "none")}, "is not a directory"),
        ({}, "needs one of data.dir=DIR or data.path"),
        ({"path": str(tmp_path / "odd.bin")}, "not a whole number of uint16 tokens"),
        ({"path": str(tmp_path / "count.bin")}, "header says 12 tokens but the file holds 10"),
        ({"path": str(tmp_path / "plain.bin"), "format": "llmc"}, "is not an llm.c shard"),
        ({"path": str(tmp_path / "count.bin"), "dtype": "uint32"}, "does not match llm.c"),
        ({"dir": str(tmp_path / "meta"), "dtype": "uint32"}, "does not match"),
        ({"path": str(tmp_path / "plain.bin"), "dtype": "int8"}, "data.dtype=int8 is not one"),
        ({"path": str(tmp_path / "plain.bin"), "format": "csv"}, "data.format=csv is not"),
    ]


def test_bad_token_files_are_one_line_each(tmp_path):
    for kwargs, needle in _bad(tmp_path):
        with pytest.raises(ConfigError, match=needle.replace("*", r"\*")) as e:
            TokenData(block_size=8, **kwargs)
        assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="fewer than one window of data.block_size"):
        len(TokenData(dir=str(tmp_path / "short"), block_size=8))
    with pytest.raises(ConfigError, match="no held-out tokens"):
        TokenData(path=str(tmp_path / "plain.bin"), train=False)
    with pytest.raises(ConfigError, match="has no val.bin"):
        TokenData(dir=str(tmp_path / "short"), train=False)
    with pytest.raises(ConfigError, match="fewer than train.batch_size=8"):
        TokenData(path=str(tmp_path / "plain.bin"), block_size=2).batch_sampler(8, 0, 1, 0)


def test_bad_tokenizers_and_text(tmp_path):
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(ConfigError, match="holds no tokenizer"):
        hf_tokenizer(tmp_path / "empty_dir")
    with pytest.raises(ConfigError, match="is not char, bytes or a local directory"):
        hf_tokenizer("gpt2")
    script = [sys.executable, str(ROOT / "scripts" / "prepare_text.py")]
    proc = warm_cli.command([*script, str(tmp_path / "missing.txt"), "--out", str(tmp_path / "o")])
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"error: text file {tmp_path / 'missing.txt'} does not exist"
    ]


@pytest.mark.parametrize(
    "content, needle",
    [
        ("{bad", "is not JSON (Expecting property name enclosed in double quotes at line 1"),
        ("[1, 2]", "holds a JSON list, not an object"),
        ('{"vocab_size": "65"}', "vocab_size '65' must be a whole number >= 1"),
        ('{"vocab_size": true}', "vocab_size True must be a whole number >= 1"),
        ('{"vocab_size": 0}', "vocab_size 0 must be a whole number >= 1"),
        ('{"dtype": "int8"}', "dtype 'int8' is not one of uint16, uint32"),
        ('{"vocab_size": 70000}', "vocab_size 70000 does not fit dtype uint16"),
        ('{"tokenizer": "gpt2"}', "tokenizer 'gpt2' is not one of char, bytes, hf"),
        ('{"tokenizer": "char"}', 'tokenizer "char" needs "chars"'),
        ('{"tokenizer": "char", "chars": "ba"}', "chars must be distinct characters in sorted"),
        ('{"tokenizer": "char", "chars": "aa"}', "chars must be distinct characters in sorted"),
    ],
    ids=lambda v: str(v)[:24],
)
def test_meta_json_is_checked_field_by_field(tmp_path, content, needle):
    np.arange(10, dtype=np.uint16).tofile(tmp_path / "train.bin")
    (tmp_path / "meta.json").write_text(content)
    with pytest.raises(ConfigError) as e:
        TokenData(dir=str(tmp_path), block_size=4)
    assert str(e.value).startswith(f"{tmp_path / 'meta.json'}")
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_meta_json_without_fields_and_meta_pkl_that_is_not_one(tmp_path):
    np.arange(10, dtype=np.uint16).tofile(tmp_path / "train.bin")
    (tmp_path / "meta.json").write_text("{}")  # nothing known: the defaults
    assert TokenData(dir=str(tmp_path), block_size=4).data_vocab_size() == 10
    # a vocabulary padded past the characters (as nanoGPT pads GPT-2's to 50304): the ids
    # past them decode as U+FFFD
    padded = {"tokenizer": "char", "chars": "".join(map(chr, range(65, 75))), "vocab_size": 64}
    (tmp_path / "meta.json").write_text(json.dumps(padded))
    assert TokenData(dir=str(tmp_path), block_size=4).data_vocab_size() == 64
    assert codec_from_meta(read_meta(tmp_path), tmp_path).decode([0, 9, 63]) == "AJ\ufffd"
    (tmp_path / "meta.json").unlink()
    (tmp_path / "meta.pkl").write_bytes(b"")  # EOFError from pickle
    with pytest.raises(ConfigError, match="meta.pkl is not a readable pickle"):
        TokenData(dir=str(tmp_path), block_size=4)


def _prepare_cli(*args: str) -> subprocess.CompletedProcess:
    script = [sys.executable, str(ROOT / "scripts" / "prepare_text.py")]
    return warm_cli.command([*script, *map(str, args)])


def test_prepare_text_bad_input_is_one_line_and_writes_nothing(tmp_path):
    (tmp_path / "latin.txt").write_bytes("line one\ncafé naïve\n".encode("latin-1"))
    (tmp_path / "bom16.txt").write_text("hello\n", encoding="utf-16")
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "a.txt").write_text(TEXT)
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    (tmp_path / "no_model").mkdir()
    (tmp_path / "no_model" / "tokenizer.json").write_text('{"version": "1.0"}')
    cases = [
        (["latin.txt"], f"{tmp_path / 'latin.txt'} is not utf-8: byte 12 (line 2) is 0xe9 "
         "(invalid continuation byte); give its encoding (--encoding latin-1"),
        (["bom16.txt"], "byte 0 (line 1) is 0xff (invalid start byte); give its encoding "
         "(--encoding utf-16: the file starts with a UTF-16 byte order mark)"),
        (["latin.txt", "--tokenizer", "bytes"], "latin.txt is not utf-8: byte 12 (line 2)"),
        (["a.txt", "--tokenizer", tmp_path / "broken"], f"{tmp_path / 'broken' / 'tokenizer.json'}"
         " is not a tokenizer the tokenizers library can read (EOF while parsing"),
        (["a.txt", "--tokenizer", tmp_path / "no_model"], "is not a tokenizer the tokenizers "
         "library can read (Model missing."),
        (["a.txt", "--tokenizer", tmp_path / "no_model" / "tokenizer.json"], "is a file; give "
         "the directory that holds its tokenizer.json"),
        (["empty.txt"], f"the text files ({tmp_path / 'empty.txt'}) are empty"),
        ([tmp_path], f"text file {tmp_path} is a directory; give the files in it"),
        (["a.txt", "--encoding", "utf-9"], "--encoding utf-9 is not an encoding Python knows"),
        (["a.txt", "--separator", "\\x"], "--separator '\\\\x' has a bad escape"),
    ]  # fmt: skip
    for args, needle in cases:
        files = [tmp_path / a if isinstance(a, str) and a.endswith(".txt") else a for a in args]
        proc = _prepare_cli(*files, "--out", tmp_path / "out")
        assert proc.returncode == 2, proc.stderr[-2000:]
        [line] = proc.stderr.splitlines()  # no traceback, no progress bar
        assert line.startswith("error: ") and needle in line, line
        assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
    (tmp_path / "file").write_text("keep me")
    proc = _prepare_cli(tmp_path / "a.txt", "--out", tmp_path / "file")
    assert proc.stderr.splitlines() == [f"error: --out {tmp_path / 'file'} is a file; give a "
                                        "directory to write the tokens into"]  # fmt: skip


def test_prepare_text_encoding_and_counted_replacement(tmp_path):
    text = "line one\ncafé naïve\n" * 3
    (tmp_path / "latin.txt").write_bytes(text.encode("latin-1"))
    proc = _prepare_cli(tmp_path / "latin.txt", "--out", tmp_path / "lat", "--encoding", "latin-1")
    assert proc.returncode == 0, proc.stderr
    meta = json.loads((tmp_path / "lat" / "meta.json").read_text())
    assert meta["encoding"] == "latin-1" and meta["replaced_bytes"] == 0 and "é" in meta["chars"]
    ids = [np.fromfile(tmp_path / "lat" / f, np.uint16) for f in ("train.bin", "val.bin")]
    assert Chars(meta["chars"]).decode(np.concatenate(ids).tolist()) == text

    proc = _prepare_cli(tmp_path / "latin.txt", "--out", tmp_path / "rep", "--errors", "replace")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith(", 6 undecodable bytes replaced"), proc.stdout
    meta = json.loads((tmp_path / "rep" / "meta.json").read_text())
    assert meta["replaced_bytes"] == 6  # é and ï, three times: one byte each in latin-1
    ids = [np.fromfile(tmp_path / "rep" / f, np.uint16) for f in ("train.bin", "val.bin")]
    got = Chars(meta["chars"]).decode(np.concatenate(ids).tolist())
    assert got == text.replace("é", "\ufffd").replace("ï", "\ufffd")


def _hf_tokenizer_dir(path: Path, text_file: Path, eos: bool) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>"] if eos else []
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=special
    )
    tok.train([str(text_file)], trainer)
    kwargs = {"eos_token": "<|endoftext|>"} if eos else {}
    PreTrainedTokenizerFast(tokenizer_object=tok, **kwargs).save_pretrained(path)


def test_separator_between_files(tmp_path):
    one, two = "first file, no newline at its end", "second file\n"
    (tmp_path / "1.txt").write_text(one)
    (tmp_path / "2.txt").write_text(two)
    files = [tmp_path / "1.txt", tmp_path / "2.txt"]

    def stream(out: Path, meta: dict) -> np.ndarray:
        ids = [np.fromfile(out / f, meta["dtype"]) for f in ("train.bin", "val.bin")]
        return np.concatenate(ids)

    for tokenizer, option, between in [
        ("char", "auto", "\n"),
        ("char", "none", ""),
        ("char", "\\n\\n", "\n\n"),  # as typed in a shell: escapes read
        ("char", "<doc>", "<doc>"),
        ("bytes", "auto", "\n"),
    ]:
        out = tmp_path / f"{tokenizer}_{len(between)}"
        meta = prepare(files, out, tokenizer, 0.2, separator=option)
        codec = codec_from_meta(read_meta(out), out)
        assert codec.decode(stream(out, meta).tolist()) == one + between + two
        assert meta["separator"] == (between or None)
        assert meta["separator_ids"] == codec.encode(between).tolist()
        if tokenizer == "char":
            assert set(between) <= set(meta["chars"])  # the vocabulary holds the separator
        assert TokenData(dir=str(out), block_size=4).data_vocab_size() == meta["vocab_size"]

    (tmp_path / "train.txt").write_text(TEXT)
    _hf_tokenizer_dir(tmp_path / "tok", tmp_path / "train.txt", eos=True)
    meta = prepare(files, tmp_path / "hf", str(tmp_path / "tok"), 0.0)
    ids = stream(tmp_path / "hf", meta)
    eos = hf_tokenizer(tmp_path / "tok").tokenizer.token_to_id("<|endoftext|>")
    assert meta["separator"] == "<|endoftext|>" and meta["separator_ids"] == [eos]
    assert ids.tolist().count(eos) == 1  # between the two files, once
    codec = codec_from_meta(read_meta(tmp_path / "hf"), tmp_path / "hf")
    assert codec.decode(ids.tolist()) == one + "<|endoftext|>" + two

    _hf_tokenizer_dir(tmp_path / "tok_no_eos", tmp_path / "train.txt", eos=False)
    proc = _prepare_cli(*files, "--out", tmp_path / "hf2", "--tokenizer", tmp_path / "tok_no_eos")
    assert proc.returncode == 0, proc.stderr
    assert "separator '\\n' (the tokenizer names no EOS token) between files" in proc.stdout
    meta = json.loads((tmp_path / "hf2" / "meta.json").read_text())
    codec = codec_from_meta(meta, tmp_path / "hf2")
    assert codec.decode(stream(tmp_path / "hf2", meta).tolist()) == one + "\n" + two
