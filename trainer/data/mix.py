"""Several token directories trained on together, mixed by weight: `data=token_file
data.mix='[{dir: data/web, weight: 0.7}, {dir: data/code, weight: 0.3}]'`.

- `TokenMix`: the directories' TokenData side by side, one index space: item
  `offset_k + i` is item i of source k, offset_k the items of the sources before it
  (training: the window at token i of its split; evaluation: its i-th held-out window).
  Held out, each source is a part of its own (`parts()`): evaluated alone, reported as
  `eval/loss/<name>`, and weighted into `eval/loss` ([Note: held-out figures of a mix]).
- `MixSampler`: each step's global batch drawn from the step alone, as WindowSampler
  draws it, as many windows from each source as the weights say ([Note: a step's windows
  from several sources]); it reports the tokens each source gave (`data/tokens/<name>`).
- `check_mix`: the list as given, one line per bad value (trainer/config/checks.py runs
  it before the ranks start); `token_data`: what conf/data/token_file.yaml builds, a
  TokenData or, with `mix`, a TokenMix.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import OmegaConf
from torch.utils.data import Dataset, Sampler

from trainer.data.tokens import TokenData
from trainer.errors import ConfigError, NotResumable

EXAMPLE = "data.mix='[{dir: data/web, weight: 0.7}, {dir: data/code, weight: 0.3}]'"
ENTRY_KEYS = ("dir", "weight")
# What a token id means, per directory: a mix of directories that differ in one of
# these is refused (the dtype may differ: it is how the ids are stored, not what they are)
VOCABULARY = ("tokenizer", "vocab_size", "chars", "stoi", "tokenizer.json")


def token_data(mix: Any = None, **options: Any) -> TokenData | TokenMix:
    """`data=token_file`'s dataset: TokenData(**options) without `mix`, else a TokenMix of
    its directories (`options` then hold no dir, path or val_path: `check_mix`)."""
    if mix is None:
        return TokenData(**options)
    given = {k: options.pop(k, None) for k in ("dir", "path", "val_path")}
    return TokenMix(check_mix(mix, given), **options)


def check_mix(mix: Any, others: Mapping[str, Any] | None = None) -> list[tuple[str, Fraction]]:
    """`data.mix` as (dir, weight) pairs, the weights exact as written (0.7 is 7/10); one
    line naming the first bad value otherwise. `others`: data.dir, data.path and
    data.val_path, which a mix leaves null."""
    if OmegaConf.is_config(mix):
        mix = OmegaConf.to_container(mix, resolve=True)
    for key, value in (others or {}).items():
        if value is not None:
            raise ConfigError(
                f"data.mix with data.{key}={value}: a mix reads the directories it names "
                f"only; set data.{key}=null, or drop data.mix"
            )
    if not isinstance(mix, list | tuple):
        raise ConfigError(f"data.mix={mix!r} must be a list of {{dir: DIR, weight: W}}: {EXAMPLE}")
    if not mix:
        raise ConfigError(f"data.mix=[] names no directory: {EXAMPLE}, or data.mix=null")
    out: list[tuple[str, Fraction]] = []
    seen: dict[Path, int] = {}
    for i, entry in enumerate(mix):
        where = f"data.mix[{i}]"
        if not isinstance(entry, dict):
            raise ConfigError(f"{where}={entry!r} must be {{dir: DIR, weight: W}}: {EXAMPLE}")
        unknown = [k for k in entry if k not in ENTRY_KEYS]
        if unknown:
            raise ConfigError(
                f"{where}.{unknown[0]} is not a key of a mix entry; use dir and weight"
            )
        d, w = entry.get("dir"), entry.get("weight")
        if d is None:
            raise ConfigError(f"{where} has no dir: each entry is {{dir: DIR, weight: W}}")
        if not isinstance(d, str) or not Path(d).expanduser().is_dir():
            raise ConfigError(f"{where}.dir={d} is not a directory")
        if w is None:
            raise ConfigError(f"{where} ({d}) has no weight: each entry is {{dir: DIR, weight: W}}")
        # `not w > 0` rather than `w <= 0`: NaN compares false either way
        if not isinstance(w, int | float) or isinstance(w, bool) or not 0 < w < math.inf:
            shown = w if isinstance(w, int | float) and not isinstance(w, bool) else repr(w)
            raise ConfigError(f"{where}.weight={shown} must be a positive number")
        real = Path(d).expanduser().resolve()
        if real in seen:
            first = seen[real]
            raise ConfigError(
                f"{where}.dir={d} is data.mix[{first}].dir={mix[first]['dir']} again; give "
                "each directory once, with its whole weight"
            )
        seen[real] = i
        out.append((d, Fraction(repr(w)) if isinstance(w, float) else Fraction(w)))
    return out


def source_names(dirs: Sequence[str]) -> list[str]:
    """Each directory's name in figures: its basename, `_2`, `_3`, ... on a repeat."""
    names: list[str] = []
    for d in dirs:
        base = Path(os.path.abspath(os.path.expanduser(d))).name or "data"
        name, n = base, 1
        while name in names:
            n += 1
            name = f"{base}_{n}"
        names.append(name)
    return names


