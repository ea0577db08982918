"""Several token directories mixed by weight (trainer/data/mix.py, `data.mix`): the windows
each source gives against its weight, batches drawn from the step alone (resumed and
re-cut exactly), each window read from its own source, the per-source figures of a real
run and its resume, and the bad input refused in one line. Token directories are written
here with numpy; two short runs of train.py on two ranks."""

from __future__ import annotations

import json
import random
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch
from tb_events import layout, scalars
from test_cli import run_cli

from trainer.data.datasets import EvalParts, make_eval_loader, make_loader
from trainer.data.mix import MixSampler, TokenMix, check_mix, source_names
from trainer.data.tokens import TokenData
from trainer.errors import ConfigError, NotResumable


def _tokens(root: Path, train: np.ndarray, val: np.ndarray | None = None, **meta) -> str:
    root.mkdir(parents=True, exist_ok=True)
    train.astype(meta.get("dtype", "uint16")).tofile(root / "train.bin")
    if val is not None:
        val.astype(meta.get("dtype", "uint16")).tofile(root / "val.bin")
    (root / "meta.json").write_text(json.dumps({"vocab_size": 300, **meta}))
    return str(root)


def _mix(*entries: tuple[str, float]) -> list[tuple[str, Fraction]]:
    return check_mix([{"dir": d, "weight": w} for d, w in entries])


# -- the windows each source gives -----------------------------------------------------------


@pytest.mark.parametrize(
    "weights, batch",
    [
        ((0.7, 0.3), 8),
        ((0.61, 0.33, 0.06), 8),  # 0.06 x 8 = 0.48: most steps take none from it
        ((5, 3, 1, 1, 1), 6),  # whole numbers, relative
        # one window a step: here giving the spare windows by largest remainder rather
        # than earliest deadline leaves step 43 no way to stay within one window
        ((0.08, 0.03, 0.98, 0.98, 0.03), 1),
    ],
)
def test_each_source_gives_its_weight_within_one_window_at_every_step(weights, batch):
    steps, window = 2000, 5
    tokens = [4000 + 1000 * k for k in range(len(weights))]
    sampler = MixSampler(tokens, [Fraction(repr(w)) for w in weights], window, batch, 0, 1, 3)
    share = [Fraction(repr(w)) / sum(Fraction(repr(v)) for v in weights) for w in weights]
    ends = sampler.offsets[1:]
    given = np.zeros(len(weights), dtype=np.int64)
    for step in range(steps):
        items = sampler.items(step)
        assert len(items) == batch and len(np.unique(items)) == batch
        # which source each window is from, by where its item falls: counted, not told
        given += np.bincount(np.searchsorted(ends, items, side="right"), minlength=len(weights))
        for k, w in enumerate(share):  # strictly within one window of w * B * S, every S
            assert abs(given[k] - w * batch * (step + 1)) < 1, (step, k, given.tolist())
    assert given.sum() == steps * batch
    assert sampler.totals(steps).tolist() == given.tolist()
    # the figures a run logs: the tokens (block_size = window - 1 per window) per source
    names = sampler.names
    assert sampler.figures(steps) == {
        f"data/tokens/{n}": float(g * (window - 1)) for n, g in zip(names, given, strict=True)
    }


# -- drawn from the step alone: pure, resumed, re-cut ----------------------------------------


def _sampler(rank: int = 0, world: int = 1, seed: int = 5, batch: int = 8) -> MixSampler:
    weights = [Fraction(7, 10), Fraction(3, 10)]
    return MixSampler([30_000, 12_000], weights, 9, batch, rank, world, seed, ["web", "code"])


def test_a_batch_is_a_function_of_the_step_alone():
    walked = _sampler()
    it = iter(walked)
    order = [next(it) for _ in range(300)]  # steps 0..299 in order
    fresh = _sampler()
    steps = list(range(300))
    random.Random(0).shuffle(steps)
    for step in steps:  # any order, a fresh sampler: the same batch
        assert fresh.batch_of(step, [0]) == order[step]
    assert walked.items(7).tolist() == fresh.items(7).tolist()
    assert order[7] != order[8] and _sampler(seed=6).items(7).tolist() != order[7]


