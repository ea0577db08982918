"""Corpus preparation beside nanoGPT's and llm.c's own scripts: tokens per second at 1 and 2
workers, peak memory at two corpus sizes, and nanoGPT's shakespeare_char recipe trained from a
parquet column (docs/own_text.md, "A real corpus").

    python scripts/benchmarks/bench_prepare.py --nanogpt ~/src/nanoGPT --llmc ~/src/llm.c \
        --input input.txt --md prepare.md

`--nanogpt DIR` and `--llmc DIR` are checkouts of github.com/karpathy/nanoGPT and
karpathy/llm.c that the user brings; none of their code is copied here. Everything runs in a
temporary directory removed at the end, and nothing downloads. The corpus and its tokenizer:
[Note: a FineWeb-like corpus]; their scripts: [Note: their scripts, adapted only to read the
local files]; what is timed and summed: [Note: rounds, tokens and memory].

Parts (`--parts`, all by default):
    speed        ours (`scripts/prepare_text.py`) at --workers 1 and 2, nanoGPT's
                 data/openwebtext/prepare.py at num_proc 1 and 2, llm.c's
                 dev/data/fineweb.py with a pool of 1 and 2 processes, in rounds
    memory       ours at both worker counts on the speed corpus and on one 10x larger
    shakespeare  `--input` (karpathy/char-rnn's data/tinyshakespeare/input.txt) prepared with
                 `--tokenizer char` as a text file and as a parquet column with one row per
                 speech (the blocks between blank lines, each without its trailing newline),
                 then bench_nanogpt.py's recipe on each: [Note: shakespeare both ways]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
PREPARE = ROOT / "scripts" / "prepare_text.py"
EOT = "<|endoftext|>"
WORKERS = (1, 2)
POLL_S = 0.05  # memory sampling period; the wall time is taken at the exit itself
NANOGPT_SCRIPT = Path("data/openwebtext/prepare.py")
LLMC_SCRIPT = Path("dev/data/fineweb.py")


# [Note: a FineWeb-like corpus]
# Documents of lognormal length (median `--words` words, sigma 1: from a few tens to a few
# thousand words for 98% of them), words drawn from 20,000 pseudo-words built of syllables
# with a Zipf-like law (rank r with weight 1/(r + 2.7)), each followed by a space, a comma,
# a full stop or a full stop and a line end; all from one seeded numpy generator, so the
# same arguments give the same bytes. The documents go, in order, into parquet files of a
# `text` and an `id` column (FineWeb's layout, less its other metadata), row groups of 1,000
# rows: `--docs` documents in `--shards` files for the speed part. The memory part's larger
# corpus is 10x the documents in 10x the files of the same size (a corpus grows by its
# number of files), drawn at once, its first `--shards` files then the speed corpus (without
# the memory part, the speed corpus is drawn alone: other documents of the same law). The
# tokenizer is a byte-level BPE (GPT-2's pre-tokenizer and byte alphabet) trained by the
# `tokenizers` library on the first tenth of the speed corpus, `--vocab` ids with
# <|endoftext|> among them, saved with transformers' save_pretrained, eos_token set.
def vocabulary(rng: np.random.Generator, n: int = 20000) -> list[str]:
    syllables = [c + v for c in "bcdfghklmnprstvwz" for v in "aeiou"] + ["th", "qu", "st"]
    lengths = rng.integers(1, 5, size=n)
    picks = rng.integers(0, len(syllables), size=int(lengths.sum()))
    words, at = [], 0
    for k in lengths:
        words.append("".join(syllables[i] for i in picks[at : at + k]))
        at += k
    return words


def documents(n: int, words: int = 400, seed: int = 0) -> list[str]:
    """`n` documents of the corpus (see [Note: a FineWeb-like corpus])."""
    rng = np.random.default_rng(seed)
    vocab = vocabulary(rng)
    forms = np.array([w + s for s in (" ", ", ", ". ", ".\n") for w in vocab], dtype=object)
    weight = 1.0 / (np.arange(len(vocab)) + 2.7)
    lengths = np.clip(rng.lognormal(np.log(words), 1.0, size=n), 8, 50 * words).astype(np.int64)
    total = int(lengths.sum())
    word = rng.choice(len(vocab), size=total, p=weight / weight.sum())
    suffix = rng.choice(4, size=total, p=[0.86, 0.06, 0.06, 0.02])
    picks = forms[suffix * len(vocab) + word]
    out, at = [], 0
    for k in lengths:
        text = "".join(picks[at : at + k]).rstrip()
        out.append(text[0].upper() + text[1:])
        at += k
    return out


def write_corpus(directory: Path, docs: list[str], shards: int) -> list[Path]:
    """The documents, in order, in `shards` parquet files of a `text` and an `id` column."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    directory.mkdir(parents=True, exist_ok=True)
    bounds = np.linspace(0, len(docs), shards + 1).astype(int)
    files = []
    for i in range(shards):
        a, b = int(bounds[i]), int(bounds[i + 1])
        ids = [f"<urn:doc:{j:09d}>" for j in range(a, b)]
        files.append(directory / f"{i:03d}_00000.parquet")
        pq.write_table(pa.table({"text": docs[a:b], "id": ids}), files[-1], row_group_size=1000)
    return files