def vocabulary(data: TokenData) -> dict[str, Any]:
    """What a token id of `data` means: its meta file's tokenizer fields and the hash of
    the tokenizer.json beside it (None where absent)."""
    tokenizer = data.files[0].parent / "tokenizer.json"
    found = {k: data.meta.get(k) for k in VOCABULARY[:-1]}
    if tokenizer.is_file():
        found["tokenizer.json"] = hashlib.sha256(tokenizer.read_bytes()).hexdigest()[:16]
    else:
        found["tokenizer.json"] = None
    return found


def _brief(key: str, value: Any) -> str:
    if value is None:
        return "none"
    if key == "tokenizer.json":
        return f"sha256 {value}"
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:32]}... ({len(value)} entries)"


def check_same_vocabulary(dirs: Sequence[str], sources: Sequence[TokenData]) -> None:
    """Refuse directories whose ids mean other tokens, naming both and the field."""
    first = vocabulary(sources[0])
    for d, data in zip(dirs[1:], sources[1:], strict=True):
        other = vocabulary(data)
        for key in VOCABULARY:
            if first[key] != other[key]:
                how = (  # a char vocabulary is the characters of its own text
                    "--tokenizer bytes or a tokenizer directory: a char vocabulary is its "
                    "text's characters"
                    if key == "chars"
                    else "the same --tokenizer"
                )
                raise ConfigError(
                    f"data.mix: {dirs[0]} and {d} have different vocabularies ({key} "
                    f"{_brief(key, first[key])} vs {_brief(key, other[key])}): a token id "
                    f"must mean the same in every directory; prepare them with {how} "
                    "(scripts/prepare_text.py)"
                )


# [Note: held-out figures of a mix]
# Held out, each source's val split is a part of its own: make_eval_loader (datasets.py)
# cuts each over the ranks as it cuts one held-out set (train.eval_batches global batches
# of each, at most), and evaluate (observe/metrics.py) reports each part's mean loss per
# target as `eval/loss/<name>`. `eval/loss` and `eval/accuracy` are the parts' figures
# weighted by the mix weights, sum_k w_k * loss_k: the expected loss of a window drawn as
# training draws them, whatever the sizes of the val splits (pooling every val window
# would weigh a large val split above its weight). `eval/perplexity` is exp(eval/loss).


