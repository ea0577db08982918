"""Checkpoints: exact resume in every mode, re-cutting into another mode or world size,
consolidation, bad files named without touching the disk, a killed rank recovered under
torchrun, and a hung rank reported within dist.timeout_s."""

from __future__ import annotations

import functools
import json
import os
import shutil
import struct
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch
import warm_cli
from dist_harness import run_distributed
from reference import any_loss
from test_cli import ROOT, TORCHRUN

STEPS, STOP = 6, 4  # the stopped run saves at 2 and 4; the resumed one goes on to 6
MODES = ("ddp", "zero", "fsdp")
# Small buckets and units, so that every mode has several groups with padded shards.
OPTIONS = {"ddp": {"bucket_mb": 0.004}, "zero": {"bucket_mb": 0.004}, "fsdp": {}}


def _model(seed: int, n_embd: int = 12):
    from trainer.models.builtin import GPT

    torch.manual_seed(seed)  # tied embeddings: two state_dict keys, one parameter
    return GPT(vocab_size=17, block_size=8, n_layer=2, n_head=2, n_embd=n_embd, tie_weights=True)


def _build(env, mode: str, seed: int, n_embd: int = 12, mixed: bool = False):
    from trainer.data.datasets import make_loader, synthetic_tokens
    from trainer.parallel import build_engine
    from trainer.run.optim import no_decay_bias_norm

    # eps 1e-3: see reference.OPTIMIZERS (zero-gradient parameters and rounding noise)
    adamw = functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.01, eps=1e-3)
    # mixed: bf16 with fp32 masters, and no weight decay on biases and norms (two groups)
    extra = {"precision": "bf16", "param_options": no_decay_bias_norm} if mixed else {}
    engine = build_engine(_model(seed, n_embd), mode, adamw, **OPTIONS[mode], **extra)
    # 40 samples, global batch 8: the 6 steps cross an epoch boundary.
    dataset = synthetic_tokens(n=40, block_size=8, vocab_size=17)
    return engine, make_loader(dataset, 8, env.rank, env.world_size, seed=0)


def _cfg(directory: Path, resume: str | None = None):
    from omegaconf import OmegaConf

    ckpt = {"every": 2, "dir": str(directory), "keep": 2}
    return OmegaConf.create({"ckpt": ckpt, "resume": resume, "train": {"steps": STEPS}})


def _train(env, engine, loader, cfg, stop: int = STEPS, backward=None, check_saves=False):
    """The training loop's use of checkpoints, on a small GPT. `backward(engine, x, y)`:
    the step's forward and backward (the loop's own, for a model with an aux loss);
    `check_saves`: an async save's commit at every step (each a check step here) and at
    the end, as the loop does."""
    from trainer import checkpoint

    batches = iter(loader)
    resumable = {"sampler": loader.batch_sampler}
    start = checkpoint.maybe_resume(cfg, engine, Path("unused"), **resumable)
    for step in range(start + 1, stop + 1):
        x, y = next(batches)
        if backward is None:
            engine.backward(any_loss(engine(x), y))
        else:
            backward(engine, x, y)
        engine.step()
        if check_saves:
            checkpoint.check_save(torch.device("cpu"))
        checkpoint.maybe_save(cfg, engine, Path("unused"), step, **resumable)
    if check_saves:
        checkpoint.finish_save()  # stopped before the last step: what the loop's stop does
    return start, engine.full_state_dict()


def _stop_and_resume(env, mode: str, root: Path, mixed: bool = False):
    _, want = _train(env, *_build(env, mode, 0, mixed=mixed), _cfg(root / "whole"))
    _train(env, *_build(env, mode, 0, mixed=mixed), _cfg(root / "ckpt"), stop=STOP)
    # A new engine, built from other initial values, continues from the checkpoint.
    resumed = _build(env, mode, 1, mixed=mixed)
    start, got = _train(env, *resumed, _cfg(root / "ckpt", resume="auto"))
    return start, want, got


