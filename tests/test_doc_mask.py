"""data.doc_mask=true: documents kept apart inside a training window. The model (each
document's logits and gradients those of the document run alone), the data (segments and
ignored targets across shard boundaries, against the documents themselves), a real
2-rank run against one process, and the refusals."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from dist_harness import run_distributed
from test_cli import scalars

from trainer.config.checks import validate
from trainer.data.datasets import make_loader
from trainer.data.tokens import LLMC_HEADER, TokenData
from trainer.errors import ConfigError
from trainer.models.builtin import GPT, GPTMoE
from trainer.models.loss import IGNORE_INDEX, accuracy, correct_count, loss_fn

ROOT = Path(__file__).resolve().parents[1]
V, T = 29, 16  # vocabulary (id 0 ends a document), window
EOS = 0

# -- the model ---------------------------------------------------------------------------

# Two windows of T tokens, each cut into 3 documents (the first begun before the window);
# the second window has a document of one token.
LENGTHS = [[5, 7, 4], [6, 1, 9]]


def _window() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids (2, T), segments (2, T) and targets (2, T): the next token within a document,
    IGNORE_INDEX where the next token starts the next document."""
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(1, V, (2, T + 1), generator=g)  # the last column: the next token
    seg = torch.from_numpy(np.stack([np.repeat(np.arange(3), n) for n in LENGTHS]))
    targets = idx[:, 1:].clone()
    targets[:, :-1][seg[:, 1:] != seg[:, :-1]] = IGNORE_INDEX
    return idx[:, :-1], seg, targets


def _pieces(seg: torch.Tensor) -> list[tuple[int, int, int]]:
    """(row, first, end) of every document of the window."""
    return [
        (b, int(ids[0]), int(ids[-1]) + 1)
        for b in range(seg.shape[0])
        for s in seg[b].unique()
        for ids in [(seg[b] == s).nonzero().flatten()]
    ]


# [Note: how close a document's logits are]
# The window and the document alone compute the same sums in another order: the window's
# attention rows hold masked keys whose weight is exp(-inf) = 0 exactly and whose value
# adds an exact 0, and the kernels may group the sums otherwise. A sum of K terms in
# another order differs by at most K·u of the sum of the terms' magnitudes (u the unit
# roundoff: 2^-53 ≈ 1.1e-16 in fp64, 2^-24 ≈ 6e-8 in fp32). Here K <= 4·n_embd = 128 (the
# MLP's inner sum) and about 30 such sums lie on the path to a logit (2 layers of about 12,
# then the final LayerNorm and the head). Relative errors pass through a LayerNorm as
# relative errors, and the magnitudes stay O(1) (logits ~0.4): a logit moves by at most
# ~30·128·u ≈ 4e3·u in the worst case, 4e-13 in fp64 and 2.3e-4 in fp32 (errors of random
# sign give ~sqrt(4e3)·u; measured here: 6e-8 in fp32). Held at 1e-10 in fp64 and 3e-4 in
# fp32; the planted bugs (positions not restarting, attention across documents) move
# logits by 0.08 to 0.5.
TOL = {torch.float64: 1e-10, torch.float32: 3e-4}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("cls", [GPT, GPTMoE], ids=["gpt", "gpt_moe"])
def test_each_document_computes_as_if_alone(cls, dtype):
    torch.manual_seed(0)
    model = cls(vocab_size=V, block_size=T, n_layer=2, n_head=2, n_embd=32).to(dtype)
    idx, seg, _ = _window()
    logits = model(idx, seg)  # (2, T, V)
    for b, lo, hi in _pieces(seg):
        alone = model(idx[b : b + 1, lo:hi])[0]  # (hi - lo, V): positions 0.. of its own
        torch.testing.assert_close(logits[b, lo:hi], alone, atol=TOL[dtype], rtol=0)
    # without segments: one document per window, plain causal attention as ever
    one = model(idx, torch.zeros_like(seg))
    torch.testing.assert_close(model(idx), one, atol=TOL[dtype], rtol=0)


