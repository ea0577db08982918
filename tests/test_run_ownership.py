"""Never lose a run: one owner per run directory, fresh runs that do not write over
another run's checkpoints, resume=auto within one lineage, command-line values that
win on resume, and a clean stop on SIGTERM that resumes bitwise equal."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import warm_cli
from test_cli import ROOT, TORCHRUN, run_cli

TINY = ["model.hidden=16", "model.depth=1", "train.batch_size=16", "train.log_every=1"]
HOLD = (
    "import sys, time; sys.path.insert(0, sys.argv[1]); from pathlib import Path; "
    "from trainer.run.rundir import lock_directory; "
    "lock_directory(Path(sys.argv[2]), 'hydra.run.dir'); "
    "print('held', flush=True); "
    "time.sleep(600)"
)


def _error_lines(proc) -> list[str]:
    return [x for x in proc.stderr.replace("\r", "\n").splitlines() if "error:" in x]


def test_a_held_run_directory_is_refused_and_a_dead_holders_lock_is_stale(tmp_path):
    run_dir = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(ROOT), str(run_dir)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline() == "held\n"
        args = [*TINY, f"hydra.run.dir={run_dir}", "train.steps=2"]
        proc = run_cli(args, nproc=None)
        assert proc.returncode == 2, proc.stderr[-2000:]
        [line] = _error_lines(proc)
        assert line.startswith(f"error: {run_dir} is in use by another run (pid {holder.pid} on ")
        assert line.endswith(
            "wait for it to end, or give this run another hydra.run.dir (or ckpt.dir)"
        )
        assert not (run_dir / "checkpoints").exists()
        assert not (run_dir / ".hydra").exists()  # refused before Hydra wrote its files
    finally:
        holder.kill()  # SIGKILL: its lock file stays behind, naming it
        holder.wait()
    proc = run_cli(args, nproc=None)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"was locked by a run that has ended (pid {holder.pid} on " in proc.stdout
    assert (run_dir / ".lock").read_text() == ""  # released on a clean end


def test_a_fresh_run_never_writes_over_another_runs_checkpoints(tmp_path):
    run_dir = tmp_path / "run"
    first = [*TINY, f"hydra.run.dir={run_dir}", "ckpt.every=1", "ckpt.keep=0"]
    assert run_cli([*first, "train.steps=3"], nproc=None).returncode == 0
    ckpts = run_dir / "checkpoints"
    before = {p: p.read_bytes() for p in ckpts.rglob("step_*/*")}

    proc = run_cli([*first, "train.steps=2", "seed=1"], nproc=None)  # another run, same dir
    assert proc.returncode == 2, proc.stderr[-2000:]
    [line] = _error_lines(proc)
    assert line == (
        f"error: ckpt.dir {ckpts} already holds checkpoints of another run (up to "
        "step_000003); continue that run with resume=auto, or start this one in a new "
        "hydra.run.dir or ckpt.dir"
    )
    assert {p: p.read_bytes() for p in ckpts.rglob("step_*/*")} == before

    # A mistyped ckpt.dir with resume=auto says it found nothing.
    typo = tmp_path / "chekpoints"
    proc = run_cli(
        [*TINY, f"run.root={tmp_path}", f"ckpt.dir={typo}", "resume=auto", "train.steps=1"],
        nproc=None,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (
        f"warning: resume=auto found no checkpoint under {typo}; starting from step 0 "
        "(is ckpt.dir right?)" in proc.stdout
    )


def test_resume_auto_takes_its_own_lineage_only(tmp_path):
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    for run_dir, steps in ((ours, 2), (theirs, 4)):
        args = [*TINY, f"hydra.run.dir={run_dir}", "ckpt.every=1", f"train.steps={steps}"]
        assert run_cli(args, nproc=None).returncode == 0
    # Another run's newer checkpoint copied in: not ours to continue.
    stranger = ours / "checkpoints" / "step_000004"
    shutil.copytree(theirs / "checkpoints" / "step_000004", stranger)
    args = [*TINY, f"hydra.run.dir={ours}", "ckpt.every=1", "train.steps=3", "resume=auto"]
    proc = run_cli(args, nproc=None)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lineage = (ours / "checkpoints" / "lineage").read_text()
    assert f"warning: skipping checkpoint {stranger}: it belongs to another run than {lineage}" in (
        proc.stdout
    )
    assert f"resumed from {ours / 'checkpoints' / 'step_000002'} at step 2" in proc.stdout
    assert proc.stdout.count("warning:") == 1


def test_command_line_values_win_on_resume(tmp_path):
    base = [*TINY, "ckpt.every=2", "train.steps=4"]
    a = tmp_path / "a"
    assert run_cli([*base, f"hydra.run.dir={a}"], nproc=None).returncode == 0
    ckpt = a / "checkpoints" / "step_000002"
    b = tmp_path / "b"
    proc = run_cli(
        [*base, f"hydra.run.dir={b}", f"resume={ckpt}", "optim.lr=0.1", "optim.weight_decay=0.5",
         "train.grad_accum_steps=2"],
        nproc=None,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (
        "resumed with values that differ from the checkpoint's: optim.lr=0.1 (checkpoint: "
        "0.001), optim.weight_decay=0.5 (checkpoint: 0.01), train.grad_accum_steps=2 "
        "(checkpoint: 1)" in proc.stdout
    )
    assert json.loads((b / "final_metrics.json").read_text())["train/lr"] == 0.1
    meta = torch.load(b / "checkpoints" / "step_000004" / "meta.pt", weights_only=True)
    assert meta["optim_hparams"][0]["lr"] == 0.1 and meta["optim_hparams"][0]["weight_decay"] == 0.5

    # A changed seed, dataset or batch size is refused: the sampler's position means
    # nothing there. With resume=auto at once, not by skipping to an older checkpoint.
    before = {p: p.read_bytes() for p in (a / "checkpoints").rglob("step_*/*")}
    for change, resume, run_dir, needle in [
        ("seed=7", ckpt, tmp_path / "c", f"seed=7 differs from checkpoint {ckpt}'s seed=0"),
        (
            "train.batch_size=32",
            "auto",
            a,
            f"train.batch_size=32 differs from checkpoint {a / 'checkpoints' / 'step_000004'}'s "
            "train.batch_size=16: the data order would not continue, and each step would "
            "average another number of samples than the learning rate was set for; resume "
            "with train.batch_size=16, or start a fresh run in a new hydra.run.dir",
        ),
    ]:
        args = [*base, f"hydra.run.dir={run_dir}", f"resume={resume}", change]
        proc = run_cli(args, nproc=None)
        assert proc.returncode == 2, proc.stderr[-2000:]
        [line] = _error_lines(proc)
        assert needle in line, line
        assert "warning" not in proc.stdout, proc.stdout
    assert {p: p.read_bytes() for p in (a / "checkpoints").rglob("step_*/*")} == before


@pytest.mark.parametrize(
    "change, refused",
    [
        ("seed=7", "seed=7 differs from checkpoint ckpt's seed=0: the data order"),
        (
            "data.dataset.seed=3",
            "data.dataset={'_target_': 'trainer.data.datasets.synthetic_classif",
        ),
        (
            "data.dataset.n=100",
            "data.dataset={'_target_': 'trainer.data.datasets.synthetic_classif",
        ),
        ("train.batch_size=64", "train.batch_size=64 differs from checkpoint ckpt's train."),
        ("train.grad_accum_steps=2", None),  # the same samples per step
        ("optim.lr=0.1", None),
        ("train.steps=9", None),
    ],
)
def test_what_a_resume_may_change(change, refused):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from trainer.checkpoint.resume import NotResumable, refuse_changes
    from trainer.config import schema  # noqa: F401  (registers the types conf/ names)

    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        meta = {"config": OmegaConf.to_yaml(compose("config"))}  # as the checkpoint saved it
        cfg = compose("config", overrides=[change])
    if refused is None:
        refuse_changes(cfg, Path("ckpt"), meta)
    else:
        with pytest.raises(NotResumable) as e:
            refuse_changes(cfg, Path("ckpt"), meta)
        assert str(e.value).startswith(refused), str(e.value)


@pytest.mark.parametrize(
    "change, refused",
    [
        ([], None),  # data.mix and data.doc_mask came later: unset, the same data
        (["data.doc_mask=true"], "data.dataset={'_target_': 'trainer.data.tokens.TokenData'"),
        (["data.dir=/elsewhere"], None),  # interpolated: the sampler's state checks the tokens
    ],
)
def test_a_checkpoint_from_before_a_dataset_key_resumes(change, refused):
    """A token-file checkpoint written before data.mix and data.doc_mask existed (its
    dataset config lacks them, its target was TokenData) resumes while they are unset."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from trainer.checkpoint.resume import NotResumable, refuse_changes
    from trainer.config import schema  # noqa: F401  (registers the types conf/ names)

    base = ["data=token_file", "model=gpt", "data.dir=/data"]
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        old = compose("config", overrides=base)
        cfg = compose("config", overrides=[*base, *change])
    OmegaConf.set_struct(old, False)
    old.data.dataset._target_ = "trainer.data.tokens.TokenData"  # as it was then
    for gained in ("mix", "doc_mask"):
        del old.data.dataset[gained], old.data[gained]
    meta = {"config": OmegaConf.to_yaml(old)}
    if refused is None:
        refuse_changes(cfg, Path("ckpt"), meta)
    else:
        with pytest.raises(NotResumable) as e:
            refuse_changes(cfg, Path("ckpt"), meta)
        assert str(e.value).startswith(refused), str(e.value)