def _resume_from(env, mode: str, path: Path, root: Path, mixed: bool = False):
    return _train(env, *_build(env, mode, 2, mixed=mixed), _cfg(root, resume=str(path)))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Per mode, on 2 ranks: (resumed step, uninterrupted final state, stopped-and-resumed
    final state, directory with the checkpoints)."""
    cache = {}

    def get(mode: str):
        if mode not in cache:
            root = tmp_path_factory.mktemp(mode)
            rank0, rank1 = run_distributed(_stop_and_resume, 2, mode, root)
            assert rank0[0] == rank1[0]
            cache[mode] = (*rank0, root)
        return cache[mode]

    return get


@pytest.mark.parametrize("mode", MODES)
def test_stop_and_resume_is_bitwise_equal(saved, mode):
    start, want, got, root = saved(mode)
    assert start == STOP
    assert want.keys() == got.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k
    # keep=2: the older checkpoint went once the newer two were complete.
    assert sorted(p.name for p in (root / "ckpt").glob("step_*")) == ["step_000004", "step_000006"]
    names = sorted(p.name for p in (root / "ckpt" / "step_000006").iterdir())
    assert names == ["COMPLETE", "meta.pt", "rank0.bin", "rank0.pt", "rank1.bin", "rank1.pt"]


@pytest.mark.parametrize(
    "src, dst, world", [("zero", "ddp", 1), ("fsdp", "zero", 2), ("ddp", "fsdp", 1)]
)
def test_resume_into_another_mode_or_world_size(saved, tmp_path, src, dst, world):
    _, want, _, root = saved(src)
    results = run_distributed(_resume_from, world, dst, root / "ckpt" / "step_000004", tmp_path)
    start, got = results[0]
    assert start == STOP
    # Another mode sums in another order: fp32 rounding after 2 more steps, well inside
    # 1e-4 and far below what a lost or misplaced optimizer state produces (steps of
    # lr = 1e-2).
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-4, msg=k)


def test_bf16_with_decay_groups_resumes_bitwise_and_into_another_mode(tmp_path):
    # Checkpoints hold the fp32 masters and both param groups' optimizer state.
    start, want, got = run_distributed(_stop_and_resume, 2, "fsdp", tmp_path, mixed=True)[0]
    assert start == STOP
    assert all(torch.equal(got[k], want[k]) for k in want)
    path = tmp_path / "ckpt" / "step_000004"
    start, other = run_distributed(_resume_from, 1, "zero", path, tmp_path / "z", mixed=True)[0]
    assert start == STOP
    for k in want:
        # bf16 rounds sums over 2 ranks and over 1 differently: a gradient differs by up
        # to a bf16 ulp (2^-8 relative), which moves each of the 2 steps after the resume
        # by up to ~lr * 2^-8 = 4e-5, and the bf16 forward amplifies it; 2e-3 bounds that
        # and stays far below a lost optimizer state (steps of lr = 1e-2).
        torch.testing.assert_close(other[k], want[k], rtol=0, atol=2e-3, msg=k)


def test_what_a_checkpoint_holds(saved):
    def load(mode: str, name: str) -> dict:
        path = saved(mode)[3] / "ckpt" / "step_000006" / name
        return torch.load(path, weights_only=True)

    meta = load("zero", "meta.pt")
    assert meta["step"] == 6 and "every: 2" in meta["config"]  # the config, as YAML
    assert meta["state"]["sampler"]["epoch"] == 1  # 6 global batches of 5 per epoch
    layout = meta["layout"]
    assert layout["mode"] == "zero" and layout["world_size"] == 2 and len(layout["groups"]) > 1
    for g in layout["groups"]:  # rank r holds [r*S, (r+1)*S) of the padded bucket
        s = g["padded_numel"] // 2
        assert g["sharded"] and g["ranges"] == [[0, s], [s, 2 * s]]
    # Each rank wrote its own shard with its optimizer state, step counters included: one
    # per parameter that reaches into the rank's slice. The index names each entry of the
    # data file (dtype, shape, byte offset, length) and a CRC32 per block of it.
    for r in (0, 1):
        shard = load("zero", f"rank{r}.pt")
        data = shard["data"]
        sizes = [g["padded_numel"] // 2 for g in layout["groups"]]
        params = [data["entries"][f"params/{i}"] for i in range(len(sizes))]
        assert [p[1] for p in params] == [[s] for s in sizes]
        assert all(p[0] == "float32" and p[3] == 4 * p[1][0] for p in params)
        exp_avg = [data["entries"][f"optim/{i}/exp_avg"] for i in range(len(sizes))]
        assert [e[1] for e in exp_avg] == [[s] for s in sizes]
        bin_file = saved("zero")[3] / "ckpt" / "step_000006" / f"rank{r}.bin"
        assert bin_file.stat().st_size == data["size"] and len(data["crcs"]) >= 1
        steps = [int(c["step"]) for o in shard["scalar"] for c in o.values()]
        assert steps and all(s == 6 for s in steps)
        names = {n for g in layout["groups"] for n in g["names"]}
        assert all(o.keys() <= names for o in shard["scalar"])
        assert {"torch", "python", "numpy"} <= shard["rng"].keys()
    # The values in the data file are the parameters, at the offsets the index gives.
    _, _, got, root = saved("zero")
    g0 = layout["groups"][0]
    name, shape = g0["names"][0], g0["shapes"][0]
    _, _, offset, _ = load("zero", "rank0.pt")["data"]["entries"]["params/0"]
    raw = (root / "ckpt" / "step_000006" / "rank0.bin").read_bytes()
    assert g0["offsets"][0] == 0
    n = min(torch.Size(shape).numel(), g0["padded_numel"] // 2)  # in rank 0's slice
    value = torch.frombuffer(bytearray(raw[offset : offset + 4 * n]), dtype=torch.float32)
    key = next(k for k, v in layout["keys"] if v == name)
    assert torch.equal(value, got[key].reshape(-1)[:n])
    # ddp writes its model once: rank 1's file holds its RNG states only.
    ddp0, ddp1 = load("ddp", "rank0.pt"), load("ddp", "rank1.pt")
    assert all(o is not None for o in ddp0["scalar"]) and ddp0["data"]["size"] > 0
    assert all(o is None for o in ddp1["scalar"]) and ddp1["data"]["entries"] == {}
    assert ddp1["data"]["size"] == 0 and "torch" in ddp1["rng"]
    # Buffers and frozen parameters: on rank 0 only (this GPT has none but the tied key).
    assert meta["replicated"] == {}


def test_ckpt_options_are_checked():
    from omegaconf import OmegaConf

    from trainer.checkpoint import check_config
    from trainer.errors import ConfigError

    for key, value in [("every", -1), ("keep", 1.5)]:
        cfg = OmegaConf.create({"ckpt": {"every": 2, "keep": 2, key: value}})
        with pytest.raises(ConfigError, match=f"ckpt.{key}={value} must be a whole number >= 0"):
            check_config(cfg)


def test_consolidate_gives_a_state_dict_plain_torch_load_reads(saved, tmp_path):
    _, _, got, root = saved("fsdp")
    out = tmp_path / "full.pt"
    script = ROOT / "scripts" / "consolidate.py"
    ckpt = root / "ckpt" / "step_000006"
    proc = warm_cli.command([sys.executable, str(script), str(ckpt), str(out)])
    assert proc.returncode == 0, proc.stderr[-2000:]
    model = _model(seed=5)
    model.load_state_dict(torch.load(out, weights_only=True))  # strict: every key
    for k, v in model.state_dict().items():
        assert torch.equal(v, got[k]), k


# ---------------------------------------------------------------------------------------
# Bad checkpoints: named errors, nothing changed


def _try_loads(env, cases: dict[str, tuple[Path, int]], auto_root: Path):
    from trainer import checkpoint
    from trainer.errors import ConfigError

    engine, loader = _build(env, "zero", seed=3)
    before = engine.full_state_dict()
    errors = {}
    for name, (path, n_embd) in cases.items():
        target = engine if n_embd == 12 else _build(env, "zero", seed=3, n_embd=n_embd)[0]
        try:
            checkpoint.load(path, target, sampler=loader.batch_sampler)
            errors[name] = None
        except ConfigError as e:
            errors[name] = str(e)
    after = engine.full_state_dict()
    unchanged = all(torch.equal(before[k], after[k]) for k in before)
    # resume=auto passes over a damaged newer checkpoint and an unfinished save.
    auto = checkpoint.maybe_resume(_cfg(auto_root, resume="auto"), engine, Path("unused"))
    return errors, unchanged, auto


def _flip_a_tensor_byte(file: Path) -> None:
    with zipfile.ZipFile(file) as z:
        info = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    with open(file, "r+b") as f:
        f.seek(info.header_offset + 26)  # local header: name and extra field lengths
        name_len, extra_len = struct.unpack("<HH", f.read(4))
        pos = info.header_offset + 30 + name_len + extra_len + info.file_size // 2
        f.seek(pos)
        byte = f.read(1)[0]
        f.seek(pos)
        f.write(bytes([byte ^ 0xFF]))


def _snapshot(root: Path) -> dict[str, tuple]:
    return {
        str(p.relative_to(root)): (p.stat().st_mtime_ns, p.read_bytes() if p.is_file() else None)
        for p in sorted(root.rglob("*"))
    }


def test_bad_checkpoints_are_named_and_left_alone(saved, tmp_path):
    zero, fsdp = saved("zero")[3] / "ckpt", saved("fsdp")[3] / "ckpt"
    good = zero / "step_000004"

    def copy(name: str) -> Path:
        return Path(shutil.copytree(good, tmp_path / name / "step_000004"))

    truncated = copy("truncated")
    os.truncate(truncated / "rank1.pt", (truncated / "rank1.pt").stat().st_size // 2)
    corrupted = copy("corrupted")
    _flip_a_tensor_byte(corrupted / "rank0.pt")
    missing = copy("missing")
    (missing / "rank1.pt").unlink()
    other_layout = copy("other_layout")
    shutil.copy(fsdp / "step_000004" / "rank1.pt", other_layout / "rank1.pt")
    auto = tmp_path / "auto"
    shutil.copytree(good, auto / "step_000004")
    shutil.copytree(truncated, auto / "step_000005")  # final name, damaged
    shutil.copytree(good, auto / "step_000006.tmp-1234abcd")  # a save that never finished
    (auto / "step_000006.tmp-1234abcd" / "meta.pt").unlink()

    cases = {
        "truncated": (truncated, 12),
        "corrupted": (corrupted, 12),
        "missing": (missing, 12),
        "other_layout": (other_layout, 12),
        "other_model": (good, 16),
        "nowhere": (tmp_path / "nowhere", 12),
    }
    before = _snapshot(tmp_path), _snapshot(zero)
    [(errors, unchanged, resumed)] = run_distributed(_try_loads, 1, cases, auto)
    assert errors["truncated"].startswith(f"{truncated / 'rank1.pt'} is truncated or corrupted")
    assert str(corrupted / "rank0.pt") in errors["corrupted"]
    assert "corrupted" in errors["corrupted"]
    assert errors["missing"] == f"{missing / 'rank1.pt'} is missing: the checkpoint is incomplete"
    assert errors["other_layout"].startswith(f"{other_layout / 'rank1.pt'} does not belong")
    assert "it holds a shard of mode fsdp over 2 ranks" in errors["other_layout"]
    assert errors["other_model"].startswith(f"{good / 'meta.pt'} does not match this model")
    assert "has shape" in errors["other_model"]
    assert "does not exist" in errors["nowhere"]
    assert all("\n" not in e for e in errors.values())
    assert unchanged, "a failed load changed the engine"
    assert resumed == 4
    # resume=auto took the directory over: it names the lineage it continues, and it set
    # the damaged step_000005 aside under another name, whole; nothing else changed
    [aside] = auto.glob("step_000005.damaged-*")
    after = _snapshot(tmp_path), _snapshot(zero)
    assert (auto / "lineage").read_text() == json.loads(
        (auto / "step_000004" / "COMPLETE").read_text()
    )["run"]
    for snap in (before[0], after[0]):
        snap.pop("auto"), snap.pop("auto/lineage", None)
    renamed = f"auto/{aside.name}"
    after[0].update(
        {
            k.replace(renamed, "auto/step_000005"): after[0].pop(k)
            for k in list(after[0])
            if k.startswith(renamed)
        }
    )
    assert after == before, "a load touched the disk"


# ---------------------------------------------------------------------------------------
# Under torchrun: a rank killed with SIGKILL, a rank that hangs

CLI_ARGS = [
    "mode=zero",
    "mode.bucket_mb=0.01",
    "model.hidden=32",
    "train.batch_size=32",
    "train.steps=8",
    "train.log_every=4",
    "ckpt.every=2",
    "optim.schedule=cosine",  # the lr schedule's position is restored too
    "optim.warmup_steps=2",
]


def _torchrun(args: list[str], env: dict[str, str], restarts: int = 0, timeout: float = 300):
    # the launcher from a warm process, its ranks new ones: [Note: warm command lines]
    return warm_cli.command(
        [*TORCHRUN, "--nproc-per-node=2", f"--max-restarts={restarts}", str(ROOT / "train.py")]
        + args,
        env,
        timeout,
    )


@pytest.fixture(scope="module")
def uninterrupted_dir(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    proc = _torchrun([*CLI_ARGS, f"hydra.run.dir={run_dir}"], {})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


@pytest.fixture(scope="module")
def uninterrupted(uninterrupted_dir) -> dict[str, torch.Tensor]:
    return torch.load(uninterrupted_dir / "final_model.pt", weights_only=True)


@pytest.mark.slow
@pytest.mark.parametrize(
    "fault",
    [
        "1:5:kill",  # after step 5: the group restarts from step 4
        "1:6:kill_in_save",  # halfway through writing step 6: step 4 is still complete
    ],
)
def test_killed_rank_restarts_and_ends_equal(uninterrupted, tmp_path, fault):
    run_dir, marker = tmp_path / "run", tmp_path / "fired"
    faults = {"SHARDTRAIN_FAULT": fault, "SHARDTRAIN_FAULT_ONCE": str(marker)}
    # No resume= given: a restarted group resumes by itself.
    proc = _torchrun([*CLI_ARGS, f"hydra.run.dir={run_dir}"], faults, restarts=1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert marker.exists(), "the fault never fired"
    assert f"resumed from {run_dir / 'checkpoints' / 'step_000004'} at step 4" in proc.stdout
    got = torch.load(run_dir / "final_model.pt", weights_only=True)
    assert got.keys() == uninterrupted.keys()
    for k in got:
        assert torch.equal(got[k], uninterrupted[k]), k
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))
    assert ckpts == ["step_000006", "step_000008"]  # the unfinished save was cleared away


@pytest.mark.slow
def test_hung_rank_ends_the_run_within_the_timeout(tmp_path):
    t0 = time.monotonic()
    proc = _torchrun(
        [*CLI_ARGS, f"hydra.run.dir={tmp_path / 'run'}", "dist.timeout_s=10"],
        {"SHARDTRAIN_FAULT": "1:3:hang"},
        timeout=180,
    )
    elapsed = time.monotonic() - t0
    assert proc.returncode != 0
    # The line may follow rank 0's progress bar, which ends in a carriage return.
    lines = proc.stderr.replace("\r", "\n").splitlines()
    errors = [line for line in lines if line.startswith("error: rank 0:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert "no answer from the other ranks within dist.timeout_s=10 s" in errors[0]
    # torchrun's own failure summary quotes that line (the worker's error file)
    assert f"traceback : {errors[0]}" in proc.stderr
    assert elapsed < 120, f"took {elapsed:.0f} s"


# ---------------------------------------------------------------------------------------
# Many faults in one run: a schedule fired one entry at a time under torchrun --max-restarts

# A GPT of two blocks (fsdp: several units) on in-memory tokens, saved every 2 of 12 steps.
GPT_ARGS = [
    "model=gpt",
    "data=tokens",
    "model.n_embd=16",
    "model.block_size=8",
    "data.dataset.block_size=8",
    "data.dataset.n=256",
    "train.batch_size=8",
    "train.steps=12",
    "train.log_every=4",
    "train.eval_every=0",
    "ckpt.every=2",
    "dist.timeout_s=60",
]


def _schedule_run(tmp_path: Path, args: list[str], schedule: list[str]):
    """`args` under torchrun with the faults of `schedule` (each once; one restart each):
    (run directory, stdout and stderr). Every entry must have fired."""
    run_dir, fired = tmp_path / "run", tmp_path / "fired"
    faults = {"SHARDTRAIN_FAULT": ",".join(schedule), "SHARDTRAIN_FAULT_ONCE": str(fired)}
    proc = _torchrun([*args, f"hydra.run.dir={run_dir}"], faults, restarts=len(schedule))
    assert proc.returncode == 0, proc.stderr[-3000:]
    want = sorted(f"{i}-{e.replace(':', '-')}" for i, e in enumerate(schedule))
    assert sorted(p.name for p in fired.iterdir()) == want, "a fault never fired"
    return run_dir, proc.stdout + proc.stderr


def _same_end(run_dir: Path, clean_dir: Path, step: int) -> None:
    """The final model bitwise the uninterrupted run's; the last checkpoint's data files
    (parameters and optimizer state) bitwise too, and its data position (the sampler: how
    many batches were consumed) and tokens seen the same."""
    got = torch.load(run_dir / "final_model.pt", weights_only=True)
    want = torch.load(clean_dir / "final_model.pt", weights_only=True)
    assert got.keys() == want.keys()
    for k in got:
        assert torch.equal(got[k], want[k]), k
    last = f"checkpoints/step_{step:06d}"
    meta = [torch.load(d / last / "meta.pt", weights_only=True) for d in (run_dir, clean_dir)]
    assert meta[0]["state"] == meta[1]["state"] and meta[0]["state"]["sampler"]
    for r in (0, 1):
        bins = [(d / last / f"rank{r}.bin").read_bytes() for d in (run_dir, clean_dir)]
        assert bins[0] == bins[1], f"rank{r}.bin"
    metrics = [json.loads((d / "final_metrics.json").read_text()) for d in (run_dir, clean_dir)]
    assert metrics[0].get("train/tokens_seen") == metrics[1].get("train/tokens_seen")


@pytest.fixture(scope="module")
def uninterrupted_gpt(tmp_path_factory):
    cache = {}

    def get(mode: str) -> Path:
        if mode not in cache:
            run_dir = tmp_path_factory.mktemp(f"uninterrupted_{mode}")
            proc = _torchrun([*GPT_ARGS, f"mode={mode}", f"hydra.run.dir={run_dir}"], {})
            assert proc.returncode == 0, proc.stderr[-3000:]
            cache[mode] = run_dir
        return cache[mode]

    return get


@pytest.mark.slow
def test_six_faults_of_six_kinds_in_one_fsdp_run_end_bitwise(uninterrupted_gpt, tmp_path):
    schedule = [
        "1:3:kill",  # resumes from 2
        "0:4:kill_in_save",  # step 4 never complete: from 2 again
        "1:6:fail_in_save",  # a broken disk on rank 1: from 4
        "0:8:kill_in_prune",  # step 8 complete, step 4 half removed: from 8
        "1:9:term",  # a preemption: stops at step 10 with a checkpoint, resumes from it
        "0:11:corrupt",  # a flipped byte in step 10: set aside, from 8
    ]
    run_dir, out = _schedule_run(tmp_path, [*GPT_ARGS, "mode=fsdp"], schedule)
    resumed = [int(line.rsplit(" ", 1)[1]) for line in out.splitlines() if "resumed from" in line]
    assert resumed == [2, 2, 4, 8, 10, 8], out[-3000:]
    assert "stopped by SIGTERM at step 10" in out
    ckpts = run_dir / "checkpoints"
    [aside] = ckpts.glob("step_000010.damaged-*")
    assert f"is damaged ({ckpts / 'step_000010' / 'rank0.bin'} is corrupted" in out
    assert f"set aside as {aside}; trying an older one" in out
    names = sorted(p.name for p in ckpts.glob("step_*"))
    assert names == sorted([aside.name, "step_000010", "step_000012"])
    _same_end(run_dir, uninterrupted_gpt("fsdp"), 12)


@pytest.mark.slow
def test_fault_schedule_in_ddp_starts_over_when_its_only_checkpoint_is_damaged(
    uninterrupted_gpt, tmp_path
):
    # ddp rank 1 writes no data file: its index (its RNG states) is what gets corrupted.
    schedule = ["1:3:corrupt", "0:6:kill_in_save"]
    run_dir, out = _schedule_run(tmp_path, [*GPT_ARGS, "mode=ddp"], schedule)
    ckpts = run_dir / "checkpoints"
    assert f"is damaged ({ckpts / 'step_000002' / 'rank1.pt'} is corrupted" in out
    assert "starting from step 0 (1 damaged one(s) set aside, none older)" in out
    assert "resumed from" in out and out.count("resumed from") == 1  # from 4, after step 6
    assert len(list(ckpts.glob("step_000002.damaged-*"))) == 1
    _same_end(run_dir, uninterrupted_gpt("ddp"), 12)


@pytest.mark.slow
def test_fault_schedule_with_async_saves_in_zero_ends_bitwise(uninterrupted_dir, tmp_path):
    # The writer thread is killed halfway through step 4's data file, then fails on step 6:
    # each time the uncommitted save is passed over and the one before it taken.
    schedule = ["0:4:kill_in_save", "1:6:fail_in_save"]
    run_dir, out = _schedule_run(tmp_path, [*CLI_ARGS, "ckpt.async=true"], schedule)
    resumed = [int(line.rsplit(" ", 1)[1]) for line in out.splitlines() if "resumed from" in line]
    assert resumed == [2, 4], out[-3000:]
    _same_end(run_dir, uninterrupted_dir, 8)  # the uninterrupted run saved synchronously