def test_gradients_are_the_sum_of_the_documents_own():
    """The window's loss, its boundary targets ignored, against the documents run alone:
    their summed cross entropies over the same trained positions, divided by the same
    count. fp64: [Note: how close a document's logits are]; a gradient is a sum of the
    same kind, of at most B·T = 32 more terms per element."""
    torch.manual_seed(0)
    model = GPT(vocab_size=V, block_size=T, n_layer=2, n_head=2, n_embd=32).double()
    idx, seg, targets = _window()
    trained = int((targets != IGNORE_INDEX).sum())
    assert trained == 2 * T - 4  # the last token of each document but the window's last
    window = torch.autograd.grad(loss_fn(model(idx, seg), targets), model.parameters())
    total = sum(
        F.cross_entropy(model(idx[b : b + 1, lo:hi])[0], targets[b, lo:hi], reduction="sum")
        for b, lo, hi in _pieces(seg)
    )
    alone = torch.autograd.grad(total / trained, model.parameters())
    for got, want in zip(window, alone, strict=True):
        torch.testing.assert_close(got, want, atol=1e-10 * want.abs().max().item(), rtol=0)


def test_loss_and_accuracy_leave_ignored_targets_out():
    logits = torch.tensor([[[0.0, 5.0], [5.0, 0.0], [0.0, 5.0], [3.0, 0.0]]])  # (1, 4, 2)
    targets = torch.tensor([[1, 1, IGNORE_INDEX, 0]])
    want = F.cross_entropy(logits[0, [0, 1, 3]], targets[0, [0, 1, 3]])
    assert torch.equal(loss_fn(logits, targets), want)
    assert correct_count(logits, targets).item() == 2  # positions 0 and 3; 1 wrong, 2 ignored
    assert accuracy(logits, targets).item() == np.float32(2 / 3)  # of the 3 trained
    none = torch.full_like(targets, IGNORE_INDEX)  # documents of one token: nothing trained
    assert loss_fn(logits, none).item() == 0 and accuracy(logits, none).item() == 0


# -- the data ----------------------------------------------------------------------------


def _documents(seed: int, n: int) -> list[np.ndarray]:
    """n documents of 1 to 40 tokens (three of one token, one of 300), EOS last."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 41, n)
    lengths[[3, 4, 10]] = 1
    lengths[7] = 300  # spans a whole shard below
    return [np.append(rng.integers(1, V, k - 1), EOS).astype(np.uint16) for k in lengths]


def _write(directory: Path, split: str, docs: list[np.ndarray], cuts: list[int]) -> np.ndarray:
    """The documents as one stream cut at `cuts` into shards `split_00000k.bin` with their
    `.docs.npy`; returns each stream position's document index."""
    stream = np.concatenate(docs)
    first = np.cumsum([0] + [len(d) for d in docs[:-1]])  # each document's first token
    edges = [0, *cuts, len(stream)]
    names = [f"{split}.bin"] if not cuts else [f"{split}_{i:06d}.bin" for i in range(len(cuts) + 1)]
    for name, lo, hi in zip(names, edges[:-1], edges[1:], strict=True):
        stream[lo:hi].tofile(directory / name)
        starts = first[(first >= lo) & (first < hi)] - lo
        np.save(directory / name.replace(".bin", ".docs.npy"), starts.astype(np.int64))
    return np.repeat(np.arange(len(docs)), [len(d) for d in docs])


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> tuple[Path, np.ndarray, np.ndarray]:
    """train_*.bin: 5 shards, cut inside a document, twice inside the 300-token one (a shard
    wholly inside it) and at a document's first token; val.bin whole."""
    root = tmp_path_factory.mktemp("docs")
    docs = _documents(0, 40)
    first = np.cumsum([0] + [len(d) for d in docs[:-1]])
    cuts = [int(first[5]) + 3, int(first[7]) + 50, int(first[7]) + 200, int(first[12])]
    doc_of = _write(root, "train", docs, cuts)
    _write(root, "val", _documents(1, 30), [])
    (root / "meta.json").write_text(json.dumps({"vocab_size": V, "dtype": "uint16"}))
    assert np.load(root / "train_000002.docs.npy").size == 0  # inside one document
    assert np.load(root / "train_000004.docs.npy")[0] == 0  # a document starts the shard
    return root, np.concatenate(docs), doc_of


def _expected(stream: np.ndarray, doc_of: np.ndarray, start: int) -> tuple[list, list, list]:
    """What window `start` must yield, from the documents alone."""
    ids, docs = stream[start : start + T + 1].astype(np.int64), doc_of[start : start + T + 1]
    targets = np.where(docs[1:] != docs[:-1], IGNORE_INDEX, ids[1:])
    return ids[:-1].tolist(), targets.tolist(), (docs[:-1] - docs[0]).tolist()


