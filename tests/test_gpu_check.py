"""scripts/gpu_check.sh tested where no GPU is: `--cpu` runs its whole logic with Gloo
against Gloo (2 ranks); CHECKED_OVERRIDES makes the run under test differ or fail, which
must show in its lines and its exit status."""

from __future__ import annotations

import os
import subprocess

import pytest
import warm_cli
from test_cli import ROOT

SCRIPT = ROOT / "scripts" / "gpu_check.sh"
SMALL = ["model.hidden=16", "model.depth=2"]


def _check(tmp_path, steps: int, *overrides: str, **env: str) -> subprocess.CompletedProcess:
    # a nested directory that does not exist yet, as runs/ in a fresh clone
    own = {"OUT_DIR": str(tmp_path / "a" / "check"), **env}  # read by the script alone
    # its Python (torchrun's launcher, the comparison) from a warm process; the ranks
    # torchrun starts are new ones: [Note: warm python]
    shim = {"PY": str(warm_cli.SHIM), **warm_cli.shim_env(["PY", *own])}
    return subprocess.run(
        ["bash", str(SCRIPT), "--cpu", str(steps), *SMALL, *overrides],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, **own, **shim},
    )


@pytest.mark.slow
def test_cpu_mode_checks_every_mode_and_passes(tmp_path):
    proc = _check(tmp_path, 2)
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert [line.split(":")[0] for line in lines] == ["ddp", "zero", "fsdp", "gpu_check"]
    for line in lines[:3]:
        assert " OK 2 rank(s) Gloo vs CPU Gloo (--cpu), max |dparam| 0.00e+00" in line, line
        assert "trace " in line and "trace none" not in line, line
    assert lines[3] == "gpu_check: PASS (ddp zero fsdp; Gloo vs CPU Gloo (--cpu))"


@pytest.mark.slow
def test_a_mismatch_fails_the_check(tmp_path):
    proc = _check(tmp_path, 2, MODES="ddp", CHECKED_OVERRIDES="optim.lr=0.05")
    lines = proc.stdout.splitlines()
    assert proc.returncode == 1, proc.stdout + proc.stderr[-3000:]
    assert lines[0].startswith("ddp: MISMATCH 2 rank(s)"), lines
    assert lines[-1] == "gpu_check: FAIL (ddp)"


def test_one_rank_passes_saying_no_collective_was_exercised(tmp_path):
    # One GPU runs one rank against one: the modes' arithmetic is compared, but nothing
    # went between ranks, and a plain PASS would claim more than was checked.
    proc = _check(tmp_path, 2, MODES="ddp", CPU_RANKS="1")
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert lines[0].startswith("ddp: OK 1 rank(s) Gloo vs CPU Gloo (--cpu), max |dparam|")
    assert lines[1] == (
        "gpu_check: PASS (ddp; Gloo vs CPU Gloo (--cpu); "
        "1 rank: single rank, no Gloo collective between ranks was exercised)"
    )


def test_the_gpu_verdict_names_what_one_gpu_leaves_unchecked():
    # The same branch on a GPU machine, which this suite has not: the wording it prints
    text = SCRIPT.read_text()
    assert 'single="1 GPU: single rank, no NCCL collective between ranks was exercised"' in text
    assert '[ "$nproc" = 1 ] && verdict="$what; $single"' in text


def test_a_failed_run_fails_the_check(tmp_path):
    proc = _check(tmp_path, 2, MODES="ddp zero", CHECKED_OVERRIDES="optim.schedule=linear")
    lines = proc.stdout.splitlines()
    assert proc.returncode == 1, proc.stdout + proc.stderr[-3000:]
    out = tmp_path / "a" / "check"
    assert lines == [
        f"ddp: FAILED run under test, see {out}/ddp-checked.log",
        f"zero: FAILED run under test, see {out}/zero-checked.log",
        "gpu_check: FAIL (ddp zero)",
    ]
    assert "optim.schedule='linear' is not one of" in (out / "ddp-checked.log").read_text()


@pytest.mark.parametrize("steps", ["ten", "0", "-3"])
def test_bad_steps_are_refused_in_one_line(steps):
    proc = subprocess.run(
        ["bash", str(SCRIPT), "--cpu", steps], cwd=ROOT, capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert proc.stderr == f"gpu_check: steps must be a positive integer, got '{steps}'\n"


def test_bad_cpu_ranks_are_refused_in_one_line():
    proc = subprocess.run(
        ["bash", str(SCRIPT), "--cpu", "2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "CPU_RANKS": "0"},
    )
    assert proc.returncode == 2
    assert proc.stderr == "gpu_check: CPU_RANKS must be a positive integer, got '0'\n"