@pytest.mark.parametrize("world", [1, 2, 4])
def test_ranks_take_disjoint_parts_of_the_one_process_batch(world):
    one = _sampler()
    ranks = [iter(_sampler(r, world)) for r in range(world)]
    for step in range(6):
        whole = one.items(step).tolist()
        parts = [next(it) for it in ranks]
        assert sum(parts, []) == whole  # rank order concatenated: the one-process batch
        assert len(set(whole)) == len(whole)
    # replica groups deal slots: group g's rank r is slot g * P + r, taken in any order
    four = _sampler(0, 4)
    assert four.batch_of(3, [2, 0]) == one.items(3)[4:6].tolist() + one.items(3)[0:2].tolist()


def test_resumed_sampler_continues_exactly_in_another_world_size():
    two = _sampler(1, 2)
    for _ in zip(range(5), iter(two), strict=False):  # five steps taken
        pass
    state = two.state_dict()
    assert state["step"] == 5 and state["shares"] == [7, 3]
    four = [_sampler(r, 4) for r in range(4)]
    for s in four:
        s.load_state_dict(state)
    for step in (5, 6):
        assert sum((next(iter(s)) for s in four), []) == _sampler().items(step).tolist()
    with pytest.raises(NotResumable, match="seed=5 but this run has seed=6"):
        _sampler(seed=6).load_state_dict(state)


# -- each window from its own source ----------------------------------------------------------


def test_each_window_is_read_from_its_source(tmp_path):
    # disjoint id ranges: a window's ids say which directory it came from
    a = _tokens(tmp_path / "a", np.arange(20_000) % 100, np.arange(900) % 100)
    b = _tokens(tmp_path / "b", 100 + (np.arange(9_000) * 7) % 100, 100 + np.arange(450) % 100)
    data = TokenMix(_mix((a, 0.75), (b, 0.25)), block_size=8)
    sources = [np.fromfile(Path(d) / "train.bin", np.uint16) for d in (a, b)]
    for rank in (0, 1):
        loader = make_loader(data, 8, rank=rank, world_size=2, seed=4)
        sampler, batches = loader.batch_sampler, iter(loader)
        for step in range(20):
            x, y = next(batches)
            items = sampler.items(step)[rank * 4 : (rank + 1) * 4]
            for row, item in zip(x.tolist(), items, strict=True):
                k = int(item >= sampler.offsets[1])  # source b's items follow a's
                start = int(item - sampler.offsets[k])
                assert row == sources[k][start : start + 8].tolist()
                assert all((v >= 100) == (k == 1) for v in row)  # b's ids, or a's
            assert torch.equal(x[:, 1:], y[:, :-1])
        whole = np.concatenate([sampler.items(s) for s in range(20)])
        assert (whole >= sampler.offsets[1]).sum() == sampler.totals(20)[1] == 40  # 0.25 x 160
    # held out: each source's val windows in order, a part of its own, as weighted
    held = TokenMix(_mix((a, 0.75), (b, 0.25)), block_size=8, train=False)
    parts = make_eval_loader(held, 4, rank=1, world_size=2, max_batches=3)
    assert isinstance(parts, EvalParts)
    assert [(n, w) for n, w, _ in parts.parts] == [("a", 0.75), ("b", 0.25)]
    (_, _, part_a), (_, _, part_b) = parts.parts
    val_a = np.arange(900) % 100
    first = next(iter(part_a))[0]  # rank 1: the second half of the first 3 global batches
    assert first[0].tolist() == val_a[6 * 9 : 6 * 9 + 8].tolist()
    assert sum(len(x) for x, _ in part_a) == sum(len(x) for x, _ in part_b) == 6
    assert len(held) == 900 // 9 + 450 // 9 and held[100][0].tolist() == list(range(100, 108))


# -- a run: figures per source, resumed bitwise -----------------------------------------------


