"""The command line as users run it: torchrun, Hydra overrides, one run directory."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest
import warm_cli
from tb_events import layout
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]


def run_cli(args: list[str], nproc: int | None = 2, timeout: float = 240, env: dict | None = None):
    launcher = TORCHRUN + [f"--nproc-per-node={nproc}"] if nproc else [sys.executable]
    # a rank that dies of a signal (SIGABRT from an uncaught C++ exception, SIGSEGV)
    # prints every thread's Python stack into stderr, which a failing test shows
    extra = {"PYTHONFAULTHANDLER": "1", **(env or {})}
    # from a process that imported torch and the trainer once: [Note: warm command lines]
    return warm_cli.run(
        launcher, [str(ROOT / "train.py"), *args], {**os.environ, **extra}, extra, timeout
    )


def scalars(run_dir: Path) -> dict[str, list[float]]:
    acc = EventAccumulator(str(run_dir))
    acc.Reload()
    return {tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def train_and_check(tmp_path: Path, args: list[str], nproc: int | None = 2):
    proc = run_cli([f"run.root={tmp_path}", "train.log_every=5", *args], nproc=nproc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert len(runs) == 1, f"expected one run directory, got {runs}"
    run_dir = runs[0]
    final = json.loads((run_dir / "final_metrics.json").read_text())
    values = scalars(run_dir)
    for tag in ("train/loss", "train/accuracy", "perf/samples_per_s", "perf/step_time_s"):
        assert tag in values, sorted(values)
    # one rank sends nothing: no communication figures, which would all be zero
    assert ("comm/overlap_pct" in values) == (final["world_size"] > 1), sorted(values)
    assert values["train/loss"][-1] < 0.7 * values["train/loss"][0], values["train/loss"]
    return run_dir, final, values


def test_torchrun_ddp_two_ranks_one_run_dir(tmp_path):
    run_dir, final, values = train_and_check(
        tmp_path, ["mode=ddp", "train.steps=40", "profile=true"]
    )
    assert final["world_size"] == 2 and final["mode"] == "ddp"
    assert run_dir.name.endswith("_ddp_p2")
    assert "comm/bytes_per_step/all_reduce" in values
    assert len(list(run_dir.glob("events.out.tfevents*"))) == 1  # rank 0 alone writes
    # A plain run writes its Custom Scalars layout: loss and accuracy first, then memory
    # in MiB with measured and formula apart, then communication; no always-zero kinds.
    categories = layout(run_dir)
    assert [c for c, _ in categories] == ["training", "memory per rank, MiB", "communication"]
    assert categories[0][1][:2] == [
        ("loss (train, eval)", [r"^train/loss$", r"^eval/loss$"]),
        ("accuracy (train, eval)", [r"^train/accuracy$", r"^eval/accuracy$"]),
    ]
    memory = dict(categories[1][1])
    assert list(memory)[:3] == [
        "model state per rank, MiB (measured, max over ranks)",
        "model state per rank, MiB (formula)",
        "peak: tensors live at one step's high point (CPU), MiB per rank (max over ranks)",
    ]
    assert "fp32 master weights per rank, MiB (max over ranks)" not in memory  # fp32
    # ddp, fp32 AdamW: 16 bytes per parameter by the formula; measured, plus 4 bytes per
    # parameter tensor twice (AdamW's step counter, ddp's used-flag), in MiB
    psi = 32 * 256 + 256 + 3 * (256 * 256 + 256) + 256 * 10 + 10  # the default MLP
    assert values["memory/expected/model_state_MiB"][-1] * 2**20 == 16 * psi
    assert values["memory/model_state_MiB/max"][-1] * 2**20 == 16 * psi + 10 * 2 * 4
    assert "memory/master_MiB/max" not in values and "memory/comm_MiB/max" not in values
    memory_tags = [t for t in values if "memory" in t]  # what the Scalars filter shows
    assert len(memory_tags) <= 12, memory_tags
    # profile=true: a Chrome trace per rank, with the collectives in it
    for rank in (0, 1):
        trace = json.loads((run_dir / "traces" / f"rank{rank}.json").read_text())
        names = {e.get("name", "") for e in trace["traceEvents"]}
        assert "gloo:all_reduce" in names


def test_plain_python_is_world_size_one(tmp_path):
    run_dir, final, _ = train_and_check(tmp_path, ["train.steps=30"], nproc=None)
    assert final["world_size"] == 1 and run_dir.name.endswith("_p1")


def test_explicit_run_dir_is_honoured_by_every_rank(tmp_path):
    target = tmp_path / "mine"
    proc = run_cli([f"hydra.run.dir={target}", "train.steps=10", "train.log_every=5"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (target / "final_metrics.json").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["mine"]


# ---------------------------------------------------------------------------------------
# What a run says of itself: faults armed, nothing left to train


@pytest.fixture(scope="module")
def resumed_at_last_step(tmp_path_factory):
    """A plain-python run of 2 steps with a fault armed that never fires (step 99), then
    the same run again with resume=auto, as after a kill between its last checkpoint and
    its end: it resumes at its last step."""
    run_dir = tmp_path_factory.mktemp("resumed") / "run"
    args = [
        "model.hidden=16", "model.depth=1", "train.batch_size=16", "train.steps=2",
        "train.log_every=1", f"hydra.run.dir={run_dir}",
    ]  # fmt: skip
    first = run_cli(args, nproc=None, env={"SHARDTRAIN_FAULT": "0:99:kill"})
    assert first.returncode == 0, first.stderr[-3000:]
    again = run_cli([*args, "resume=auto"], nproc=None)
    assert again.returncode == 0, again.stderr[-3000:]
    return run_dir, first, again


def test_a_run_with_faults_armed_says_so_first(resumed_at_last_step):
    _, first, again = resumed_at_last_step
    assert first.stdout.splitlines()[0] == (
        "warning: fault injection is on, SHARDTRAIN_FAULT=0:99:kill: rank 0 SIGKILL after "
        "step 99 (each every time its point is reached)"
    )
    assert "fault injection" not in again.stdout + again.stderr


def test_a_run_resumed_at_its_last_step_says_there_was_nothing_to_train(resumed_at_last_step):
    run_dir, _, again = resumed_at_last_step
    assert f"resumed from {run_dir / 'checkpoints' / 'step_000002'} at step 2" in again.stdout
    [done] = [line for line in again.stdout.splitlines() if line.startswith("done:")]
    assert done == (
        f"done: ddp on 1 rank(s), step 2, resumed at step 2 = train.steps: nothing to train "
        f"-> {run_dir}"
    )

    def no_nan(constant: str):
        raise AssertionError(f"final_metrics.json holds {constant}")

    final = json.loads((run_dir / "final_metrics.json").read_text(), parse_constant=no_nan)
    assert "train/loss" not in final and final["step"] == 2
    # TensorBoard holds the first run's two losses, finite, and nothing of the second
    losses = scalars(run_dir)["train/loss"]
    assert len(losses) == 2 and all(math.isfinite(v) for v in losses), losses


def test_the_done_line_says_why_it_shows_no_loss():
    """Where no interval logged a loss: every step run was skipped for a non-finite loss
    (train.on_nonfinite=skip), or none ran (resumed at the last step)."""
    from types import SimpleNamespace

    from trainer.run.loop import _outcome

    run = SimpleNamespace(every=SimpleNamespace(steps=6), start=2, last={}, last_eval={})
    run.tokens_per_step = 64
    assert _outcome(run, {"train/tokens_seen": 384.0}) == (
        "no loss to show: the 4 step(s) run were all skipped for a non-finite loss"
    )
    run.last_eval = {"eval/loss": 2.5, "eval/perplexity": 12.18}  # no rate logged: none shown
    assert _outcome(run, {}).endswith("non-finite loss, val loss 2.5000, perplexity 12.18")
    run.start = 6
    assert _outcome(run, {}) == "resumed at step 6 = train.steps: nothing to train"
