"""Replica groups in tests: torchft's Lighthouse in the test process, and each group a job
of its own (`python train.py`, or torchrun for groups of several ranks), as a user
launches them ([Note: fault-tolerant replica groups] in trainer/comm/replicas.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from warm_cli import Job, popen_to_log

ROOT = Path(__file__).resolve().parents[1]


class Lighthouse:
    """torchft's Lighthouse, in this process, on `host` (the loopback address unless a
    test's network says otherwise)."""

    def __init__(
        self, min_replicas: int, join_timeout_ms: int = 10_000, host: str = "127.0.0.1"
    ) -> None:
        from torchft._torchft import LighthouseServer

        self.server = LighthouseServer(
            bind=f"{host}:0",
            min_replicas=min_replicas,
            join_timeout_ms=join_timeout_ms,
            quorum_tick_ms=10,
            heartbeat_timeout_ms=500,
        )
        self.address = f"http://{host}:" + self.server.address().rsplit(":", 1)[1]

    def close(self) -> None:
        self.server.shutdown()


def clean_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment without a fault or a rank of its own, torchft quiet."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SHARDTRAIN_FAULT", "RANK"))}
    return {**env, "RUST_LOG": "warn", **(extra or {})}


def start_group(
    run_dir: Path,
    lighthouse: str,
    g: int,
    args: Sequence[str],
    env: dict[str, str] | None = None,
    nproc: int = 1,
    restarts: int = 0,
) -> subprocess.Popen | Job:
    """Replica group g as a job of its own writing to `run_dir`/g<g>, its output in a log
    file beside it (`p.log`)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    log = run_dir / f"g{g}-{time.monotonic_ns()}.log"
    launch = [sys.executable, "train.py"]
    if nproc > 1:
        launch = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                  f"--nproc-per-node={nproc}", f"--max-restarts={restarts}",
                  "train.py"]  # fmt: skip
    argv = [*launch, *args, f"ft.replica_group={g}", f"ft.lighthouse={lighthouse}",
            f"hydra.run.dir={run_dir}/g{g}"]  # fmt: skip
    p = popen_to_log(argv, clean_env(env), log, ROOT)  # from the warm server when it can be
    p.log = log
    return p


def finished(p: subprocess.Popen | Job, timeout: float = 120) -> str:
    """The job's output once it ended (killed after `timeout` seconds)."""
    try:
        p.wait(timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
    return p.log.read_text()


def final_model(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "final_model.pt", map_location="cpu", weights_only=True)


def wait_for_line(p: subprocess.Popen | Job, line: str, timeout: float = 120) -> None:
    """Until the running job `p` (start_group's) has written `line` to its log."""
    end = time.monotonic() + timeout
    while line not in p.log.read_text():
        assert p.poll() is None and time.monotonic() < end, p.log.read_text()[-3000:]
        time.sleep(0.1)


def fresh_then_back(
    run_dir: Path, lighthouse: str, args: Sequence[str], resumed_at: int, dropped: int
) -> None:
    """[Note: a group's origin]'s case: group 1 started afresh alone (no checkpoint of its
    own), held in the quorum after its step 8; then group 0 back from its checkpoint of step
    `resumed_at` under `run_dir`/g0; then group 1 let go. Both must end well, group 0
    keeping its model and group 1 dropping its `dropped` steps to heal from it."""
    go = run_dir / "go"
    pause = {"SHARDTRAIN_FAULT": "0:8:pause", "SHARDTRAIN_FAULT_PAUSE_UNTIL": str(go)}
    alone = ["ft.min_groups=1", "ft.join_timeout_s=0.1"]
    fresh = start_group(run_dir, lighthouse, 1, [*args, *alone], env=pause)
    wait_for_line(fresh, "fault: rank 0 pauses after step 8")
    back = start_group(run_dir, lighthouse, 0, [*args, "ft.min_groups=2", "resume=auto"])
    wait_for_line(back, f"at step {resumed_at}")  # resumed: its quorum is next
    go.touch()
    log1, log0 = finished(fresh), finished(back)
    for p, log in zip((fresh, back), (log1, log0), strict=True):
        assert p.returncode == 0, log[-3000:]
    assert "group 0: healed" not in log0, log0[-3000:]
    want = f"group 0: not healed from a group at step {dropped} (started afresh at"
    assert want in log0, log0[-3000:]
    assert f"Its {dropped} steps are dropped" in log1, log1[-3000:]
    assert f"group 1: healed from a live peer at step {resumed_at}" in log1, log1[-3000:]