def test_segments_and_ignored_targets_across_shards(shards):
    root, stream, doc_of = shards
    data = TokenData(dir=str(root), block_size=T, doc_mask=True)
    assert len(data.files) == 5 and data.tokens == len(stream)
    for i in range(len(data)):  # every window, those across each shard boundary included
        x, y, seg = data[i]
        assert seg.dtype == torch.int64 and seg.shape == (T,)
        assert (x.tolist(), y.tolist(), seg.tolist()) == _expected(stream, doc_of, i), i
    # evaluation windows, one after another
    val = np.fromfile(root / "val.bin", np.uint16)
    val_doc = np.repeat(np.arange(30), [len(d) for d in _documents(1, 30)])
    held_out = TokenData(dir=str(root), block_size=T, doc_mask=True, train=False)
    for k in range(len(held_out)):
        got = [t.tolist() for t in held_out[k]]
        assert tuple(got) == _expected(val, val_doc, k * (T + 1)), k
    # without doc_mask: the windows as ever, no segments, nothing ignored
    plain = TokenData(dir=str(root), block_size=T)
    assert len(plain[0]) == 2 and plain[0][1].tolist() == stream[1 : T + 1].tolist()


def test_llmc_shards_count_offsets_after_the_header(shards, tmp_path):
    root, stream, doc_of = shards
    for name in sorted(p.name for p in root.glob("train_*.bin")):
        tokens = np.fromfile(root / name, np.uint16)
        header = np.zeros(LLMC_HEADER, dtype=np.int32)
        header[:3] = 20240520, 1, len(tokens)
        (tmp_path / name).write_bytes(header.tobytes() + tokens.tobytes())
        docs = name.replace(".bin", ".docs.npy")
        (tmp_path / docs).write_bytes((root / docs).read_bytes())
    data = TokenData(path=str(tmp_path / "train_*.bin"), block_size=T, doc_mask=True)
    for i in range(0, len(data), 7):
        assert tuple(t.tolist() for t in data[i]) == _expected(stream, doc_of, i), i


def test_the_loader_batches_carry_the_segments(shards):
    root, stream, doc_of = shards
    data = TokenData(dir=str(root), block_size=T, doc_mask=True)
    loader = make_loader(data, 8, 1, 2, seed=3)  # rank 1 of 2
    x, y, seg = next(iter(loader))
    starts = loader.batch_sampler.starts(0)[4:8]  # rank 1's windows of step 0
    want = [_expected(stream, doc_of, int(s)) for s in starts]
    assert x.tolist() == [w[0] for w in want] and y.tolist() == [w[1] for w in want]
    assert seg.tolist() == [w[2] for w in want]


# -- a real run: 2 ranks against one process ---------------------------------------------

STEPS, BATCH, EVAL_BATCHES = 12, 8, 5  # 40 held-out windows at P = 1 and at P = 2
MODES = ("ddp", "zero", "fsdp")
RUN = [
    "model=gpt", "model.block_size=16", "model.n_layer=2", "model.n_head=2",
    "model.n_embd=32", "data=token_file", "data.doc_mask=true", "optim=adamw", "optim.lr=0.01",
    f"train.steps={STEPS}", f"train.batch_size={BATCH}", "train.log_every=1",
    f"train.eval_every={STEPS}", f"train.eval_batches={EVAL_BATCHES}", "train.save_final=true",
    "optim.eps=0.001", "ckpt.every=0",
]  # fmt: skip


def _counting(seed: int, n: int) -> list[np.ndarray]:
    """Documents that count up from a random id (mod V-1, ids 1..V-1), EOS last: within a
    document the next token is learnable, across a boundary it is not."""
    rng = np.random.default_rng(seed)
    return [
        np.append(1 + (rng.integers(V - 1) + np.arange(k - 1)) % (V - 1), EOS).astype(np.uint16)
        for k in rng.integers(2, 24, n)
    ]


