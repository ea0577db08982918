"""scripts/prepare_text.py on corpora of records (trainer/data/corpus.py): parquet, JSON lines
(plain, gzip, zstd), save_to_disk and dataset repository directories give the same token
files, whatever the worker count; llm.c shards with their headers; the `.docs.npy` document
starts; the held-out split by whole documents; each bad input one line with nothing written.
The expected tokens and offsets are computed here from the documents, one by one."""

from __future__ import annotations

import gzip
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from trainer.data import corpus
from trainer.data.corpus import encode_in_order
from trainer.data.text import Chars
from trainer.data.tokens import TokenData, open_tokens
from trainer.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from prepare_text import main, prepare  # noqa: E402

EOS = "<|endoftext|>"
SHARD = 1025  # the smallest shard: many shards from a small corpus


def _documents() -> list[str]:
    rng = np.random.default_rng(0)
    words = ["the", "fox", "naïve", "café", "猫", "jumps", "over", "\n", "dog", "a", "é"]
    docs = []
    for i in range(400):
        n = int(rng.integers(0, 60)) if i % 37 else 0  # now and then an empty text
        docs.append(" ".join(words[int(k)] for k in rng.integers(0, len(words), n)))
    return docs


DOCS = _documents()


@pytest.fixture(scope="module")
def forms(tmp_path_factory) -> dict:
    """The same documents as each input form, and a Hugging Face tokenizer (with an EOS
    token) trained on them."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    root = tmp_path_factory.mktemp("corpus")
    half = len(DOCS) // 2
    ids = list(range(len(DOCS)))
    # two parquet files with another column beside the text, small row groups
    pq.write_table(pa.table({"id": ids[:half], "text": DOCS[:half]}), root / "a.parquet", 50)
    pq.write_table(pa.table({"id": ids[half:], "text": DOCS[half:]}), root / "b.parquet", 50)
    lines = "".join(json.dumps({"text": d, "n": i}) + "\n" for i, d in enumerate(DOCS)).encode()
    (root / "c.jsonl").write_bytes(lines)
    (root / "c.jsonl.gz").write_bytes(gzip.compress(lines))
    (root / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines))
    datasets.Dataset.from_dict({"text": DOCS}).save_to_disk(str(root / "saved"))
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_dict({"text": DOCS}),
         "test": datasets.Dataset.from_dict({"text": DOCS[:3]})}
    ).save_to_disk(str(root / "saved_dict"))  # fmt: skip
    repo = root / "repo" / "data"  # a dataset repository as cloned: its splits by file name
    repo.mkdir(parents=True)
    pq.write_table(pa.table({"text": DOCS[:half]}), repo / "train-00000-of-00002.parquet")
    pq.write_table(pa.table({"text": DOCS[half:]}), repo / "train-00001-of-00002.parquet")
    pq.write_table(pa.table({"text": DOCS[:5]}), repo / "test-00000-of-00001.parquet")

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[EOS]
    )
    tok.train_from_iterator(DOCS, trainer)
    (root / "tok").mkdir()
    tok.save(str(root / "tok" / "tokenizer.json"))
    (root / "tok" / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS}))
    return {
        "root": root,
        "tok": root / "tok",
        "tokenizer": tok,
        "inputs": {
            "parquet": [root / "a.parquet", root / "b.parquet"],
            "glob": [str(root / "*.parquet")],
            "jsonl": [root / "c.jsonl"],
            "gz": [root / "c.jsonl.gz"],
            "zst": [root / "c.jsonl.zst"],
            "save_to_disk": [root / "saved"],
            "save_to_disk_dict": [root / "saved_dict"],
            "repo": [root / "repo"],
        },
    }


def _expected(docs: list[str], encode, sep: list[int], f: float) -> dict:
    """Each split's token stream and the offsets of its documents' first tokens, document
    by document: document i held out when floor((i + 1) f) > floor(i f), empty ones left
    out, the separator between consecutive documents of a split."""
    streams: dict[str, list[int]] = {"train": [], "val": []}
    starts: dict[str, list[int]] = {"train": [], "val": []}
    for i, doc in enumerate(docs):
        ids = encode(doc)
        if not ids:
            continue
        split = "val" if math.floor((i + 1) * f) > math.floor(i * f) else "train"
        if starts[split]:
            streams[split] += sep
        starts[split].append(len(streams[split]))
        streams[split] += ids
    return {"streams": streams, "starts": starts}


def _files(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())}


def _check_shards(out: Path, want: dict, shard: int, magic: int, version: int) -> None:
    """The shards hold the expected streams cut every `shard` tokens, with llm.c's header,
    and each .docs.npy the expected starts that fall in its shard."""
    for split in ("train", "val"):
        stream, starts = np.array(want["streams"][split]), np.array(want["starts"][split])
        count = -(-len(stream) // shard)
        names = sorted(p.name for p in out.glob(f"{split}_*.bin"))
        assert names == [f"{split}_{k:06d}.bin" for k in range(count)]
        for k, name in enumerate(names):
            header = np.fromfile(out / name, dtype="<i4", count=256)
            part = stream[k * shard : (k + 1) * shard]
            assert header[:3].tolist() == [magic, version, len(part)] and not header[3:].any()
            assert np.array_equal(open_tokens(out / name), part)
            docs = np.load(out / name.replace(".bin", ".docs.npy"))
            assert docs.dtype == np.int64 and docs.ndim == 1
            inside = starts[(starts >= k * shard) & (starts < (k + 1) * shard)] - k * shard
            assert docs.tolist() == inside.tolist(), (name, docs[:5], inside[:5])


def test_every_input_form_gives_the_same_files(forms, tmp_path):
    tok = forms["tokenizer"]
    eos = tok.token_to_id(EOS)
    want = _expected(DOCS, lambda d: tok.encode(d, add_special_tokens=False).ids, [eos], 0.25)
    first = None
    for name, inputs in forms["inputs"].items():
        out = tmp_path / name
        meta = prepare(inputs, out, str(forms["tok"]), 0.25, shard_tokens=SHARD)
        files = _files(out)
        if first is None:
            first = files
            _check_shards(out, want, SHARD, 20240520, 1)
            assert meta["tokens"] == {s: len(want["streams"][s]) for s in ("train", "val")}
            assert meta["documents"] == {s: len(want["starts"][s]) for s in ("train", "val")}
            assert meta["empty_documents"] == sum(not d for d in DOCS) > 0
            assert meta["separator_ids"] == [eos] and meta["shard_tokens"] == SHARD
            train = TokenData(dir=str(out), block_size=8)
            val = TokenData(dir=str(out), block_size=8, train=False)
            assert train.read(0, train.tokens).tolist() == want["streams"]["train"]
            assert val.read(0, val.tokens).tolist() == want["streams"]["val"]
            assert train.vocab_size == tok.get_vocab_size()
        # every form: the same token files, byte for byte (meta.json says what was read)
        files.pop("meta.json")
        assert files == {k: v for k, v in first.items() if k != "meta.json"}, name
        assert meta["input"]["text_field"] == "text"
    meta = json.loads((tmp_path / "repo" / "meta.json").read_text())
    assert meta["input"]["kind"] == "parquet" and meta["input"]["split"] == "train"
    assert [Path(f).name for f in meta["input"]["files"]] == [
        "train-00000-of-00002.parquet",
        "train-00001-of-00002.parquet",
    ]
    # --split picks a split of a repository or of a DatasetDict
    for given in ("repo", "save_to_disk_dict"):
        out = tmp_path / f"{given}_test"
        meta = prepare(forms["inputs"][given], out, "bytes", 0.0, split="test")
        n = 5 if given == "repo" else 3
        stream = _expected(DOCS[:n], lambda d: list(d.encode()), [10], 0.0)["streams"]["train"]
        assert np.fromfile(out / "train.bin", np.uint16).tolist() == stream


def test_single_files_hold_the_split_with_its_document_starts(forms, tmp_path):
    out = tmp_path / "one"
    meta = prepare(forms["inputs"]["jsonl"], out, "char", 0.1, separator="<doc>")
    chars = Chars(meta["chars"])
    want = _expected(DOCS, lambda d: chars.encode(d).tolist(), chars.encode("<doc>").tolist(), 0.1)
    for split in ("train", "val"):
        ids = np.fromfile(out / f"{split}.bin", np.uint16)  # headerless, as before
        assert ids.tolist() == want["streams"][split]
        assert np.load(out / f"{split}.docs.npy").tolist() == want["starts"][split]
    held = [i for i in range(len(DOCS)) if math.floor((i + 1) * 0.1) > math.floor(i * 0.1)]
    assert meta["documents"]["val"] == sum(1 for i in held if DOCS[i]) and len(held) == 40
    assert set(meta["chars"]) == set("".join(DOCS)) | set("<doc>")


def test_text_files_get_document_starts_too(tmp_path):
    texts = ["first file\n" * 30, "second\n", "third file, cut by the held-out part\n" * 40]
    for i, t in enumerate(texts):
        (tmp_path / f"{i}.txt").write_text(t)
    files = [tmp_path / f"{i}.txt" for i in range(3)]
    out = tmp_path / "text"
    meta = prepare(files, out, "bytes", 0.3, separator="\\n\\n")
    train, val = (np.fromfile(out / f"{s}.bin", np.uint16) for s in ("train", "val"))
    whole = "\n\n".join(texts).encode()
    assert bytes(np.concatenate([train, val]).astype(np.uint8)) == whole
    # the documents start after each separator; the third starts in train and goes on in
    # val (cut at a line end), so val's file has no entry at all
    a, b = len(texts[0]) + 2, len(texts[0]) + 2 + len(texts[1]) + 2
    assert np.load(out / "train.docs.npy").tolist() == [0, a, b]
    assert np.load(out / "val.docs.npy").tolist() == []
    assert 0 < len(val) and b < len(train) and meta["documents"] == {"train": 3, "val": 0}

    sharded = tmp_path / "sharded"
    prepare(files, sharded, "bytes", 0.0, separator="\\n\\n", shard_tokens=SHARD)
    want = {"streams": {"train": list(whole), "val": []}, "starts": {"train": [0, a, b], "val": []}}
    _check_shards(sharded, want, SHARD, 20240520, 1)


def test_worker_count_changes_nothing(forms, tmp_path, monkeypatch):
    monkeypatch.setattr(corpus, "CHUNK_DOCS", 7)  # many chunks, so order can go wrong
    outs = {}
    for workers in (1, 2, 3):
        outs[workers] = tmp_path / f"w{workers}"
        prepare(forms["inputs"]["parquet"], outs[workers], str(forms["tok"]), 0.2,
                workers=workers, shard_tokens=SHARD)  # fmt: skip
    assert _files(outs[1]) == _files(outs[2]) == _files(outs[3])
    # text files, cut in pieces at line ends, go through the workers as well
    (tmp_path / "t.txt").write_text("".join(DOCS) * 40)  # several pieces of 1 MB
    for workers in (1, 2):
        prepare([tmp_path / "t.txt"], tmp_path / f"t{workers}", "char", 0.1, workers=workers)
    assert _files(tmp_path / "t1") == _files(tmp_path / "t2")


def test_the_pool_is_bounded_and_passes_a_workers_error_on(tmp_path):
    pulled = []

    def items():
        for i in range(40):
            pulled.append(i)
            yield i, ["ab" * (i + 1)]

    results = encode_in_order(items(), Chars("ab"), 2)
    tag, ids, lengths = next(results)
    # at most 2 x workers chunks handed out before the first comes back
    assert tag == 0 and len(pulled) <= 4 and ids.tolist() == [0, 1] and lengths.tolist() == [2]
    rest = list(results)
    assert [t for t, _, _ in rest] == list(range(1, 40))  # in the order given
    assert all(ids.tolist() == [0, 1] * (t + 1) for t, ids, _ in rest)

    bad = encode_in_order(((i, ["abz" if i == 5 else "ab"]) for i in range(9)), Chars("ab"), 2)
    with pytest.raises(ConfigError, match="character 'z' is not in the character vocabulary"):
        list(bad)


def test_uint32_shards_and_a_prepared_directory_replaced_as_a_whole(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    wide = [
        "".join(chr(0x10000 + i) for i in range(k, k + 1000)) for k in range(0, 70000, 1000)
    ]  # more characters than uint16 holds
    pq.write_table(pa.table({"text": wide}), tmp_path / "wide.parquet")
    out = tmp_path / "wide"
    meta = prepare([tmp_path / "wide.parquet"], out, "char", 0.0, shard_tokens=30000)
    chars = Chars(meta["chars"])
    assert meta["dtype"] == "uint32" and chars.vocab_size == 70001  # and the newline
    want = _expected(wide, lambda d: chars.encode(d).tolist(), chars.encode("\n").tolist(), 0.0)
    _check_shards(out, want, 30000, 20240801, 7)
    assert open_tokens(out / "train_000000.bin").dtype == np.uint32

    # the same corpus prepared again, otherwise: the old shards go, nothing is mixed
    meta = prepare([tmp_path / "wide.parquet"], out, "char", 0.0)
    assert sorted(p.name for p in out.iterdir()) == [
        "meta.json", "train.bin", "train.docs.npy", "val.bin", "val.docs.npy",
    ]  # fmt: skip
    assert TokenData(dir=str(out), block_size=8).tokens == len(want["streams"]["train"])


def _one_error(capsys, argv: list) -> str:
    assert main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err.replace("\r", "\n")
    assert "Traceback" not in err
    [line] = [ln for ln in err.splitlines() if ln.startswith("error:")]
    return line


def _jsonl(records: list) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in records).encode()


def test_bad_records_are_one_line_and_leave_the_prepared_directory(forms, tmp_path, capsys):
    """Each file is first prepared whole into a directory of its own, then replaced by a bad
    one and prepared again: one line, and the directory as it was (the same corpus may
    be prepared over itself, so the run goes as far as the bad record)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    root = forms["root"]
    lines = (root / "c.jsonl").read_bytes()
    whole = (root / "a.parquet").read_bytes()
    broken = bytearray(whole)
    broken[len(whole) // 3 : len(whole) // 3 + 64] = bytes(64)
    gz = gzip.compress(lines)
    # zstd cut where a block ends, after a whole line: the library's reader stops there
    # without a word, whole records missing
    z = zstandard.ZstdCompressor().compressobj()
    blocks = [z.compress(ln + b"\n") + z.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK)
              for ln in lines.splitlines()]  # fmt: skip
    # A value of another type after the library's first block (10 MB) of JSON lines: read
    # with the first block's types, it would be the string "7".
    late = _jsonl([{"text": f"doc {i} " + "x" * 90} for i in range(105_000)] + [{"text": 7}])
    nulls = tmp_path / "nulls.parquet"
    pq.write_table(pa.table({"text": ["a", None]}), nulls)
    good_zst = zstandard.ZstdCompressor().compress(lines)
    cases = [  # file name, good bytes, bad bytes, what the line says
        ("body.jsonl", lines, _jsonl([{"body": "x", "id": 1}]),
         "body.jsonl has no field 'text'; its records have 'body', 'id' (--text-field)"),
        ("int.jsonl", lines, _jsonl([{"text": "a"}, {"text": 5}]),
         "record 1 of {}: text is int (5), not a string; give --text-field"),
        ("late.jsonl", lines, late, "record 105000 of {}: text is int (7), not a string"),
        # after another JSON lines file of strings (one dataset over both would cast it)
        ("ints.jsonl", lines, _jsonl([{"text": 5}]), "record 0 of {}: text is int (5)"),
        ("null.parquet", whole, nulls.read_bytes(), "record 1 of {}: text is null, not a"),
        ("cut.parquet", whole, whole[: len(whole) // 2], "{} is not a readable parquet file "
         "(ArrowInvalid: Parquet magic bytes not found in footer"),
        ("broken.parquet", whole, bytes(broken), "{} is not a readable parquet file ("),
        ("cut.jsonl.gz", gz, gz[: len(gz) // 2], "{} is not a readable gzip-compressed JSON "
         "lines file (EOFError: Compressed file ended before the end-of-stream marker"),
        ("not.jsonl.gz", gz, lines, "{} is not a readable gzip-compressed JSON lines file "
         "(BadGzipFile: Not a gzipped file"),
        ("cut.jsonl.zst", good_zst, b"".join(blocks[:50]), "{} is not a readable "
         "zstd-compressed file (it ends inside a frame: truncated)"),
        ("not.jsonl.zst", good_zst, lines, "{} is not a readable zstd-compressed file (ZstdError"),
        ("empty.jsonl", lines, _jsonl([{"text": ""}, {"text": ""}]),
         "the corpus ({}) holds no documents: its 2 records have no text in 'text'"),
        ("none.jsonl", lines, b"", "the corpus ({}) holds no documents: no records"),
    ]  # fmt: skip
    for name, good, bad, needle in cases:
        path, out = tmp_path / name, tmp_path / f"out_{name}"
        # after another file's tokens (written, then taken back); alone where it is empty
        before_it = root / ("c.jsonl" if name == "ints.jsonl" else "a.parquet")
        inputs = [path] if "no documents" in needle else [before_it, path]
        path.write_bytes(good)
        prepare(inputs, out, "bytes", 0.2, shard_tokens=SHARD)
        before = _files(out)
        path.write_bytes(bad)
        argv = [*inputs, "--out", out, "--tokenizer", "bytes", "--val-fraction", 0.2]
        line = _one_error(capsys, [*argv, "--shard-tokens", SHARD])
        assert needle.format(path) in line, (needle, line)
        assert _files(out) == before  # untouched, and no temporary file left beside
    # a bad record found while two workers hold chunks: the same, and no worker left
    path, out = tmp_path / "float.jsonl", tmp_path / "out_float"
    path.write_bytes(_jsonl([{"text": "a"}] * 300))
    prepare([path], out, "bytes", 0.2, workers=2)
    before = _files(out)
    path.write_bytes(_jsonl([{"text": "a"}] * 300 + [{"text": 1.5}]))
    line = _one_error(capsys, [path, "--out", out, "--tokenizer", "bytes", "--workers", 2])
    assert f"record 300 of {path}: text is float (1.5)" in line
    assert _files(out) == before
    import multiprocessing

    assert not multiprocessing.active_children()


def test_bad_options_and_directories_are_one_line(forms, tmp_path, capsys):
    root = forms["root"]
    out = tmp_path / "prepared"
    good = [root / "a.parquet", root / "b.parquet"]
    prepare(good, out, "bytes", 0.2)
    before = _files(out)
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "a.txt").write_text("text")
    (tmp_path / "a.txt").write_text("text")
    cases = [
        ([*good, "--shard-tokens", 1024], "--shard-tokens 1024 must be 0 (one train.bin and "
         "val.bin) or from 1025 (one window of 1024 + 1 tokens) to 2147483647"),
        ([*good, "--workers", 0], "--workers 0 must be at least 1"),
        ([tmp_path / "nothing" / "*.parquet"], f"{tmp_path / 'nothing' / '*.parquet'} matches "
         "no file"),
        ([tmp_path / "texts"], f"text file {tmp_path / 'texts'} is a directory; give the files "
         "in it"),
        ([root / "saved_dict", "--split", "validation"],
         "saved_dict has no split 'validation'; its splits: train, test (--split)"),
        ([root / "repo", "--split", "validation"],
         "repo has no split 'validation'; its splits: train, test (--split)"),
        ([*good, "--encoding", "latin-1"], "--encoding latin-1 applies to text files"),
        ([tmp_path / "a.txt", "--text-field", "body"], "--text-field body applies to records"),
        ([tmp_path / "a.txt", root / "c.jsonl"], "text files (" f"{tmp_path / 'a.txt'}, ...) "
         f"and records ({root / 'c.jsonl'}, ...) given together"),
        # another corpus, or this one tokenized otherwise: another --out, or remove it
        ([root / "c.jsonl"], f"--out {out} holds another corpus: parquet {root / 'a.parquet'} "
         f"and 1 more, text_field 'text' (its meta.json), not json {root / 'c.jsonl'}, "
         "text_field 'text'; give another --out, or remove the directory"),
        ([*good, "--tokenizer", forms["tok"]], f"--out {out} holds this corpus tokenized with "
         f"another tokenizer (bytes, its meta.json), not {forms['tok']}; give another --out"),
        ([*good, "--tokenizer", "char"], "tokenized with another tokenizer (bytes"),
    ]  # fmt: skip
    for argv, needle in cases:
        tokenizer = [] if "--tokenizer" in argv else ["--tokenizer", "bytes"]
        line = _one_error(capsys, [*argv, "--out", out, *tokenizer])
        assert needle in line, (needle, line)
        assert _files(out) == before
    np.arange(10, dtype=np.uint16).tofile(tmp_path / "train.bin")  # no meta.json beside
    line = _one_error(capsys, [*good, "--out", tmp_path, "--tokenizer", "bytes"])
    assert f"--out {tmp_path} holds token files (train.bin, ...) without a meta.json" in line
    # the same corpus again, otherwise (a held-out part, shards): replaced as a whole
    prepare(good, out, "bytes", 0.0, shard_tokens=SHARD)
    assert not (out / "train.bin").exists() and (out / "train_000001.bin").is_file()
    assert not list(out.glob("val*"))  # nothing held out: no val shard


def test_command_line_in_a_fresh_process_caches_nothing_at_home(forms, tmp_path):
    """`--workers 2` from the command line gives the files this process writes with one;
    reading each kind of input leaves nothing under the home directory (no ~/.cache:
    nothing downloaded, nothing cached)."""
    home = tmp_path / "home"
    home.mkdir()
    inputs = forms["inputs"]
    code = f"""
import sys
sys.path.insert(0, {str(ROOT / "scripts")!r})
from prepare_text import main, prepare
assert main([*{[str(p) for p in inputs["parquet"]]!r}, "--out", {str(tmp_path / "cli")!r},
             "--tokenizer", {str(forms["tok"])!r}, "--val-fraction", "0.25", "--workers", "2",
             "--shard-tokens", "1025"]) == 0
for i, name in enumerate(["zst", "gz", "save_to_disk_dict", "repo"]):
    prepare({inputs!r}[name], {str(tmp_path)!r} + f"/out{{i}}", "bytes", 0.1)
"""
    code = code.replace("PosixPath", "")  # the paths of `inputs` as strings
    env = {"HOME": str(home), "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not list(home.iterdir())
    expected = tmp_path / "expected"
    prepare(inputs["parquet"], expected, str(forms["tok"]), 0.25, shard_tokens=SHARD)
    assert _files(tmp_path / "cli") == _files(expected)


def test_the_corpus_streams_through(tmp_path):
    """The live heap (Python objects and numpy arrays, tracemalloc) at its peak is the same
    for a corpus eight times larger: records are read a batch at a time, at most 2 x
    workers chunks are in flight, the offsets go to disk in blocks."""
    import tracemalloc

    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    letters = rng.integers(97, 123, size=3000 * 16_000, dtype=np.uint8).tobytes().decode()
    sizes = {}
    for name, n in (("small", 2000), ("large", 16_000)):  # random letters: parquet cannot
        texts = [letters[i * 3000 : i * 3000 + 1000 + i % 2000] for i in range(n)]  # shrink them
        pq.write_table(pa.table({"text": texts}), tmp_path / f"{name}.parquet", 500)
        sizes[name] = sum(map(len, texts))
    prepare([tmp_path / "small.parquet"], tmp_path / "warm", "bytes", 0.1)  # imports, caches
    peaks = {}
    tracemalloc.start()
    try:
        for name in ("small", "large"):
            tracemalloc.reset_peak()
            prepare([tmp_path / f"{name}.parquet"], tmp_path / name, "bytes", 0.1)
            peaks[name] = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert TokenData(dir=str(tmp_path / "large"), block_size=8).tokens > 0.89 * sizes["large"]
    # A quarter of the larger corpus's extra text (21 MB), held anywhere, would pass this
    # bound; what streams holds the same for both sizes.
    extra = sizes["large"] - sizes["small"]
    assert peaks["large"] - peaks["small"] < extra / 4, (peaks, extra)