# ---------------------------------------------------------------------------------------
# SIGTERM under torchrun

SIGTERM_ARGS = [*TINY, "mode=zero", "ckpt.every=3", "optim.schedule=constant"]


def _start(run_dir: Path, steps: int) -> warm_cli.Job | subprocess.Popen:
    # the launcher from a warm process, its workers new ones: [Note: warm command lines]
    return warm_cli.popen(
        [*TORCHRUN, "--nproc-per-node=2", str(ROOT / "train.py"), *SIGTERM_ARGS,
         f"train.steps={steps}", f"hydra.run.dir={run_dir}"],
    )  # fmt: skip


def _wait_for(path: Path, proc: warm_cli.Job | subprocess.Popen) -> None:
    """Until `path` exists (training has reached it); fails if the job ends first."""
    while not path.exists():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.05)


def _workers(launcher_pid: int) -> list[int]:
    """Processes whose parent is torchrun: its workers, in start (rank) order."""
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == launcher_pid:
            kids.append(int(stat.parent.name))
    return sorted(kids)


def _stopped(proc: warm_cli.Job | subprocess.Popen, run_dir: Path) -> tuple[int, str]:
    """The job's step at the stop, from its one line; checks the line and the checkpoint."""
    _, err = proc.communicate(timeout=120)
    lines = [x for x in err.replace("\r", "\n").splitlines() if x.startswith("stopped by")]
    assert len(lines) == 1, err[-3000:]
    step = int(lines[0].split(" at step ")[1].split(";")[0])
    ckpt = run_dir / "checkpoints" / f"step_{step:06d}"
    assert lines[0] == (
        f"stopped by SIGTERM at step {step}; checkpoint {ckpt}; resume with resume=auto"
    )
    names = ["COMPLETE", "meta.pt", "rank0.bin", "rank0.pt", "rank1.bin", "rank1.pt"]
    assert sorted(p.name for p in ckpt.iterdir()) == names
    return step, err