class TokenMix(Dataset):
    """The TokenData of each directory of `mix` ((dir, weight) pairs, `check_mix`), one
    index space: item offset_k + i is source k's item i (module docstring). `options`:
    TokenData's other arguments (vocab_size, dtype, format, ...), for every source."""

    def __init__(
        self,
        mix: Sequence[tuple[str, Fraction]],
        block_size: int | None = None,
        train: bool = True,
        **options: Any,
    ) -> None:
        self.dirs = [d for d, _ in mix]
        self.names = source_names(self.dirs)
        total = sum(w for _, w in mix)
        self.weights = [w / total for _, w in mix]  # exact, summing to 1
        self.sources: list[TokenData] = []
        for i, d in enumerate(self.dirs):
            try:
                source = TokenData(dir=d, block_size=block_size, train=train, **options)
            except ConfigError as e:  # which entry: the message names data.dir
                raise ConfigError(f"data.mix[{i}]: {e}") from None
            self.sources.append(source)
        check_same_vocabulary(self.dirs, self.sources)
        self.train = train
        self.files = [f for s in self.sources for f in s.files]  # data_dir: the first's
        self.meta = self.sources[0].meta

    @property
    def block_size(self) -> int | None:
        return self.sources[0].block_size

    @block_size.setter
    def block_size(self, value: int | None) -> None:  # the model's, set by models/build.py
        for s in self.sources:
            s.block_size = value

    @property
    def vocab_size(self) -> int | None:
        return self.sources[0].vocab_size  # the same in every source, or given

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.sources)

    def max_token(self) -> int:
        return max(s.max_token() for s in self.sources)

    def data_vocab_size(self) -> int:
        return max(s.data_vocab_size() for s in self.sources)

    def offsets(self) -> np.ndarray:
        """(sources + 1,): the first item of each source, then the item count."""
        return np.concatenate([[0], np.cumsum([len(s) for s in self.sources])])

    def __len__(self) -> int:
        return int(self.offsets()[-1])

    def __getitem__(self, i: int) -> Any:
        offsets = self.offsets()
        if not 0 <= i < offsets[-1]:
            raise IndexError(f"item {i} of a mix of {offsets[-1]} items")
        k = int(np.searchsorted(offsets, i, side="right")) - 1
        return self.sources[k][int(i - offsets[k])]

    def parts(self) -> list[tuple[str, float, TokenData]]:
        """(name, weight, source) of each source: its held-out windows are evaluated as a
        part ([Note: held-out figures of a mix])."""
        return [
            (n, float(w), s) for n, w, s in zip(self.names, self.weights, self.sources, strict=True)
        ]

    def batch_sampler(self, global_batch: int, rank: int, world_size: int, seed: int) -> MixSampler:
        window = self._window()
        sampler = MixSampler(
            [s.tokens for s in self.sources], self.weights, window, global_batch, rank,
            world_size, seed, self.names,
        )  # fmt: skip
        sampler.sources = [
            {"name": n, "dir": d, "weight": str(w), "data": s.identity()}
            for n, d, w, s in zip(self.names, self.dirs, self.weights, self.sources, strict=True)
        ]
        return sampler

    def _window(self) -> int:
        """block_size + 1, each source holding at least one window (TokenData's checks)."""
        for s in self.sources:
            len(s)
        return self.block_size + 1


# [Note: a step's windows from several sources]
# Step s's global batch of B windows is drawn from (seed, s) alone, as WindowSampler's
# ([Note: windows drawn from the step] in tokens.py): no state but the step, so a resumed
# run continues bitwise in any world size and batch_of(position, ranks) is pure.
# How many windows come from source k: let T_k(S) = w_k * B * S, the windows source k is
# owed after S steps (w_k its weight over their sum, exact: 0.7 is 7/10). The windows
# taken from it by then, C_k(S), are always floor(T_k(S)) or ceil(T_k(S)): never a whole
# window off the weights, however many steps; the step takes n_k(s) = C_k(s+1) - C_k(s),
# never negative, summing to B. Rounding each T_k(S) on its own would not do: the
# roundings must also add up to B*S and never go back down, which per-step rounding of
# the cumulative targets (largest remainders) breaks. C is built step by step instead:
# each source takes floor(T_k(s+1)) (what it is owed by then) or keeps the extra window
# it already holds; the extra windows left to give (B*(s+1) minus those) go to the
# sources whose next window falls due soonest (the step at which T_k reaches
# floor(T_k) + 1; ties to the lower index): earliest deadline first, which meets every
# deadline whenever a schedule that does exists (unit jobs on B parallel slots), and one
# does (Tijdeman's chairman assignment keeps every prefix within 1). After L = M / gcd(M, B)
# steps (M the weights' common denominator) every T_k is whole, C = T, and the counts
# repeat: C(S) = (S // L) * T(L) + C(S mod L); C(S mod L) is computed from the period's
# start once (about 1.5 us a step: a resume at step 10^6 of a period that long, 1.5 s),
# then step by step, and kept.
# Within source k the n_k windows are drawn as WindowSampler draws a step's windows from
# one stream, from its own tokens, with `np.random.default_rng([seed, s, k])`: a random
# shift, then distinct windows of the grid that starts there (no token in two windows of
# the step). The step's B windows (source 0's, then source 1's, ...) are then shuffled
# with `default_rng([seed, s, K])`, K the number of sources, so that every rank gets a
# mix; rank r of p takes windows [r*b, (r+1)*b), b = B / p, as WindowSampler's ranks do.