def train_tokenizer(docs: list[str], directory: Path, vocab: int) -> Path:
    """A byte-level BPE tokenizer of `vocab` ids trained on `docs`, saved as a local Hugging
    Face tokenizer directory (tokenizer.json, tokenizer_config.json with eos_token)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[EOT], show_progress=False,
    )  # fmt: skip
    tok.train_from_iterator(docs, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOT).save_pretrained(directory)
    return directory


# [Note: their scripts, adapted only to read the local files]
# Each script runs as `__main__` in a fresh interpreter, from a copy in its run directory (both
# write beside `__file__`), with two stand-ins first on PYTHONPATH, written by `standins`:
# - `tiktoken`: get_encoding("gpt2") is the corpus's tokenizer (encode_ordinary, eot_token,
#   _special_tokens, n_vocab, max_token_value; built once per process and pickled by name, as
#   tiktoken's own), run by the `tokenizers` library as ours is, so all three write the same
#   ids (theirs `encode` one document at a time, as they call encode_ordinary; ours batches
#   them through encode_batch; <|endoftext|> inside a text would differ: the corpus has none);
# - `run_anchor.py`, which has `datasets.load_dataset(<hub name>, <subset>, **kw)` load the
#   parquet shards instead (`load_dataset("parquet", data_files=..., **kw)`: their split and
#   num_proc kept), puts the checkout's script folder on sys.path (llm.c's data_common) and
#   runs the script. The datasets cache is the run's own directory, fresh each run.
# Changed lines, each found exactly once or the benchmark stops (`EDITS`): the worker count,
# a constant in both (nanoGPT's `num_proc = 8`, its comment suggesting about half the cores;
# llm.c's `nprocs = max(1, os.cpu_count() - 2)`, 1 on two cores); and nanoGPT's
# `total_batches = 1024`, made `min(1024, len(dset))`: it writes each split in 1024 pieces
# and fails on a split of fewer documents (its val split is 0.05% of them: 1024 needs two
# million documents); the same for a split of 1024 or more. Every other line runs as it is.
EDITS = {
    "nanogpt": [
        (r"^num_proc = \d+[ \t]*$", "num_proc = {n}"),
        (r"^([ \t]+)total_batches = 1024[ \t]*$", r"\1total_batches = min(1024, len(dset))"),
    ],
    "llmc": [(r"^nprocs = max\(1, os\.cpu_count\(\) - 2\).*$", "nprocs = {n}")],
}

TIKTOKEN = f'''"""Stand-in for tiktoken written by scripts/benchmarks/bench_prepare.py:
get_encoding("gpt2") is the Hugging Face tokenizer in $BENCH_PREPARE_TOKENIZER."""
import os

from tokenizers import Tokenizer

_built = {{}}


class Encoding:
    def __init__(self, name):
        path = os.path.join(os.environ["BENCH_PREPARE_TOKENIZER"], "tokenizer.json")
        self.name, self._tokenizer = name, Tokenizer.from_file(path)
        self.eot_token = self._tokenizer.token_to_id({EOT!r})
        self._special_tokens = {{{EOT!r}: self.eot_token}}
        self.n_vocab = self._tokenizer.get_vocab_size(with_added_tokens=True)
        self.max_token_value = self.n_vocab - 1

    def encode_ordinary(self, text):
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def __reduce__(self):  # a worker builds its own, by name
        return get_encoding, (self.name,)


def get_encoding(name):
    if name != "gpt2":
        raise ValueError(f"this stand-in has only gpt2, not {{name!r}}")
    if name not in _built:
        _built[name] = Encoding(name)
    return _built[name]
'''

RUN_ANCHOR = '''"""Written by scripts/benchmarks/bench_prepare.py: `run_anchor.py SCRIPT HOME
ARGS...` runs SCRIPT as __main__, HOME on sys.path, load_dataset reading the local files."""
import os
import runpy
import sys

import datasets

_load = datasets.load_dataset
_files = os.environ["BENCH_PREPARE_FILES"].split(os.pathsep)


def load_dataset(path, name=None, **kwargs):  # the hub's dataset and subset: the local shards
    return _load("parquet", data_files=_files, **kwargs)


datasets.load_dataset = load_dataset
script, home = sys.argv[1], sys.argv[2]
sys.argv = [script, *sys.argv[3:]]
sys.path.insert(0, home)
runpy.run_path(script, run_name="__main__")
'''


def standins(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tiktoken.py").write_text(TIKTOKEN)
    (directory / "run_anchor.py").write_text(RUN_ANCHOR)
    return directory


def adapted(source: str, anchor: str, workers: int, name: str) -> str:
    """Their script with the lines of EDITS[anchor] changed, each found exactly once."""
    for pattern, replacement in EDITS[anchor]:
        source, found = re.subn(pattern, replacement.format(n=workers), source, flags=re.M)
        if found != 1:
            raise SystemExit(
                f"{name}: {found} lines match {pattern!r}, expected 1 (a version of the "
                "script this benchmark does not know)"
            )
    return source


# ---------------------------------------------------------------------------------------
# Runs


# [Note: rounds, tokens and memory]
# Each round runs every contender once, the order rotated from round to round so that the
# machine's drift (other jobs on its two cores) hits all alike; ratios are taken within a
# round and their median reported beside the per-round values. A run is a fresh process
# timed from its start to its exit (imports, reading the parquet files, the datasets cache
# theirs build, tokenizing and writing), and its tokens are counted from what it wrote (a
# header of llm.c's format gives its count, else size / dtype). All contenders write the
# same documents' tokens and one <|endoftext|> per document, nanoGPT's after each, llm.c's
# before each, ours between two of a split (its meta.json: none after the last of train and
# of val): counts that differ once that is added to ours stop the benchmark. Every run has
# TOKENIZERS_PARALLELISM=false, so that a worker is one core: ours at --workers 1 calls the
# library's encode_batch in its own process, which would otherwise spread over the library's
# thread pool (theirs call encode, one document on one thread, either way).
# Memory: every POLL_S the process tree (found through /proc/*/stat parents) is summed, PSS
# (each shared page split between its sharers: forked workers are not counted twice) and
# RSS; the peak of each sum is reported, with the largest process's peak RSS (VmHWM, which
# only grows: a peak between two samples shows at the next, unless the process has ended
# by then; wait4's maxrss is not used, a child forked from this process inherits this
# process's high-water mark). CPU s: user + system time of the process and the workers it
# reaped (wait4), which the machine's load moves less than the wall time.


def descendants(pid: int) -> list[int]:
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
            parents.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += parents.get(p, [])
    return out


def tree_memory(pid: int) -> tuple[int, int, dict[int, int]]:
    """(PSS, RSS) in bytes summed over `pid` and its descendants, and each one's VmHWM."""
    pss = rss = 0
    hwm = {}
    for p in descendants(pid):
        try:
            with open(f"/proc/{p}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        pss += int(line.split()[1]) * 1024
                    elif line.startswith("Rss:"):
                        rss += int(line.split()[1]) * 1024
            with open(f"/proc/{p}/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        hwm[p] = int(line.split()[1]) * 1024
        except (OSError, ValueError):
            continue  # gone between the listing and the read
    return pss, rss, hwm


def measured(argv: list[str], cwd: Path, env: dict, log: Path) -> dict:
    """Run `argv` to its end: wall seconds and peak memory (see [Note: rounds, tokens and
    memory]); a failure stops the benchmark with the end of its output."""
    done: dict = {}
    with open(log, "w") as out:
        t0 = time.perf_counter()
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)

        def reap() -> None:
            done["wait"] = os.wait4(proc.pid, 0)
            done["end"] = time.perf_counter()

        waiter = threading.Thread(target=reap)
        waiter.start()
        pss = rss = 0
        hwm: dict[int, int] = {}
        while waiter.is_alive():
            p, r, h = tree_memory(proc.pid)
            pss, rss = max(pss, p), max(rss, r)
            hwm.update(h)  # each process's high-water mark only grows
            waiter.join(POLL_S)
    _, status, usage = done["wait"]
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        tail = log.read_text()[-3000:]
        raise SystemExit(f"{' '.join(map(str, argv))} failed ({proc.returncode}):\n{tail}")
    return {
        "wall_s": done["end"] - t0,
        "cpu_s": usage.ru_utime + usage.ru_stime,  # the tree's, its workers reaped
        "peak_pss": pss,
        "peak_rss": rss,
        "largest_hwm": max(hwm.values(), default=0),
    }


MAGIC = {20240520: np.uint16, 20240801: np.uint32}  # llm.c's header: magic, version, count


def tokens_in(directory: Path, dtype: str = "uint16") -> int:
    """Tokens in the .bin files of `directory` (and its subfolders)."""
    meta = directory / "meta.json"
    if meta.is_file():
        dtype = json.loads(meta.read_text()).get("dtype", dtype)
    n = 0
    for f in sorted(directory.rglob("*.bin")):
        head = np.fromfile(f, dtype=np.int32, count=256)
        if len(head) == 256 and int(head[0]) in MAGIC:
            n += int(head[2])
        else:
            n += f.stat().st_size // np.dtype(dtype).itemsize
    return n


def command(who: str, workers: int, args: argparse.Namespace, corpus: dict, run: Path) -> tuple:
    """(argv, env, output directory) of one run; the anchors' adapted script is written here."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "BENCH_PREPARE"))}
    env.update(
        HF_DATASETS_CACHE=str(run / "hf_cache"), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
        BENCH_PREPARE_TOKENIZER=str(corpus["tokenizer"]),
        BENCH_PREPARE_FILES=os.pathsep.join(map(str, corpus["files"])),
    )  # fmt: skip
    if who == "ours":
        argv = [sys.executable, str(PREPARE), *map(str, corpus["files"]), "--out", str(run / "out")]
        argv += ["--tokenizer", str(corpus["tokenizer"]), "--text-field", "text"]
        argv += ["--workers", str(workers), "--shard-tokens", str(args.shard_tokens)]
        return argv, env, run / "out"
    checkout, script = (
        (args.nanogpt, NANOGPT_SCRIPT) if who == "nanogpt" else (args.llmc, LLMC_SCRIPT)
    )
    source = (checkout / script).read_text()
    copy = run / script.name
    copy.write_text(adapted(source, who, workers, str(checkout / script)))
    paths = [str(corpus["standins"]), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    argv = [sys.executable, str(corpus["standins"] / "run_anchor.py"), str(copy)]
    argv.append(str((checkout / script).parent.absolute()))
    if who == "llmc":
        argv += ["--shard_size", str(args.shard_tokens)]
    return argv, env, run


def run_one(who: str, workers: int, args: argparse.Namespace, corpus: dict, run: Path) -> dict:
    shutil.rmtree(run, ignore_errors=True)
    run.mkdir(parents=True)
    argv, env, out = command(who, workers, args, corpus, run)
    load = os.getloadavg()[0]
    result = measured(argv, run, env, run.parent / f"{run.name}.log")
    result.update(tokens=tokens_in(out), load_1min=load)
    result["tokens_per_s"] = result["tokens"] / result["wall_s"]
    # one end-of-text token per document in theirs; in ours none after a split's last
    result["eot_short"] = 0
    if who == "ours":
        documents = json.loads((out / "meta.json").read_text())["documents"]
        result["eot_short"] = sum(1 for n in documents.values() if n)
    shutil.rmtree(run)  # the run's outputs and datasets cache: the disk is not for keeping
    return result


def speed(args: argparse.Namespace, corpus: dict, work: Path) -> dict:
    names = [(who, n) for n in WORKERS for who in ("ours", "nanogpt", "llmc")]
    runs: dict[str, list[dict]] = {f"{w}_w{n}": [] for w, n in names}
    for r in range(args.rounds):
        for who, n in names[r % len(names) :] + names[: r % len(names)]:
            res = run_one(who, n, args, corpus, work / f"r{r}_{who}_w{n}")
            runs[f"{who}_w{n}"].append(res)
            print(
                f"round {r} {who:8s} workers {n}: {res['tokens']} tokens in {res['wall_s']:6.2f} s"
                f" = {res['tokens_per_s']:9.0f} tokens/s, peak PSS {res['peak_pss'] / 2**20:6.0f}"
                f" MiB, load {res['load_1min']:.2f}",
                flush=True,
            )
    counts = {k: {r["tokens"] + r["eot_short"] for r in v} for k, v in runs.items()}
    if len(set().union(*counts.values())) != 1:
        raise SystemExit(
            "the contenders wrote different tokens (counted with one end-of-text token per "
            f"document): {counts}"
        )
    ratios = {}
    for n in WORKERS:
        for theirs in ("nanogpt", "llmc"):
            ratios[f"ours/{theirs} w{n}"] = per_round(runs[f"ours_w{n}"], runs[f"{theirs}_w{n}"])
    ratios["ours w2/ours w1"] = per_round(runs["ours_w2"], runs["ours_w1"])
    return {"runs": runs, "ratios": ratios}


def per_round(ours: list[dict], theirs: list[dict]) -> dict:
    each = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(ours, theirs, strict=True)]
    return {"median": statistics.median(each), "per_round": each}


def memory(args: argparse.Namespace, small: dict, large: dict, work: Path) -> dict:
    """Ours at both worker counts, once each on the speed corpus and on the 10x one."""
    out = {}
    for label, c in (("small", small), ("large", large)):
        for n in WORKERS:
            out[f"{label}_w{n}"] = run_one("ours", n, args, c, work / f"mem_{label}_w{n}")
    return out


# ---------------------------------------------------------------------------------------
# Shakespeare through both paths


# [Note: shakespeare both ways]
# The text file path reads input.txt as one document and holds out its last 10% of bytes
# (cut at a line end): the end of the last plays. The parquet path reads one row per speech,
# the blocks of input.txt between blank lines, each without its trailing newline (a FineWeb
# row is a document with no line end after it), puts the separator (a newline for char)
# between two rows of a split, and holds out every tenth row, spread over the whole text.
# So it tokenizes input.txt less its blank lines (7,221 characters of 1.1 M) and less the
# two separators at the ends of its splits; its val part is speeches of every play, from
# the same plays and characters as its train part, where the text path's is text after all
# it trained on. Both train the recipe of bench_nanogpt.py (`our_recipe`, imported) with
# the same seed and `--steps`; each loss is over its own val part, so they differ by that
# choice of held-out text (and the blank lines, easy to predict after a speech's last
# line, that the text path keeps), not only by the seed's noise (about 0.01 at 2000 steps).


def speeches(text: str) -> list[str]:
    rows = text.split("\n\n")
    rows[-1] = rows[-1].rstrip("\n")
    return [r for r in rows if r]


def shakespeare(args: argparse.Namespace, work: Path) -> dict:
    import pyarrow as pa
    import pyarrow.parquet as pq

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_nanogpt import our_recipe

    text = args.input.read_text()
    rows = speeches(text)
    table = work / "shakespeare.parquet"
    pq.write_table(pa.table({"text": rows}), table)
    out = {"rows": len(rows), "chars": len(text)}
    sources = {
        "text file": [str(args.input)],
        "parquet column": [str(table), "--text-field", "text"],
    }
    for label, source in sources.items():
        data = work / f"shakespeare_{label.split()[0]}"
        cmd = [sys.executable, str(PREPARE), *source, "--out", str(data), "--tokenizer", "char"]
        subprocess.run(cmd, check=True, capture_output=True, text=True)
        meta = json.loads((data / "meta.json").read_text())
        run_dir = work / f"train_{label.split()[0]}"
        argv = [sys.executable, str(ROOT / "train.py"), *our_recipe(data, args.steps)]
        argv += [f"hydra.run.dir={run_dir}", "seed=0"]
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
        t0 = time.perf_counter()
        proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True)
        if proc.returncode:
            raise SystemExit(f"training on {label} failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
        final = json.loads((run_dir / "final_metrics.json").read_text())
        out[label] = {
            "train_tokens": meta["tokens"]["train"],
            "val_tokens": meta["tokens"]["val"],
            "vocab_size": meta["vocab_size"],
            "val_loss": final["eval/loss"],
            "wall_s": time.perf_counter() - t0,
        }
        print(f"shakespeare {label}: {out[label]}", flush=True)
    a, b = out["parquet column"]["val_loss"], out["text file"]["val_loss"]
    out["relative_difference"] = (a - b) / b
    return out


# ---------------------------------------------------------------------------------------
# Table


def markdown(result: dict) -> str:
    lines = [f"{result['cpus']} CPUs", ""]
    if "corpus" in result:
        c = result["corpus"]
        lines[0] += (
            f"; corpus: {c['docs']} documents in {c['shards']} parquet files, "
            f"{c['text_mb']:.1f} MB of text, byte-level BPE of {c['vocab']} ids; "
            f"{result.get('rounds', 0)} rounds, medians; output shards of "
            f"{result['shard_tokens']} tokens"
        )
        if "large_docs" in c:
            lines[0] += (
                f"; the memory part's larger corpus: {c['large_docs']} documents in "
                f"{c['large_shards']} files, {c['large_text_mb']:.1f} MB"
            )
    if "speed" in result:
        lines += [
            "| contender | workers | tokens | wall s | tokens/s | CPU s | peak PSS MiB "
            "| load (1 min) |",
            "|---|---:|---:|---:|---:|---:|---:|---|",
        ]
        label = {"ours": "ours", "nanogpt": "nanoGPT prepare.py", "llmc": "llm.c fineweb.py"}
        for key, rs in result["speed"]["runs"].items():
            who, n = key.rsplit("_w", 1)
            loads = ", ".join(f"{r['load_1min']:.1f}" for r in rs)
            lines.append(
                f"| {label[who]} | {n} | {rs[0]['tokens']} "
                f"| {statistics.median(r['wall_s'] for r in rs):.2f} "
                f"| {statistics.median(r['tokens_per_s'] for r in rs):,.0f} "
                f"| {statistics.median(r['cpu_s'] for r in rs):.2f} "
                f"| {statistics.median(r['peak_pss'] for r in rs) / 2**20:.0f} | {loads} |"
            )
        lines += ["", "| ratio of tokens/s | median | per round | goal |", "|---|---:|---|---|"]
        goals = {"ours w2/ours w1": ">= 1.8"}
        for key, v in result["speed"]["ratios"].items():
            per = ", ".join(f"{x:.2f}" for x in v["per_round"])
            goal = goals.get(key, ">= 1.0" if key.endswith("w1") else "")
            lines.append(f"| {key} | {v['median']:.2f} | {per} | {goal} |")
        lines.append("")
    if "memory" in result:
        m = result["memory"]
        lines += [
            "| ours, workers | corpus | tokens | wall s | tokens/s | peak PSS MiB | peak RSS MiB "
            "| largest process MiB |",
            "|---:|---|---:|---:|---:|---:|---:|---:|",
        ]
        for n in WORKERS:
            for label in ("small", "large"):
                r = m[f"{label}_w{n}"]
                name = {"small": "speed corpus", "large": "10x"}[label]
                lines.append(
                    f"| {n} | {name} | {r['tokens']} | {r['wall_s']:.2f} "
                    f"| {r['tokens_per_s']:,.0f} | {r['peak_pss'] / 2**20:.0f} "
                    f"| {r['peak_rss'] / 2**20:.0f} | {r['largest_hwm'] / 2**20:.0f} |"
                )
        lines.append("")
        for n in WORKERS:
            ratio = m[f"large_w{n}"]["peak_pss"] / m[f"small_w{n}"]["peak_pss"]
            lines.append(
                f"- workers {n}: peak PSS 10x / speed corpus {ratio:.3f} (goal: within 10%)"
            )
        scale = m["large_w2"]["tokens_per_s"] / m["large_w1"]["tokens_per_s"]
        lines.append(f"- tokens/s on the 10x corpus, workers 2 / 1: {scale:.2f} (one run each)")
        lines.append("")
    if "shakespeare" in result:
        s = result["shakespeare"]
        lines += [
            f"shakespeare_char recipe, {result['steps']} steps, seed 0; the parquet column: "
            f"{s['rows']} rows (speeches)",
            "",
            "| data | train tokens | val tokens | vocab | val loss |",
            "|---|---:|---:|---:|---:|",
        ]
        for label in ("text file", "parquet column"):
            r = s[label]
            lines.append(
                f"| {label} | {r['train_tokens']} | {r['val_tokens']} | {r['vocab_size']} "
                f"| {r['val_loss']:.4f} |"
            )
        lines.append(f"\nval loss, parquet / text file - 1: {s['relative_difference']:+.2%}")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nanogpt", type=Path, help="a nanoGPT checkout (the speed part)")
    ap.add_argument("--llmc", type=Path, help="an llm.c checkout (the speed part)")
    ap.add_argument("--input", type=Path, help="tiny-shakespeare's input.txt (that part)")
    ap.add_argument("--parts", default="speed,memory,shakespeare")
    ap.add_argument("--docs", type=int, default=4000, help="documents of the speed corpus")
    ap.add_argument("--words", type=int, default=400, help="median words per document")
    ap.add_argument("--shards", type=int, default=8, help="parquet files of each corpus")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--shard-tokens", type=int, default=10**6, help="ours and llm.c's shards")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=2000, help="the shakespeare recipe's steps")
    ap.add_argument("--threads", type=int, default=2, help="torch threads of the training")
    ap.add_argument("--seed", type=int, default=0, help="of the corpus")
    ap.add_argument("--keep", type=Path, help="work here and keep it (default: a temp dir)")
    ap.add_argument("--out", type=Path, help="JSON results")
    ap.add_argument("--md", type=Path, help="markdown table")
    args = ap.parse_args(argv)
    args.parts = [p for p in args.parts.split(",") if p]
    unknown = set(args.parts) - {"speed", "memory", "shakespeare"}
    if unknown:
        ap.error(f"--parts {sorted(unknown)} unknown; choose from speed, memory, shakespeare")
    if "speed" in args.parts:
        for flag, d, script in (
            ("nanogpt", args.nanogpt, NANOGPT_SCRIPT),
            ("llmc", args.llmc, LLMC_SCRIPT),
        ):
            if d is None or not (d / script).is_file():
                ap.error(
                    f"--{flag} {d} has no {script}: give a checkout (or leave out the speed part)"
                )
    if "shakespeare" in args.parts and (args.input is None or not args.input.is_file()):
        ap.error(f"--input {args.input} is not a file: give tiny-shakespeare's input.txt")
    if args.docs < args.shards:
        ap.error(f"--docs {args.docs} is fewer than --shards {args.shards}: a file each at least")
    return args


def corpora(args: argparse.Namespace, work: Path, ten: bool) -> tuple[dict, dict | None]:
    """The speed corpus and (`ten`) the one 10x larger that begins with it
    ([Note: a FineWeb-like corpus])."""
    docs = documents(args.docs * (10 if ten else 1), args.words, args.seed)
    files = write_corpus(work / "corpus", docs, args.shards * (10 if ten else 1))
    per_file = np.linspace(0, len(docs), len(files) + 1).astype(int)
    n = int(per_file[args.shards])  # the documents of the first --shards files
    common = {
        "tokenizer": train_tokenizer(docs[: max(n // 10, 1)], work / "tokenizer", args.vocab),
        "standins": standins(work / "standins"),
    }
    small = {"files": files[: args.shards], "docs": n, **common}
    small["text_mb"] = sum(len(d.encode()) for d in docs[:n]) / 1e6
    if not ten:
        return small, None
    large = {"files": files, "docs": len(docs), **common}
    large["text_mb"] = sum(len(d.encode()) for d in docs) / 1e6
    return small, large


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench_prepare_") as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        result: dict = {"cpus": os.cpu_count(), "shard_tokens": args.shard_tokens}
        if {"speed", "memory"} & set(args.parts):
            small, large = corpora(args, work, ten="memory" in args.parts)
            result["corpus"] = {
                "docs": small["docs"], "shards": args.shards, "text_mb": small["text_mb"],
                "vocab": args.vocab,
            }  # fmt: skip
            if large is not None:
                result["corpus"].update(
                    large_docs=large["docs"], large_shards=len(large["files"]),
                    large_text_mb=large["text_mb"],
                )  # fmt: skip
        if "speed" in args.parts:
            result["rounds"] = args.rounds
            result["speed"] = speed(args, small, work)
        if "memory" in args.parts:
            result["memory"] = memory(args, small, large, work)
        if "shakespeare" in args.parts:
            result["steps"] = args.steps
            result["shakespeare"] = shakespeare(args, work)
    text = markdown(result)
    print(text)
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    if args.md:
        args.md.write_text(text)


if __name__ == "__main__":
    main()