def _train(env, data_dir: str, run_root: str, runs: list[tuple[str, ...]]) -> list[dict]:
    """train_in_group with each run's overrides, in this process group, one after another."""
    from hydra import compose, initialize_config_dir

    from trainer.run import loop

    out = []
    shared = loop.shared_run_dir  # no Hydra run here: the run directory is ours
    try:
        for i, overrides in enumerate(runs):
            run_dir = Path(run_root) / f"run{i}"
            loop.shared_run_dir = lambda env, d=run_dir: d
            with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
                cfg = compose("config", overrides=[*RUN, f"data.dir={data_dir}", *overrides])
            out.append({"final": loop.train_in_group(cfg, env), "run_dir": str(run_dir)})
    finally:
        loop.shared_run_dir = shared
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    root = tmp_path_factory.mktemp("doc_runs")
    data = root / "data"
    data.mkdir()
    docs = _counting(0, 400)
    _write(data, "train", docs, [1500, 1501 + len(docs[200])])
    _write(data, "val", _counting(1, 60), [])
    (data / "meta.json").write_text(json.dumps({"vocab_size": V, "dtype": "uint16"}))
    one = run_distributed(
        _train, 1, str(data), str(root / "p1"), [("mode=ddp", "train.grad_accum_steps=2")]
    )[0]
    fsdp = ("mode=fsdp", "model.activation_checkpointing=true")  # the mask through both
    two = run_distributed(
        _train, 2, str(data), str(root / "p2"), [("mode=ddp",), ("mode=zero",), fsdp], timeout=300
    )[0]
    return {"data": data, "one": one[0], **dict(zip(MODES, two, strict=True))}


# [Note: the parity bound]
# Two ranks of 4 windows each and one process with 2 micro-batches of the same 4 windows
# run the same forwards on the same shapes, so the micro-batch losses and gradients are
# the same bits; the halves are added as (g0 + g1) / 2 (AllReduce, then / P) against
# g0 / 2 + g1 / 2 (two backward passes into one .grad), equal in binary floating point
# (halving is exact). What may still differ is the optimizer's elementwise update of a
# shard (zero, fsdp) against the whole tensor: a vectorized kernel may round an element in its
# scalar tail otherwise, 1 ulp (6e-8 relative) of an update of at most lr = 0.01 per
# step. AdamW with eps 1e-3 passes a gradient's change to the update at most lr / eps =
# 10 times, so such last bits stay below ~1e-7 after 12 steps of parameters O(1): the
# bound 1e-5 is 100 times that (bitwise equal on the machine this was written on); the
# planted bugs move parameters by >1e-3.


def test_two_ranks_equal_one_process(runs):
    want = torch.load(Path(runs["one"]["run_dir"]) / "final_model.pt", weights_only=True)
    losses = scalars(Path(runs["one"]["run_dir"]))["train/loss"]
    assert len(losses) == STEPS and losses[-1] < 0.7 * losses[0], losses  # it trains
    for mode in MODES:
        run_dir = Path(runs[mode]["run_dir"])
        got = torch.load(run_dir / "final_model.pt", weights_only=True)
        for k in want:  # [Note: the parity bound]
            torch.testing.assert_close(got[k], want[k], atol=1e-5, rtol=0, msg=f"{mode} {k}")
        # the figures logged: the same means of the same micro-batches
        np.testing.assert_allclose(scalars(run_dir)["train/loss"], losses, rtol=1e-5)
        for key in ("train/accuracy", "eval/loss", "eval/accuracy"):
            assert runs[mode]["final"][key] == pytest.approx(runs["one"]["final"][key], 1e-5)


def test_evaluation_is_per_trained_token(runs):
    """The run's eval/loss and eval/accuracy of its final model, against the model and
    the held-out windows read here: sums over the trained targets over their count."""
    model = GPT(vocab_size=V, block_size=T, n_layer=2, n_head=2, n_embd=32)
    model.load_state_dict(
        torch.load(Path(runs["one"]["run_dir"]) / "final_model.pt", weights_only=True)
    )
    held_out = TokenData(dir=str(runs["data"]), block_size=T, doc_mask=True, train=False)
    windows = [held_out[k] for k in range(EVAL_BATCHES * BATCH)]  # those the run evaluates
    x, y, seg = (torch.stack(t) for t in zip(*windows, strict=True))
    with torch.no_grad():  # in the run's batches: the same shapes, so the same bits, and
        # no argmax near-tie can fall the other way (accuracy is compared exactly)
        logits = torch.cat(
            [model(x[i : i + BATCH], seg[i : i + BATCH]) for i in range(0, len(x), BATCH)]
        )
    trained = y != IGNORE_INDEX
    assert 0 < trained.sum() < y.numel()
    loss = F.cross_entropy(logits[trained], y[trained])
    right = (logits.argmax(-1) == y)[trained].double().mean()
    final = runs["one"]["final"]
    # fp32 sums of ~700 terms in another order: ~1e-6 relative at most
    assert final["eval/loss"] == pytest.approx(loss.item(), rel=1e-5)
    assert final["eval/accuracy"] == pytest.approx(right.item(), abs=1e-9)