class MixCounts:
    """C(S): the windows taken from each source over steps [0, S), for integer shares
    `shares` (proportional to the weights) and B windows a step ([Note: a step's windows
    from several sources])."""

    def __init__(self, shares: Sequence[int], batch: int) -> None:
        self.shares, self.batch, self.total = list(shares), batch, sum(shares)
        self.period = self.total // math.gcd(self.total, batch)
        self.per_period = [p * batch * self.period // self.total for p in self.shares]
        self._known: dict[int, list[int]] = {0: [0] * len(self.shares)}  # S mod P -> C

    def __call__(self, steps: int) -> list[int]:
        laps, r = divmod(steps, self.period)
        if r not in self._known:
            start = max(k for k in self._known if k <= r)
            c = self._known[start]
            for s in range(start, r):
                c = self._next(s, c)
            if len(self._known) > 8:  # the start and the latest few
                for k in sorted(self._known)[1:-4]:
                    del self._known[k]
            self._known[r] = c
        return [laps * q + c for q, c in zip(self.per_period, self._known[r], strict=True)]

    def _next(self, s: int, c: list[int]) -> list[int]:
        """C(s + 1) from C(s) = `c`: earliest deadline first."""
        b, m, n = self.batch, self.total, s + 1
        owed = [p * b * n for p in self.shares]  # T_k(s+1) * m
        floor = [t // m for t in owed]
        held = [ck > fk for ck, fk in zip(c, floor, strict=True)]  # an extra window kept
        spare = b * n - sum(floor) - sum(held)
        due = [k for k, t in enumerate(owed) if t % m and not held[k]]
        # the step at which T_k reaches floor + 1: ceil((floor + 1) * m / (p * b))
        due.sort(key=lambda k: (-(-(floor[k] + 1) * m // (self.shares[k] * b)), k))
        if not 0 <= spare <= len(due):  # cannot happen: the Note's schedule exists
            raise RuntimeError(f"mix counts at step {n}: {spare} extra windows for {due}")
        extra = set(due[:spare])
        return [f + (held[k] or k in extra) for k, f in enumerate(floor)]


def integer_shares(weights: Sequence[Fraction]) -> list[int]:
    """The smallest whole numbers in the proportion of `weights`."""
    lcm = math.lcm(*(w.denominator for w in weights))
    shares = [int(w * lcm) for w in weights]
    g = math.gcd(*shares)
    return [s // g for s in shares]


class MixSampler(Sampler[list[int]]):
    """This rank's items of each step, forever, drawn from several token streams by
    weight ([Note: a step's windows from several sources]). `tokens`: each source's
    token count; `weights`: exact, any positive scale. The position (`step`: the next
    global batch) is all its state; `sources` (set by TokenMix.batch_sampler) says what
    the data is, for a resume to check."""

    def __init__(
        self,
        tokens: Sequence[int],
        weights: Sequence[Fraction],
        window: int,
        global_batch: int,
        rank: int,
        world_size: int,
        seed: int,
        names: Sequence[str] | None = None,
    ) -> None:
        if global_batch % world_size:
            raise ConfigError(
                f"global batch {global_batch} is not divisible by world size {world_size}"
            )
        self.names = list(names) if names is not None else [str(k) for k in range(len(tokens))]
        shares = integer_shares([Fraction(w) for w in weights])
        self.counts_of = MixCounts(shares, global_batch)
        total = sum(shares)
        for name, n, p in zip(self.names, tokens, shares, strict=True):
            fewest = (n - window + 1) // window  # windows of its grid at the largest shift
            most = min(global_batch, -(-p * global_batch // total) + 1)  # ceil(w B) + 1
            if fewest < most:
                raise ConfigError(
                    f"data.mix source {name} holds {n} tokens: {fewest} windows of {window}, "
                    f"fewer than the {most} a step may take from it (weight "
                    f"{p / total:.3g} of train.batch_size={global_batch}); lower "
                    "train.batch_size or data.block_size, or give it less weight"
                )
        self.tokens, self.window, self.global_batch = list(tokens), window, global_batch
        self.offsets = np.concatenate([[0], np.cumsum([n - window + 1 for n in tokens])])
        self.rank, self.local = rank, global_batch // world_size
        self.seed, self.shares = seed, shares
        self.step = 0
        self.sources: list[dict[str, Any]] | None = None  # what each source is

    def totals(self, steps: int) -> np.ndarray:
        """(sources,) windows taken from each source over global batches [0, steps)."""
        return np.array(self.counts_of(steps), dtype=np.int64)

    def counts(self, step: int) -> np.ndarray:
        """(sources,) windows from each source in global batch `step`, summing to it."""
        return self.totals(step + 1) - self.totals(step)

    def items(self, step: int) -> np.ndarray:
        """The items (offset_k + start) of global batch `step`: (global_batch,), shuffled."""
        parts = []
        for k, n in enumerate(self.counts(step).tolist()):
            rng = np.random.default_rng([self.seed, step, k])
            shift = int(rng.integers(self.window))
            grid = (self.tokens[k] - shift) // self.window
            starts = shift + self.window * rng.choice(grid, size=n, replace=False)
            parts.append(int(self.offsets[k]) + starts)
        items = np.concatenate(parts)
        np.random.default_rng([self.seed, step, len(parts)]).shuffle(items)
        return items

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            step, self.step = self.step, self.step + 1  # the position names the next batch
            yield self.items(step)[self.rank * self.local : (self.rank + 1) * self.local].tolist()

    def batch_of(self, position: int, ranks: Sequence[int]) -> list[int]:
        """The items that `ranks` take of global batch `position`, concatenated in the
        order given ([Note: constant global batch] in comm/replicas.py)."""
        items, n = self.items(position), self.local
        return [int(i) for r in ranks for i in items[r * n : (r + 1) * n]]

    def seek(self, batches_done: int) -> None:
        self.step = batches_done

    def figures(self, steps: int) -> dict[str, float]:
        """The tokens (predictions: block_size a window) each source gave over the first
        `steps` global batches, as `data/tokens/<name>`."""
        given = self.totals(steps) * (self.window - 1)
        return {f"data/tokens/{n}": float(t) for n, t in zip(self.names, given, strict=True)}

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "seed": self.seed,
            "global_batch": self.global_batch,
            "window": self.window,
            "shares": list(self.shares),
            "tokens_each": list(self.tokens),
            **({} if self.sources is None else {"sources": self.sources}),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue at `state`'s position; refuses (NotResumable) other sources, in
        another order or with other weights, or another cutting into batches."""
        mine = self._mix_named(self.sources, self.shares, self.tokens)
        if "shares" not in state:  # a WindowSampler's: one token stream
            raise NotResumable(
                f"the checkpoint was trained on one token stream, not on the mix {mine}: "
                "the data order would not continue; resume without data.mix, or start a "
                "fresh run in a new hydra.run.dir (without resume)"
            )
        theirs = self._mix_named(state.get("sources"), state["shares"], state["tokens_each"])
        same = state["shares"] == self.shares and state["tokens_each"] == self.tokens
        if same and state.get("sources") is not None and self.sources is not None:
            content = ("tokens", "fingerprint")  # not the files: [Note: what the data is]
            same = len(state["sources"]) == len(self.sources) and all(
                a["data"][k] == b["data"][k]
                for a, b in zip(state["sources"], self.sources, strict=True)
                for k in content
            )
        if not same:
            raise NotResumable(
                f"the mix {mine} is not the mix the checkpoint was trained on, {theirs}: "
                "the data order would not continue; resume with that data.mix (the same "
                "tokens, in the same order, with the same weights), or start a fresh run in "
                "a new hydra.run.dir (without resume)"
            )
        for key in ("seed", "global_batch", "window"):
            if state.get(key) != getattr(self, key):
                raise NotResumable(
                    f"sampler state has {key}={state.get(key)} but this run has "
                    f"{key}={getattr(self, key)}; the data position cannot be resumed"
                )
        self.step = int(state["step"])

    @staticmethod
    def _mix_named(
        sources: list[dict[str, Any]] | None, shares: Sequence[int], tokens: Sequence[int]
    ) -> str:
        """'data/web (weight 0.7, 1,024 tokens, fingerprint 3f2a...), data/code (...)'."""
        total, described = sum(shares), []
        for k, (p, t) in enumerate(zip(shares, tokens, strict=True)):
            source = sources[k] if sources else None
            name = source["dir"] if source else f"source {k}"
            print_ = f", fingerprint {source['data']['fingerprint']}" if source else ""
            described.append(f"{name} (weight {p / total:.4g}, {t:,} tokens{print_})")
        return ", ".join(described)