RUN = [
    "model=gpt", "data=token_file", "model.n_embd=32", "model.n_layer=1", "model.n_head=2",
    "model.block_size=16", "train.batch_size=8", "train.log_every=2", "train.eval_every=3",
    "train.eval_batches=2", "optim.lr=3e-3", "ckpt.every=3", "launcher.nproc=2",
]  # fmt: skip


def test_two_ranks_log_each_sources_tokens_and_resume_bitwise(tmp_path):
    web = _tokens(tmp_path / "web", (np.arange(30_000) * 3) % 50, (np.arange(2_000) * 3) % 50)
    code = _tokens(tmp_path / "code", (np.arange(12_000) * 7) % 50, (np.arange(900) * 11) % 50)
    mix = f"data.mix=[{{dir: {web}, weight: 0.7}}, {{dir: {code}, weight: 0.3}}]"
    whole = tmp_path / "whole"
    proc = run_cli([*RUN, mix, "train.steps=6", f"hydra.run.dir={whole}"], nproc=None)
    assert proc.returncode == 0, proc.stderr[-3000:]

    # the tokens each source gave, as the sampler counts them (16 tokens a window)
    counts = MixSampler([30_000, 12_000], [Fraction(7, 10), Fraction(3, 10)], 17, 8, 0, 1, 0)
    logged = scalars(whole)
    for name, k in (("web", 0), ("code", 1)):
        steps = [s for s, _ in logged[f"data/tokens/{name}"]]
        assert steps == [2, 4, 6]
        assert [v for _, v in logged[f"data/tokens/{name}"]] == [
            16.0 * counts.totals(s)[k] for s in steps
        ]
    seen = dict(logged["train/tokens_seen"])
    assert all(
        dict(logged["data/tokens/web"])[s] + dict(logged["data/tokens/code"])[s] == seen[s]
        for s in seen
    )
    final = json.loads((whole / "final_metrics.json").read_text())
    assert final["data/tokens/web"] == 16.0 * 34 and final["data/tokens/code"] == 16.0 * 14
    # [Note: held-out figures of a mix]: the sources' val losses weighted 0.7 / 0.3; a
    # few float64 roundings apart at most (the weights multiply before the division)
    assert final["eval/loss/web"] != final["eval/loss/code"]
    weighted = 0.7 * final["eval/loss/web"] + 0.3 * final["eval/loss/code"]
    assert final["eval/loss"] == pytest.approx(weighted, rel=1e-12)
    assert [s for s, _ in logged["eval/loss/code"]] == [3, 6]
    charts = dict(dict(layout(whole))["training"])  # in TensorBoard's Custom Scalars too
    assert charts["tokens trained on, by mixed source"] == [r"^data/tokens/.+$"]
    assert charts["held-out loss, by mixed source"] == [r"^eval/loss/.+$"]

    # resumed from step 3 in another run directory: the same model, bitwise
    resumed = tmp_path / "resumed"
    step3 = whole / "checkpoints" / "step_000003"
    args = [*RUN, mix, "train.steps=6", f"hydra.run.dir={resumed}", f"resume={step3}"]
    proc = run_cli(args, nproc=None)
    assert proc.returncode == 0, proc.stderr[-3000:]
    a = torch.load(whole / "final_model.pt", weights_only=True)
    b = torch.load(resumed / "final_model.pt", weights_only=True)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    again = json.loads((resumed / "final_metrics.json").read_text())
    assert {k: again[k] for k in final if k.startswith(("data/", "eval/"))} == {
        k: v for k, v in final.items() if k.startswith(("data/", "eval/"))
    }


# -- bad input: one line each ----------------------------------------------------------------


@pytest.fixture(scope="module")
def composed():
    """compose(*overrides): the run's config with model=gpt data=token_file and those."""
    from hydra import compose, initialize_config_dir
    from test_cli import ROOT

    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        yield lambda *overrides: compose(
            "config", overrides=["model=gpt", "data=token_file", *overrides]
        )