# -- refusals ----------------------------------------------------------------------------


def _bad_docs(tmp_path: Path, docs: object) -> Path:
    np.arange(100, dtype=np.uint16).tofile(tmp_path / "train.bin")
    np.save(tmp_path / "train.docs.npy", docs)
    return tmp_path


@pytest.mark.parametrize(
    "docs, needle",
    [
        (np.array([[0, 5]]), "holds a int64 array of shape (1, 2); the document starts are a 1-D"),
        (np.array([0.0, 5.0]), "holds a float64 array of shape (2,)"),
        (np.array([0, 9, 7, 20]), "offset 7 at index 2 follows 9; the document starts must be"),
        (np.array([0, 5, 5]), "offset 5 at index 2 follows 5"),
        (np.array([0, 50, 100]), "offset 100 at index 2 is outside train.bin's 100 tokens"),
        (np.array([-1, 50]), "offset -1 at index 0 is outside train.bin's 100 tokens (0..99)"),
    ],
    ids=["2d", "float", "descending", "repeated", "past_the_end", "negative"],
)
def test_malformed_document_starts_are_refused(tmp_path, docs, needle):
    _bad_docs(tmp_path, docs)
    with pytest.raises(ConfigError) as info:
        TokenData(dir=str(tmp_path), block_size=8, doc_mask=True)
    assert needle in str(info.value) and "\n" not in str(info.value)
    TokenData(dir=str(tmp_path), block_size=8)  # without doc_mask the file is not read


def test_missing_and_misplaced_document_starts_are_refused(tmp_path):
    np.arange(100, dtype=np.uint16).tofile(tmp_path / "train.bin")
    with pytest.raises(ConfigError, match=r"train.docs.npy, the document starts of train.bin, "
                       r"does not exist; re-prepare the data with scripts/prepare_text.py, or "
                       r"set data.doc_mask=false"):  # fmt: skip
        TokenData(dir=str(tmp_path), block_size=8, doc_mask=True)
    np.save(tmp_path / "a.npy", np.arange(100))
    np.save(tmp_path / "a.docs.npy", np.array([0, 10]))
    with pytest.raises(ConfigError, match="a.docs.npy holds document starts, not tokens"):
        TokenData(path=str(tmp_path / "*.npy"), block_size=8)
    with pytest.raises(ConfigError, match="data.doc_mask='yes' must be true or false"):
        TokenData(dir=str(tmp_path), block_size=8, doc_mask="yes")


def _cfg(*overrides: str):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=["data=token_file", "data.dir=x", *overrides])


def test_a_model_without_document_boundaries_is_refused():
    for model in ("gpt", "nanogpt", "gpt_moe"):
        validate(_cfg(f"model={model}", "data.doc_mask=true"), 1)
    for model, target in (("mlp", "MLP"), ("hf", "hf_causal_lm")):
        with pytest.raises(ConfigError) as info:
            validate(_cfg(f"model={model}", "data.doc_mask=true"), 1)
        assert str(info.value) == (
            "data.doc_mask=true needs a model that takes document boundaries: model=gpt, "
            f"nanogpt or gpt_moe (trainer.models.{'builtin' if model == 'mlp' else 'lm'}."
            f"{target} does not); or set data.doc_mask=false"
        )
    validate(_cfg("model=mlp"), 1)  # doc_mask false: any model
    with pytest.raises(ConfigError, match="data.doc_mask=maybe must be true or false"):
        validate(_cfg("model=gpt", "data.doc_mask=maybe"), 1)


# -- the benchmark runs ------------------------------------------------------------------


def test_the_benchmark_runs_small():
    sys.path.insert(0, str(ROOT))
    from scripts.benchmarks.bench_doc_mask import main

    rows = main(["--layers", "1", "--embd", "16", "--heads", "2", "--block", "16",
                 "--batch", "2", "--rounds", "1"])  # fmt: skip
    assert rows["ratio"] > 0 and rows["causal_s"] > 0 and rows["doc_mask_s"] > 0
