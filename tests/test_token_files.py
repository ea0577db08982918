"""Token files (trainer/tokens.py), scripts/prepare_text.py and the bad input around them.
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

from trainer.data import make_loader
from trainer.errors import ConfigError, NotResumable
from trainer.text import Bytes, Chars, codec_from_meta, hf_tokenizer
from trainer.tokens import LLMC_HEADER, TokenData, WindowSampler, open_tokens, read_meta

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
    assert ids.max() == 69999 and Chars(meta["chars"]).decode(ids.tolist()) == wide
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
    proc = subprocess.run(
        [*script, str(tmp_path / "missing.txt"), "--out", str(tmp_path / "o")],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"error: text file {tmp_path / 'missing.txt'} does not exist"
    ]