def test_bad_mixes_are_refused_in_one_line_before_the_run(tmp_path, composed):
    from trainer.config.checks import validate

    a = _tokens(tmp_path / "a", np.arange(1000) % 50)
    b = _tokens(tmp_path / "b", np.arange(1000) % 50)
    cases = [
        (f"[{{dir: {a}, weight: 0.5}}, {{dir: {b}, weight: 0}}]",
         "data.mix[1].weight=0 must be a positive number"),
        (f"[{{dir: {a}, weight: -1.5}}]", "data.mix[0].weight=-1.5 must be a positive number"),
        (f"[{{dir: {a}, weight: abc}}]", "data.mix[0].weight='abc' must be a positive number"),
        (f"[{{dir: {a}, weight: true}}]", "data.mix[0].weight=True must be a positive number"),
        (f"[{{dir: {a}, weight: nan}}]", "data.mix[0].weight=nan must be a positive number"),
        (f"[{{dir: {a}, weight: inf}}]", "data.mix[0].weight=inf must be a positive number"),
        (f"[{{dir: {a}}}]", f"data.mix[0] ({a}) has no weight"),
        ("[]", "data.mix=[] names no directory"),
        ("[{weight: 1}]", "data.mix[0] has no dir"),
        (f"[{{dir: {tmp_path / 'nope'}, weight: 1}}]", f"{tmp_path / 'nope'} is not a directory"),
        (f"[{{dir: {a}, weight: 1}}, {{dir: {a}/../a, weight: 1}}]",
         f"data.mix[1].dir={a}/../a is data.mix[0].dir={a} again; give each directory once"),
        (f"[{{dir: {a}, wieght: 1}}]", "data.mix[0].wieght is not a key of a mix entry"),
        (f"[{a}]", "must be {dir: DIR, weight: W}"),
        (f"{{dir: {a}}}", "must be a list of {dir: DIR, weight: W}"),
    ]  # fmt: skip
    for value, needle in cases:
        with pytest.raises(ConfigError) as e:
            validate(composed(f"data.mix={value}"), 1)
        assert needle in str(e.value) and "\n" not in str(e.value), (value, str(e.value))
    for other in (f"data.dir={a}", f"data.path={a}/train.bin", f"data.val_path={a}/val.bin"):
        with pytest.raises(ConfigError, match=f"data.mix with {other}: a mix reads"):
            validate(composed(f"data.mix=[{{dir: {b}, weight: 1}}]", other), 1)
    validate(composed(f"data.mix=[{{dir: {a}, weight: 2}}, {{dir: {b}, weight: 1}}]"), 1)
    validate(composed(f"data.dir={a}"), 1)  # no mix: nothing asked of it


def test_directories_of_other_vocabularies_are_refused(tmp_path):
    ids = np.arange(2000) % 60
    base = _tokens(
        tmp_path / "base", ids, tokenizer="char", chars="".join(map(chr, range(65, 125)))
    )
    chars = "".join(map(chr, range(66, 126)))
    cases = [
        (_tokens(tmp_path / "bytes", ids, tokenizer="bytes"), "tokenizer 'char' vs 'bytes'"),
        (_tokens(tmp_path / "chars", ids, tokenizer="char", chars=chars), "chars 'ABCDEFGHIJ"),
        (_tokens(tmp_path / "size", ids, tokenizer="char", chars=chars[:-1], vocab_size=59),
         "vocab_size 300 vs 59"),
    ]  # fmt: skip
    for other, needle in cases:
        with pytest.raises(ConfigError) as e:
            TokenMix(_mix((base, 1), (other, 1)), block_size=8)
        line = str(e.value)
        assert line.startswith(f"data.mix: {base} and {other} have different vocabularies (")
        assert needle in line and "\n" not in line, line
        assert line.endswith(
            "prepare them with --tokenizer bytes or a tokenizer directory: a char vocabulary "
            "is its text's characters (scripts/prepare_text.py)"
            if needle.startswith("chars")
            else "prepare them with the same --tokenizer (scripts/prepare_text.py)"
        ), line
    # tokenizer.json: the same kind, other content
    from tokenizers import Tokenizer, models

    hf = [_tokens(tmp_path / f"hf{i}", ids, tokenizer="hf") for i in (1, 2)]
    for d, words in zip(hf, (["a", "b"], ["a", "c"]), strict=True):
        vocab = {w: i for i, w in enumerate(words)}
        Tokenizer(models.WordLevel(vocab, unk_token="a")).save(str(Path(d) / "tokenizer.json"))
    with pytest.raises(
        ConfigError, match=r"vocabularies \(tokenizer.json sha256 [0-9a-f]{16} vs sha256 "
    ):
        TokenMix(_mix((hf[0], 1), (hf[1], 1)), block_size=8)
    # the same vocabulary stored as uint32: mixed
    wide = tmp_path / "wide"
    _tokens(wide, ids, dtype="uint32", tokenizer="char", chars="".join(map(chr, range(65, 125))))
    mixed = TokenMix(_mix((base, 1), (str(wide), 3)), block_size=8)
    assert mixed[len(mixed.sources[0]) + 5][0].tolist() == ids[5:13].tolist()


