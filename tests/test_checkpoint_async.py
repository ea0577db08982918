"""Async save (`ckpt.async=true`, [Note: async save]): the same files as a sync save and the
same resumed training, a second save waiting for the first, a failed write ending the run
in one line at the next check step, and a SIGTERM stop waiting for the write."""

from __future__ import annotations

import functools
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import warm_cli
from dist_harness import run_distributed
from test_checkpoint import STEPS, STOP, _build
from test_checkpoint import _train as train_saving
from test_checkpoint_safety import TINY, _error_lines
from test_cli import ROOT, TORCHRUN


def _cfg(directory: Path, in_background: bool, resume: str | None = None):
    from omegaconf import OmegaConf

    ckpt = {"every": 2, "dir": str(directory), "keep": 0, "async": in_background}
    return OmegaConf.create({"ckpt": ckpt, "resume": resume, "train": {"steps": STEPS}})


def _train(env, engine, loader, cfg, stop: int = STEPS):
    return train_saving(env, engine, loader, cfg, stop, check_saves=True)


def _saves_and_resumes(env, mode: str, root: Path):
    """Stop at STOP saving sync and async; resume each to STEPS (resuming async too)."""
    finals = {}
    for name, in_background in (("sync", False), ("async", True)):
        _train(env, *_build(env, mode, 0), _cfg(root / name, in_background), stop=STOP)
        cfg = _cfg(root / name, in_background, resume="auto")
        finals[name] = _train(env, *_build(env, mode, 1), cfg)
    return finals


@pytest.mark.parametrize("mode", ["zero", "fsdp"])
def test_async_save_writes_the_sync_files_and_resumes_alike(tmp_path, mode):
    from trainer.checkpoint import files

    rank0, _ = run_distributed(_saves_and_resumes, 2, mode, tmp_path)
    (start_s, want), (start_a, got) = rank0["sync"], rank0["async"]
    assert start_s == start_a == STOP
    for k in want:
        assert torch.equal(got[k], want[k]), k
    for step in (2, 4, 6):  # every data file byte for byte; the indexes (ids differ) alike
        sync, asyn = (tmp_path / n / f"step_{step:06d}" for n in ("sync", "async"))
        assert (asyn / "COMPLETE").exists()
        for r in (0, 1):
            assert (asyn / f"rank{r}.bin").read_bytes() == (sync / f"rank{r}.bin").read_bytes()
            a, s = (torch.load(d / f"rank{r}.pt", weights_only=True) for d in (asyn, sync))
            assert a["data"] == s["data"]
            assert files.checksum(a["scalar"]) == files.checksum(s["scalar"])


def _second_save_waits(env, directory: Path):
    """A first async save whose write is held until released; the second save must wait for
    it and commit it before writing its own."""
    from torch import nn

    from trainer.checkpoint import background, files, saving
    from trainer.parallel import build_engine

    engine = build_engine(nn.Linear(64, 64), "ddp", functools.partial(torch.optim.SGD, lr=0.1))
    release, seen = threading.Event(), []
    write_data = files.write_data

    def held(path, *args, **kwargs):
        if "step_000001" in str(path):
            release.wait(30)
        else:  # the second save's write: the first must be committed by now
            seen.append(sorted(p.name for p in files.find_checkpoints(directory)))
        return write_data(path, *args, **kwargs)

    files.write_data = held
    saving.save(directory, 1, engine, in_background=True)
    pending = not (directory / "step_000001").exists()
    threading.Timer(0.5, release.set).start()
    began = time.monotonic()
    saving.save(directory, 2, engine, in_background=True)  # waits for the first
    waited = time.monotonic() - began
    background.finish()
    return pending, waited, seen, [p.name for p in files.find_checkpoints(directory)]


def test_a_second_save_waits_for_the_first(tmp_path):
    [(pending, waited, seen, done)] = run_distributed(_second_save_waits, 1, tmp_path)
    assert pending  # the first save returned before its write was done
    assert waited >= 0.4  # held until the 0.5 s timer released the first write
    assert seen == [["step_000001"]]  # committed before the second one's write began
    assert done == ["step_000002", "step_000001"]