@pytest.mark.slow
def test_sigterm_stops_at_one_step_saves_and_resumes_bitwise_equal(tmp_path):
    run_dir = tmp_path / "run"
    job = _start(run_dir, steps=100000)
    _wait_for(run_dir / "checkpoints" / "step_000003" / "COMPLETE", job)
    job.send_signal(signal.SIGTERM)  # to torchrun, which forwards it to every worker
    step, _ = _stopped(job, run_dir)
    assert step >= 3

    total = step + 2
    resumed = warm_cli.command(
        [*TORCHRUN, "--nproc-per-node=2", str(ROOT / "train.py"), *SIGTERM_ARGS,
         f"train.steps={total}", f"hydra.run.dir={run_dir}", "resume=auto"],
        timeout=240,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"at step {step}" in resumed.stdout
    whole = tmp_path / "whole"
    proc = run_cli([*SIGTERM_ARGS, f"train.steps={total}", f"hydra.run.dir={whole}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = torch.load(run_dir / "final_model.pt", weights_only=True)
    want = torch.load(whole / "final_model.pt", weights_only=True)
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.slow
def test_sigterm_to_one_rank_stops_every_rank_at_the_same_step(tmp_path):
    run_dir = tmp_path / "run"
    job = _start(run_dir, steps=100000)
    _wait_for(run_dir / "checkpoints" / "step_000003" / "COMPLETE", job)
    rank1 = _workers(job.pid)[1]
    os.kill(rank1, signal.SIGTERM)  # rank 1 alone: rank 0 learns it at the next step
    step, err = _stopped(job, run_dir)
    assert "exitcode  : 75" in err  # torchrun's summary of the workers' exit codes
    # ... naming why, with our line (from the workers' error files), not a link
    assert f"  traceback : stopped by SIGTERM at step {step}; checkpoint " in err
    meta = torch.load(run_dir / "checkpoints" / f"step_{step:06d}" / "meta.pt", weights_only=True)
    assert meta["step"] == step


# ---------------------------------------------------------------------------------------
# SIGTERM to launcher.nproc's parent, and during set-up


def _messages(err: str) -> list[str]:
    """stderr without the progress bar."""
    lines = err.replace("\r", "\n").splitlines()
    return [x for x in lines if x.strip() and " p=" not in x.split(":")[0]]


def _catches_sigterm(proc: subprocess.Popen) -> None:
    """Until `proc` has its SIGTERM handler (train.py's first act), read from /proc."""
    while True:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        try:
            status = Path(f"/proc/{proc.pid}/status").read_text()
        except OSError:
            status = ""
        caught = [x for x in status.splitlines() if x.startswith("SigCgt:")]
        if caught and int(caught[0].split()[1], 16) >> (signal.SIGTERM - 1) & 1:
            return
        time.sleep(0.01)


@pytest.mark.slow
def test_sigterm_to_the_launcher_is_forwarded_to_its_workers(tmp_path):
    run_dir = tmp_path / "run"
    job = warm_cli.popen(
        [sys.executable, str(ROOT / "train.py"), *SIGTERM_ARGS, "launcher.nproc=2",
         "train.steps=100000", f"hydra.run.dir={run_dir}"],
    )  # fmt: skip
    _wait_for(run_dir / "checkpoints" / "step_000003" / "COMPLETE", job)
    job.send_signal(signal.SIGTERM)  # to the parent alone: torch's agent forwards it
    step, err = _stopped(job, run_dir)
    assert job.returncode == 75
    ckpt = run_dir / "checkpoints" / f"step_{step:06d}"
    assert _messages(err) == [
        f"stopped by SIGTERM at step {step}; checkpoint {ckpt}; resume with resume=auto"
    ], err[-3000:]  # and nothing else: no traceback, no log lines of the agent


def test_sigterm_during_set_up_stops_before_the_first_step(tmp_path):
    # Signalled while it starts (imports, Hydra, building the model): the ranks agree to
    # stop before the first step, with nothing to save.
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "train.py"), *TINY, "train.steps=50",
         f"hydra.run.dir={run_dir}"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    _catches_sigterm(proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 75, err[-3000:]
    assert _messages(err) == [
        "stopped by SIGTERM before training started; nothing new to save; run the same "
        "command again"
    ], err[-3000:]
    assert not list(run_dir.glob("checkpoints/step_*"))


LAUNCHER = """
import os, signal, sys, time
sys.path.insert(0, sys.argv[1])
from trainer.run import preempt
preempt.install()
os.kill(os.getpid(), signal.SIGTERM)  # before the workers would start: kept
try:
    with preempt.raising():
        print("entered")
except preempt.Stopped as e:
    print("on entry:", e)
try:
    with preempt.raising():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(60)
except preempt.Stopped as e:
    print("at once:", e)
os.kill(os.getpid(), signal.SIGTERM)  # outside raising(): a flag again
print("flagged:", preempt.requested())
"""


def test_a_launcher_signalled_before_its_workers_start_stops_at_once():
    # What launcher.nproc's parent does around starting its workers (trainer/run/cli.py).
    proc = subprocess.run(
        [sys.executable, "-c", LAUNCHER, str(ROOT)], capture_output=True, text=True, timeout=60
    )
    line = "stopped by SIGTERM before training started; nothing new to save; run the same "
    line += "command again"
    assert proc.stdout.splitlines() == [f"on entry: {line}", f"at once: {line}", "flagged: True"], (
        proc.stderr
    )