def test_a_source_too_small_for_its_share_and_other_resumes_are_refused(tmp_path):
    big = _tokens(tmp_path / "big", np.arange(5000) % 50, np.arange(500) % 50)
    small = _tokens(tmp_path / "small", np.arange(40) % 50, np.arange(500) % 50)
    mix = TokenMix(_mix((big, 0.5), (small, 0.5)), block_size=8)
    with pytest.raises(ConfigError) as e:
        mix.batch_sampler(8, 0, 1, seed=0)
    assert str(e.value) == (
        "data.mix source small holds 40 tokens: 3 windows of 9, fewer than the 5 a step may "
        "take from it (weight 0.5 of train.batch_size=8); lower train.batch_size or "
        "data.block_size, or give it less weight"
    )
    state = TokenMix(_mix((big, 0.5), (small, 0.5)), block_size=2).batch_sampler(4, 0, 1, 0)
    saved = state.state_dict()

    def named(sampler: MixSampler) -> str:
        return ", ".join(
            f"{s['dir']} (weight {float(Fraction(s['weight'])):.4g}, {s['data']['tokens']:,} "
            f"tokens, fingerprint {s['data']['fingerprint']})"
            for s in sampler.sources
        )

    for entries in ([(big, 0.6), (small, 0.4)], [(small, 0.5), (big, 0.5)]):
        other = TokenMix(_mix(*entries), block_size=2).batch_sampler(4, 0, 1, 0)
        with pytest.raises(NotResumable) as e:
            other.load_state_dict(saved)
        assert str(e.value) == (
            f"the mix {named(other)} is not the mix the checkpoint was trained on, "
            f"{named(state)}: the data order would not continue; resume with that data.mix "
            "(the same tokens, in the same order, with the same weights), or start a fresh "
            "run in a new hydra.run.dir (without resume)"
        )
    # the same weights written otherwise (1:1) and the same tokens elsewhere: the same mix
    (tmp_path / "moved").mkdir()
    for f in ("train.bin", "val.bin", "meta.json"):
        (tmp_path / "moved" / f).write_bytes((Path(small) / f).read_bytes())
    moved = TokenMix(_mix((big, 2), (str(tmp_path / "moved"), 2)), block_size=2)
    sampler = moved.batch_sampler(4, 0, 1, 0)
    sampler.load_state_dict({**saved, "step": 9})
    assert sampler.step == 9
    # one stream's state into a mix, and a mix's into one stream
    one = TokenData(dir=big, block_size=2).batch_sampler(4, 0, 1, 0)
    with pytest.raises(NotResumable, match="trained on one token stream, not on the mix"):
        sampler.load_state_dict(one.state_dict())
    with pytest.raises(NotResumable, match="trained on a data.mix of 2 token directories"):
        one.load_state_dict(saved)


def test_names_are_the_basenames_made_unique():
    assert source_names(["data/web", "other/web/", "code", "x/web_2"]) == [
        "web", "web_2", "code", "web_2_2",
    ]  # fmt: skip
