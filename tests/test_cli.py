"""The command line as users run it: torchrun, Hydra overrides, one run directory."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]


def run_cli(args: list[str], nproc: int | None = 2, timeout: float = 240):
    launcher = TORCHRUN + [f"--nproc-per-node={nproc}"] if nproc else [sys.executable]
    return subprocess.run(
        launcher + [str(ROOT / "train.py"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
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
    for tag in (
        "train/loss",
        "train/accuracy",
        "perf/samples_per_s",
        "perf/step_time_s",
        "comm/overlap_pct",
    ):
        assert tag in values, sorted(values)
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