def test_a_failed_async_write_ends_the_run_in_one_line_at_the_next_check(tmp_path):
    run_dir = tmp_path / "run"
    args = [*TINY, f"hydra.run.dir={run_dir}", "ckpt.every=2", "ckpt.async=true"]
    proc = warm_cli.command(
        [sys.executable, str(ROOT / "train.py"), *args, "train.steps=8"],
        {"SHARDTRAIN_FAULT": "0:2:fail_in_save"},
        timeout=120,
    )
    assert proc.returncode != 0
    ckpt = run_dir / "checkpoints" / "step_000002"
    [line] = _error_lines(proc)
    assert line.startswith(
        f"error: rank 0 could not write its part of checkpoint {ckpt}: cannot write "
    ), line
    assert "injected write failure" in line
    # ended at step 3's check (log_every=1): nothing of step 4, no step 2 under its name
    ckpts = run_dir / "checkpoints"
    assert not ckpt.exists() and not list(ckpts.glob("step_000004*"))


@pytest.mark.slow
def test_sigterm_waits_for_an_async_write_and_leaves_it_complete(tmp_path):
    run_dir = tmp_path / "run"
    args = [*TINY, "mode=zero", "ckpt.every=3", "ckpt.async=true", "train.steps=100000"]
    job = warm_cli.popen(
        [*TORCHRUN, "--nproc-per-node=2", str(ROOT / "train.py"), *args,
         f"hydra.run.dir={run_dir}"],
    )  # fmt: skip
    first = run_dir / "checkpoints" / "step_000003" / "COMPLETE"
    while not first.exists():  # committed at a later check step
        assert job.poll() is None, job.communicate()[1][-3000:]
        time.sleep(0.05)
    job.send_signal(signal.SIGTERM)  # to torchrun, which forwards it to every worker
    _, err = job.communicate(timeout=120)
    lines = [x for x in err.replace("\r", "\n").splitlines() if x.startswith("stopped by")]
    assert len(lines) == 1, err[-3000:]
    step = int(lines[0].split(" at step ")[1].split(";")[0])
    ckpt = run_dir / "checkpoints" / f"step_{step:06d}"
    assert f"checkpoint {ckpt};" in lines[0]
    # the stop's save was written and committed before the processes ended
    names = ["COMPLETE", "meta.pt", "rank0.bin", "rank0.pt", "rank1.bin", "rank1.pt"]
    assert sorted(p.name for p in ckpt.iterdir()) == names
    assert not list(ckpt.parent.glob("step_*.tmp-*"))


def test_the_estimate_gives_the_host_copy_an_async_save_holds(tmp_path):
    """scripts/estimate.py's async figure: the staging buffer plus rank 0's data file, to
    within the 64-byte alignment of its entries."""
    import json

    run_dir = tmp_path / "run"
    args = [*TINY, "mode=ddp", "train.steps=1", "ckpt.async=true"]
    proc = warm_cli.command(
        [sys.executable, str(ROOT / "train.py"), *args, f"hydra.run.dir={run_dir}"],
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    est = warm_cli.command(
        [sys.executable, str(ROOT / "scripts" / "estimate.py"), "--world-size", "1", "--json",
         *args],
        timeout=120,
    )  # fmt: skip
    assert est.returncode == 0, est.stderr[-2000:]
    save = json.loads(est.stdout)["ddp"]["checkpoint_save_bytes"]
    assert save["sync"] == 64 * 2**20  # ckpt.buffer_mb
    data = run_dir / "checkpoints" / "step_000001" / "rank0.bin"
    n_entries = len(torch.load(data.with_suffix(".pt"), weights_only=True)["data"]["entries"])
    assert 0 <= data.stat().st_size - (save["async"] - save["sync"]) < 64 * n_entries
