"""A soak: runs under `torchrun --max-restarts` through a seeded schedule of faults, each
compared with the uninterrupted run.

    nice python scripts/chaos.py                       # 50 faults: ddp, zero, fsdp x 2, 4 ranks
    python scripts/chaos.py --faults 12 --modes fsdp --worlds 2 --seed 3 --out runs/chaos

For every mode, world size and `ckpt.async` off and on, one run of a small GPT meets its
share of the faults ([Note: fault injection] in trainer/checkpoint/faults.py: kill, hang,
term (a SIGTERM preemption), corrupt (a flipped byte in the newest checkpoint),
kill_in_save, fail_in_save, kill_in_prune), drawn from `--seed`, each fired once
(SHARDTRAIN_FAULT_ONCE) with torchrun restarting the group after each. Then the same run
without faults (once per mode and world size: an async save changes no number). The table
gives per run the faults fired, the restarts, the steps recomputed per fault (the fault's
step minus the step the next group resumed from), the wall time lost per fault (the run's
time over the uninterrupted one's, divided by the faults) and whether the final model,
the last checkpoint's data files and the tokens seen equal the uninterrupted run's,
bitwise; then per kind of fault the seconds from the fault to the restarted group's
resume. It is written to <out>/chaos.md; the runs' logs stay under <out>. A run that did
not end bitwise equal (a NO row) is named on stderr and the script exits 1. Replica groups
killed and healed under ft: scripts/benchmarks/chaos_ft.py.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from trainer.checkpoint.faults import POINTS  # noqa: E402

STEPS, EVERY, KEEP = 16, 2, 2
ARGS = [
    "model=gpt",
    "data=tokens",
    "model.n_embd=16",
    "model.block_size=8",
    "data.dataset.block_size=8",
    "data.dataset.n=512",
    "train.batch_size=8",
    f"train.steps={STEPS}",
    "train.log_every=4",
    "train.eval_every=0",
    f"ckpt.every={EVERY}",
    f"ckpt.keep={KEEP}",
]


def faults_of_a_plain_run() -> list[str]:
    """The fault actions that make a run without ft restart: not ft's (a failed commit, a
    kill inside a fragment sync) and not `pause`, which only slows a step."""
    return [k for k in POINTS if POINTS[k] in ("step", "save", "prune") and k != "pause"]


def allowed_steps(action: str) -> list[int]:
    """The steps at which `action` fires and makes the group restart."""
    saves = list(range(EVERY, STEPS + 1, EVERY))
    if action in ("kill_in_save", "fail_in_save"):
        return saves
    if action == "kill_in_prune":  # a save that has KEEP older ones to prune
        return [s for s in saves if s > KEEP * EVERY]
    if action == "corrupt":  # after the first checkpoint, so that there is one to corrupt
        return list(range(EVERY + 1, STEPS))
    if action == "term":  # it stops at the next check step: one before the last
        return list(range(1, STEPS - 2))
    return list(range(1, STEPS))  # kill, hang


def schedules(seed: int, faults: int, runs: int, worlds: list[int]) -> list[list[str]]:
    """`faults` entries dealt over `runs` runs, every kind equally often (a shuffled deck),
    at most one per step of a run: two at one step would fire in one group (the first
    kill takes the other's effect with it) or never (a save not written again)."""
    rng = random.Random(seed)
    kinds = faults_of_a_plain_run()
    deck = (kinds * (faults // len(kinds) + 1))[:faults]
    rng.shuffle(deck)
    out: list[list[str]] = [[] for _ in range(runs)]
    used: list[set[int]] = [set() for _ in range(runs)]
    for i, action in enumerate(deck):
        run = i % runs
        world = worlds[run]
        rank = 0 if action == "kill_in_prune" else rng.randrange(world)
        free = [s for s in allowed_steps(action) if s not in used[run]] or allowed_steps(action)
        step = rng.choice(free)
        used[run].add(step)
        out[run].append(f"{rank}:{step}:{action}")
    return [sorted(s, key=lambda e: int(e.split(":")[1])) for s in out]


def launch(args: list[str], world: int, env: dict[str, str], restarts: int, log: Path):
    """torchrun with `args`: (seconds, return code, [(time, line)] of its output)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc-per-node={world}", f"--max-restarts={restarts}", str(ROOT / "train.py")]
    lines: list[tuple[float, str]] = []
    t0 = time.monotonic()
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **env}
    with open(log, "w") as f:
        proc = subprocess.Popen(
            cmd + args, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        for raw in proc.stdout:
            text = raw.decode(errors="replace")
            f.write(text)
            for part in text.replace("\r", "\n").splitlines():
                lines.append((time.time(), part))
        code = proc.wait()
    return time.monotonic() - t0, code, lines


def resumes(lines: list[tuple[float, str]]) -> list[tuple[float, int]]:
    """(time, step) of each restarted group's resume: every one prints one of these."""
    out = []
    for t, line in lines:
        if line.startswith("resumed from ") and " at step " in line:
            out.append((t, int(line.rsplit(" ", 1)[1])))
        elif "resume=auto found no checkpoint" in line:
            out.append((t, 0))
    return out


def same_end(run_dir: Path, clean_dir: Path) -> tuple[bool, bool]:
    """(final model and last checkpoint's data files bitwise equal, tokens seen and data
    position equal)."""
    import torch

    a = torch.load(run_dir / "final_model.pt", weights_only=True)
    b = torch.load(clean_dir / "final_model.pt", weights_only=True)
    model = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    last = f"checkpoints/step_{STEPS:06d}"
    bins = sorted(p.name for p in (clean_dir / last).glob("rank*.bin"))
    model = model and all(
        (run_dir / last / n).read_bytes() == (clean_dir / last / n).read_bytes() for n in bins
    )
    metrics = [json.loads((d / "final_metrics.json").read_text()) for d in (run_dir, clean_dir)]
    states = [
        torch.load(d / last / "meta.pt", weights_only=True)["state"] for d in (run_dir, clean_dir)
    ]
    seen = [m.get("train/tokens_seen") for m in metrics]
    tokens = seen[0] is not None and seen[0] == seen[1]
    return model, tokens and states[0] == states[1]


def failures(ends: dict[str, tuple[bool, bool]]) -> list[str]:
    """The runs that did not end as the uninterrupted one (their final model and last
    checkpoint, or their tokens seen and data position, not bitwise equal): the NO rows,
    each as `name: what differs`."""
    out = []
    for name, (model, tokens) in ends.items():
        checks = (("final model + last checkpoint", model), ("tokens seen", tokens))
        what = [w for w, ok in checks if not ok]
        if what:
            out.append(f"{name}: {' and '.join(what)} not bitwise equal")
    return out


def exit_code(ends: dict[str, tuple[bool, bool]]) -> int:
    """0 when every run ended bitwise equal to the uninterrupted one, else 1: a NO row fails
    the soak."""
    return 1 if failures(ends) else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--faults", type=int, default=50, help="faults in all (default 50)")
    p.add_argument("--modes", default="ddp,zero,fsdp")
    p.add_argument("--worlds", default="2,4", help="world sizes (default 2,4)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-s", type=int, default=20, help="dist.timeout_s: what a hang costs")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "chaos")
    a = p.parse_args(argv)
    modes, worlds = a.modes.split(","), [int(w) for w in a.worlds.split(",")]
    configs = [(m, w, x) for m in modes for w in worlds for x in (False, True)]
    plans = schedules(a.seed, a.faults, len(configs), [w for _, w, _ in configs])
    a.out.mkdir(parents=True, exist_ok=True)
    base = [*ARGS, f"dist.timeout_s={a.timeout_s}"]
    clean: dict[tuple[str, int], tuple[Path, float]] = {}
    rows, kinds = [], {k: [] for k in faults_of_a_plain_run()}
    ends: dict[str, tuple[bool, bool]] = {}  # per run: (model equal, tokens equal)
    t_all = time.monotonic()
    for (mode, world, async_), plan in zip(configs, plans, strict=True):
        name = f"{mode}_p{world}_{'async' if async_ else 'sync'}"
        if (mode, world) not in clean:
            d = a.out / f"{mode}_p{world}_clean"
            secs, code, _ = launch(
                [*base, f"mode={mode}", f"hydra.run.dir={d}"], world, {}, 0, a.out / f"{d.name}.log"
            )
            if code != 0:
                sys.exit(
                    f"error: the uninterrupted {mode} run on {world} ranks failed; see {d}.log"
                )
            clean[(mode, world)] = (d, secs)
        clean_dir, clean_s = clean[(mode, world)]
        run_dir, fired_dir = a.out / name, a.out / f"{name}_fired"
        env = {"SHARDTRAIN_FAULT": ",".join(plan), "SHARDTRAIN_FAULT_ONCE": str(fired_dir)}
        args = [
            *base,
            f"mode={mode}",
            f"ckpt.async={str(async_).lower()}",
            f"hydra.run.dir={run_dir}",
        ]
        print(f"{name}: {', '.join(plan)}", flush=True)
        secs, code, lines = launch(args, world, env, len(plan) + 2, a.out / f"{name}.log")
        fired = []  # (time, step, action) of each entry that fired
        for f in sorted(fired_dir.iterdir()) if fired_dir.is_dir() else []:
            _, _, step, action = f.name.split("-", 3)
            fired.append((float(f.read_text()), int(step), action))
        fired.sort()
        back = resumes(lines)
        recomputed, to_resume = [], []
        for t, step, action in fired:
            after = [(tr, s) for tr, s in back if tr > t]
            if after:
                recomputed.append(max(0, step - after[0][1]))
                to_resume.append(after[0][0] - t)
                kinds[action].append((recomputed[-1], to_resume[-1]))
        ok = code == 0 and (run_dir / "final_model.pt").is_file()
        model, tokens = same_end(run_dir, clean_dir) if ok else (False, False)
        ends[name] = (model, tokens)
        n = max(len(fired), 1)
        rows.append(
            f"| {mode} | {world} | {'on' if async_ else 'off'} | {len(fired)} of {len(plan)} | "
            f"{', '.join(sorted({x for _, _, x in fired}))} | {len(back)} | "
            f"{sum(recomputed) / n:.1f} | {(secs - clean_s) / n:.1f} | "
            f"{'yes' if model else 'NO'} | {'yes' if tokens else 'NO'} |"
        )
        print(rows[-1], flush=True)
    head = (
        "| mode | P | async | faults fired | kinds | restarts | steps recomputed / fault "
        "| wall s lost / fault | final model + last checkpoint bitwise | tokens seen equal |\n"
        "|---|---:|---|---|---|---:|---:|---:|---|---|"
    )
    per_kind = [
        "| fault | fired | steps recomputed (mean) | s from fault to resume (mean) |",
        "|---|---:|---:|---:|",
    ]
    for k, v in kinds.items():
        if v:
            per_kind.append(
                f"| {k} | {len(v)} | {sum(r for r, _ in v) / len(v):.1f} | "
                f"{sum(s for _, s in v) / len(v):.1f} |"
            )
    total = sum(
        len(list((a.out / f"{m}_p{w}_{'async' if x else 'sync'}_fired").glob("*")))
        for m, w, x in configs
    )
    report = (
        f"{head}\n" + "\n".join(rows) + "\n\n" + "\n".join(per_kind) + "\n\n"
        f"{total} faults fired, seed {a.seed}, {STEPS} steps each (checkpoint every {EVERY}, "
        f"keep {KEEP}), dist.timeout_s={a.timeout_s}; soak wall time "
        f"{(time.monotonic() - t_all) / 60:.1f} min\n"
    )
    (a.out / "chaos.md").write_text(report)
    print(report)
    for line in failures(ends):
        print(f"error: {line} (log: {a.out / line.split(':')[0]}.log)", file=sys.stderr)
    return exit_code(ends)


if __name__ == "__main__":
    sys.exit(main())
