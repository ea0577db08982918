"""What a Lighthouse outage costs replica groups under ft ([Note: a Lighthouse outage] in
trainer/comm/replicas.py): the table of docs/fault_tolerance.md, "A Lighthouse outage".

    python scripts/benchmarks/lighthouse_outage.py --groups 3 --down 3 --reps 2
    python scripts/benchmarks/lighthouse_outage.py --reps 1 ft.connect_timeout_s=2

N replica groups of one rank (ddp) train a small MLP through a Lighthouse that runs as its
own process (`torchft_lighthouse`, on 127.0.0.1, heartbeat timeout 1 s). Each rep runs the
same job twice, alternating: undisturbed, then with the Lighthouse SIGKILLed `--kill-after`
seconds after every group has started training and started again on the same port `--down`
seconds later. Per run: the outage (from the kill to the new Lighthouse accepting
connections: its start-up counts), the longest time between two committed steps (from the
groups' `committed ... s after the last` lines), and the time from the launch to the last
group's exit. Exits 1 unless, in every run, every group exits 0 and all end bitwise equal.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
JOB = [
    "model=mlp", "data=synthetic", "optim=sgd", "optim.momentum=0.9", "optim.lr=0.01",
    "train.batch_size=60", "train.log_every=50", "train.eval_every=0", "ckpt.every=0",
    "ft.enabled=true", "ft.timeout_s=10",
]  # fmt: skip


class Lighthouse:
    """torchft's Lighthouse as a process of its own, on a fixed loopback port."""

    def __init__(self, log: Path) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.log = log
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        """Starts it; returns once it accepts connections."""
        argv = [str(Path(sys.executable).with_name("torchft_lighthouse")),
                f"--bind=127.0.0.1:{self.port}", "--min_replicas=1", "--join_timeout_ms=10000",
                "--heartbeat_timeout_ms=1000"]  # fmt: skip
        with open(self.log, "a") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
        while True:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            if self.proc.poll() is not None:
                sys.exit(f"error: the Lighthouse exited {self.proc.returncode}: see {self.log}")
            time.sleep(0.01)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()


def one_run(
    out: Path, groups: int, steps: int, outage: tuple[float, float] | None, extra: list[str]
) -> dict:
    """One job of `groups` groups; `outage` (kill after, down for) or None."""
    out.mkdir(parents=True, exist_ok=True)
    lh = Lighthouse(out / "lighthouse.log")
    lh.start()
    env = {**os.environ, "RUST_LOG": "warn"}
    args = [*JOB, f"train.steps={steps}", f"ft.replica_groups={groups}",
            f"ft.lighthouse=http://127.0.0.1:{lh.port}", *extra]  # fmt: skip
    t0 = time.monotonic()
    procs = []
    for g in range(groups):
        with open(out / f"g{g}.log", "w") as log:
            argv = [sys.executable, "train.py", *args, f"ft.replica_group={g}",
                    f"hydra.run.dir={out}/g{g}"]  # fmt: skip
            procs.append(subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=log))
    down = None
    try:
        if outage is not None:
            bar = re.compile(rf"\b([1-9]\d*)/{steps} \[")  # training: a step on the bar
            while not all(bar.search((out / f"g{g}.log").read_text()) for g in range(groups)):
                if any(p.poll() is not None for p in procs):
                    break
                time.sleep(0.02)
            time.sleep(outage[0])
            lh.kill()
            killed = time.monotonic()
            time.sleep(outage[1])
            lh.start()
            down = time.monotonic() - killed
        codes = [p.wait() for p in procs]
        total = time.monotonic() - t0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        lh.kill()
    logs = [(out / f"g{g}.log").read_text() for g in range(groups)]
    gaps = [float(x) for log in logs for x in re.findall(r"committed ([\d.]+) s after the", log)]
    finals = [torch.load(out / f"g{g}/final_model.pt", weights_only=True) for g in range(groups)
              if codes[g] == 0]  # fmt: skip
    equal = len(finals) == groups and all(
        torch.equal(finals[0][k], f[k]) for f in finals[1:] for k in f
    )
    return {"codes": codes, "down": down, "gap": max(gaps, default=0.0), "total": total,
            "equal": equal}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--groups", type=int, default=3)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--down", type=float, default=3.0, help="s from the kill to the restart")
    p.add_argument("--kill-after", type=float, default=5.0, help="s into training")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "lighthouse_outage")
    p.add_argument("overrides", nargs="*", help="for every group, e.g. ft.connect_timeout_s=2")
    a = p.parse_args(argv)
    rows, ok = [], True
    for rep in range(a.reps):
        for name, outage in (("none", None), ("outage", (a.kill_after, a.down))):
            r = one_run(a.out / f"{rep}_{name}", a.groups, a.steps, outage, a.overrides)
            ok &= r["equal"] and r["codes"] == [0] * a.groups
            rows.append((name, r))
            down = f"{r['down']:.1f} s" if r["down"] is not None else "-"
            print(f"rep {rep} {name:6}: outage {down}, longest gap {r['gap']:.1f} s, total "
                  f"{r['total']:.1f} s, exits {r['codes']}, bitwise equal {r['equal']}",
                  flush=True)  # fmt: skip
    for name in ("none", "outage"):
        totals = [r["total"] for n, r in rows if n == name]
        gaps = [r["gap"] for n, r in rows if n == name]
        print(f"{name:6}: total median {statistics.median(totals):.1f} s, longest gaps {gaps}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
