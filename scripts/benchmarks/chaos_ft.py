"""A soak of replica-group kills under ft ([Note: fault-tolerant replica groups] in
trainer/comm/replicas.py), against the same kills under plain torchrun restarts: the tables
of docs/fault_tolerance.md, "Measured".

    nice python scripts/benchmarks/chaos_ft.py --kills 10 --modes ddp,fsdp --seed 0
    python scripts/benchmarks/chaos_ft.py --kills 4 --modes ddp --overhead-reps 1

Per mode, two replica groups (ddp: 1 rank each; fsdp: 2 ranks each, sharded inside a group
and replicated across: hybrid) train a small GPT through a Lighthouse this process runs on
127.0.0.1, and `--kills` SIGKILLs are dealt to them in turn ([Note: when the kills fall]).
This script is the groups' supervisor: a group whose process exits non-zero is started
again (a fresh process, healing from the live group), until both exit 0. Per kill it
reports the survivor's stall, the steps recomputed, the heal and the relaunch's time; the
same run without faults and one process without ft are the references; the same kills
then meet one torchrun of all the ranks; last, ft's per-step cost when nothing fails
([Note: what the soak measures]).

Written to <out>/chaos_ft.md (default runs/chaos_ft); logs and run directories stay under
<out>. Exits 1 if a faulty run did not end with both groups equal and within the bound of
[Note: what the soak measures] of the uninterrupted one, or with other tokens seen.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from scripts import chaos  # noqa: E402

# chaos.py's small GPT, its step counts and checkpoints left to each run here
SMALL = [
    *(a for a in chaos.ARGS if not a.startswith(("train.steps=", "train.log_every=", "ckpt."))),
    "dist.timeout_s=20",
    # AdamW's default eps turns the rounding of a reordered sum into lr-sized steps on a
    # parameter whose gradient is ~0, and over thousands of steps the runs then drift far
    # apart whatever the faults (measured: 0.14 relative between the uninterrupted fsdp
    # run and one process after 10,800 steps): the parity tests' eps keeps the comparison
    # about the faults
    "optim.eps=1e-3",
]
BIG = [
    *SMALL,
    "model.n_embd=256",
    "model.n_layer=4",
    "model.block_size=128",
    "data.dataset.block_size=128",
    "train.batch_size=16",
]
RANKS = {"ddp": 1, "fsdp": 2}  # ranks per replica group
GROUPS = 2
# The faulty run may be this much farther from the uninterrupted one than the uninterrupted
# run is from one process: both differences are the order of fp32 sums (a survivor adds two
# groups' micro-batches where the others add them across groups), carried over thousands
# of steps, so the same run measures the bound (max |diff| over every tensor).
SPREAD = 2.0

LINE = re.compile(r"ft: group (\d+): (.*)")
MEMBERS = re.compile(r"step (\d+): (\d+) of \d+ replica groups")
COMMITTED = re.compile(r"step (\d+) committed ([\d.]+) s after the last")
REDONE = re.compile(r"step (\d+) did not commit")
HEALED = re.compile(r"healed from a live peer at step (\d+) in ([\d.]+) s")


# -- the groups and their supervisor -------------------------------------------------------


class Lighthouse:
    """torchft's Lighthouse in this process, on 127.0.0.1 (a fresh one per run)."""

    def __init__(self, tick_ms: int) -> None:
        os.environ.setdefault("RUST_LOG", "warn")  # it logs every quorum at INFO
        from torchft._torchft import LighthouseServer

        self.server = LighthouseServer(
            bind="127.0.0.1:0",
            min_replicas=1,
            join_timeout_ms=1000,
            quorum_tick_ms=tick_ms,
            heartbeat_timeout_ms=1000,
        )
        self.address = "http://127.0.0.1:" + self.server.address().rsplit(":", 1)[1]

    def close(self) -> None:
        self.server.shutdown()


@dataclass
class Life:
    """One process of one replica group: when it started, its output lines (time, text)
    and how it ended."""

    group: int
    started: float
    proc: subprocess.Popen
    lines: list[tuple[float, str]] = field(default_factory=list)
    code: int | None = None
    ended: float | None = None
    reader: threading.Thread | None = None


def child_env() -> dict[str, str]:
    """A group's environment: no fault of this process's own, and one intra-op thread per
    rank as torchrun gives each of its workers (two 2-thread processes on 2 cores are
    several times slower a step)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SHARDTRAIN_FAULT", "RANK"))}
    return {**env, "RUST_LOG": "warn", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


def read_lines(life: Life, log: Path) -> None:
    """Timestamps each line of `life`'s output as it arrives (tqdm's \\r-updates split)."""
    with open(log, "a") as f:
        for raw in life.proc.stdout:
            text = raw.decode(errors="replace")
            f.write(text)
            for part in text.replace("\r", "\n").splitlines():
                life.lines.append((time.time(), part))


def start_group(group: int, ranks: int, args: list[str], env: dict[str, str], log: Path) -> Life:
    """One replica group: `python train.py` (1 rank) or torchrun of `ranks` ranks."""
    cmd = [sys.executable, str(ROOT / "train.py")]
    if ranks > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={ranks}", str(ROOT / "train.py")]  # fmt: skip
    proc = subprocess.Popen(
        cmd + args,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group: a timeout ends it and its ranks
    )
    life = Life(group, time.time(), proc)
    life.reader = threading.Thread(target=read_lines, args=(life, log), daemon=True)
    life.reader.start()
    return life


def supervise(
    mode: str,
    run_dir: Path,
    base: list[str],
    kills: dict[int, list[str]],
    tick_ms: int,
    timeout_s: float,
) -> list[Life]:
    """Both replica groups of one ft run, each started again whenever it exits non-zero,
    until both exit 0 (or `timeout_s`: everything still running is killed). `kills`: the
    SHARDTRAIN_FAULT entries of each group (fired once each: a ONCE dir per group)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    lighthouse = Lighthouse(tick_ms)
    ranks = RANKS[mode]
    lives: list[Life] = []
    current: dict[int, Life] = {}
    limit = {g: len(kills.get(g, [])) + 2 for g in range(GROUPS)}  # relaunches allowed

    def launch(g: int) -> None:
        env = child_env()
        if kills.get(g):
            env["SHARDTRAIN_FAULT"] = ",".join(kills[g])
            env["SHARDTRAIN_FAULT_ONCE"] = str(run_dir / f"fired_g{g}")
        args = [*base, f"mode={mode}", "ft.enabled=true", f"ft.replica_groups={GROUPS}",
                "ft.min_groups=1", "ft.timeout_s=10", f"ft.replica_group={g}",
                f"ft.lighthouse={lighthouse.address}", f"hydra.run.dir={run_dir}/g{g}"]  # fmt: skip
        current[g] = start_group(g, ranks, args, env, run_dir / f"g{g}.log")
        lives.append(current[g])

    t0 = time.monotonic()
    try:
        for g in range(GROUPS):
            launch(g)
        done: set[int] = set()
        while len(done) < GROUPS:
            if time.monotonic() - t0 > timeout_s:
                print(f"error: {run_dir.name}: still running after {timeout_s:.0f} s", flush=True)
                break
            for g, life in list(current.items()):
                if g in done or life.proc.poll() is None:
                    continue
                life.code, life.ended = life.proc.returncode, time.time()
                life.reader.join(5)
                if life.code == 0:
                    done.add(g)
                elif sum(x.group == g for x in lives) <= limit[g]:
                    print(f"  {run_dir.name}: group {g} exited {life.code}: relaunched", flush=True)
                    launch(g)
                else:
                    print(f"error: {run_dir.name}: group {g} exited {life.code} again", flush=True)
                    done.add(g)
            time.sleep(0.05)
    finally:
        for life in current.values():
            if life.proc.poll() is None:
                os.killpg(life.proc.pid, signal.SIGKILL)
                life.code, life.ended = life.proc.wait(), time.time()
        lighthouse.close()
    return lives


# -- the kills ---------------------------------------------------------------------------

# [Note: when the kills fall]
# The SIGKILLs (SHARDTRAIN_FAULT, once each) are dealt alternately to group 0 and group 1 at
# seeded steps spread over the first 70% of the run, at least `--gap` steps apart: the
# survivor trains alone while the killed group restarts, and must not meet its own kill
# before the other is back (with this tiny model it runs ~200 steps/s alone, and a 1-rank
# group takes 3-8 s from its exit to its heal, the longer on a busy machine). train.steps
# is what puts the kills in 70% of the run with a quarter of `--gap` left to the draw.


def kill_plan(
    seed: int, kills: int, steps: int, gap: int, first: int
) -> list[tuple[int, int, int]]:
    """(group, rank in the group, step) of each kill: groups alternate from 0, steps
    seeded over [first, 0.7 steps], at least `gap` apart; rank drawn (fsdp: 0 or 1)."""
    rng = random.Random(seed)
    span = (int(0.7 * steps) - first) // kills
    if span < gap:
        sys.exit(f"error: {kills} kills {gap} steps apart do not fit in 70% of {steps} steps")
    out = []
    for k in range(kills):
        step = first + k * span + rng.randrange(span - gap + 1)
        out.append((k % GROUPS, rng.randrange(max(RANKS.values())), step))
    return out


def fired(once_dir: Path) -> list[tuple[float, int]]:
    """(time, step) of each entry that fired, from its marker `<i>-<rank>-<step>-<action>`."""
    if not once_dir.is_dir():
        return []
    return sorted((float(f.read_text()), int(f.name.split("-")[2])) for f in once_dir.iterdir())


def ft_events(lives: list[Life], group: int, pattern: re.Pattern) -> list[tuple[float, tuple]]:
    """(time, groups of `pattern`) of group `group`'s `ft: group G: ...` lines, all lives."""
    out = []
    for life in lives:
        for t, text in life.lines:
            m = LINE.search(text)  # tqdm's bar may precede it on the line
            if m and int(m.group(1)) == group:
                found = pattern.match(m.group(2))
                if found:
                    out.append((t, found.groups()))
    return sorted(out)


def stall_at(lives: list[Life], group: int, step: int, after: float) -> float:
    """Group `group`'s `committed X s after the last` figure for `step` (0: none printed:
    under the trainer's threshold)."""
    for t, (s, secs) in ft_events(lives, group, COMMITTED):
        if t >= after and int(s) == step:
            return float(secs)
    return 0.0


@dataclass
class FaultRow:
    group: int
    step: int
    stall_lost: float
    stall_back: float
    fault_to_exit_s: float | None
    recomputed: int | None
    heal_s: float | None
    relaunch_to_heal_s: float | None
    fault_to_heal_s: float | None
    notes: list[str] = field(default_factory=list)


# [Note: what the soak measures]
# Every output line is timestamped as it arrives, giving per kill: the survivor's stall
# (its `committed X s after the last` figure at the step it lost the group and at the step
# the group came back: the larger; under the trainer's 0.5 s threshold it prints none and 0
# is counted), the steps the job recomputed (each `did not commit` redo is one; a heal to a
# step below the killed one would add the difference), the heal (the `healed ... in X s`
# figure: quorum, state sent and loaded) and the seconds from the relaunch to that heal
# line (the interpreter's start and imports included).
#
# The same run without faults and one process without ft (same config, whole global
# batch) are the references: both groups of the faulty run must end bitwise equal to each
# other, with the same train/tokens_seen, and no farther (max |diff| over every tensor)
# from the uninterrupted ft run than SPREAD times the uninterrupted run's own distance from
# one process: the reduction-order bound, measured in the same soak. The same kills then
# meet one torchrun of all the ranks (fsdp with mode.shard_group_size=2, the same hybrid
# layout), `--max-restarts`, ckpt.every=`--ckpt-every`: steps recomputed and seconds from
# fault to resume per kill (scripts/chaos.py's measures). Last, ft's per-step cost when
# nothing fails: the uninterrupted 2 x 1 ft run against torchrun of 2 ranks, same global
# batch, alternated, `--overhead-reps` each, median of perf/step_time_s of the run's second
# half (final_metrics.json), for the GPT above and a bigger one.


def fault_rows(lives: list[Life], run_dir: Path) -> list[FaultRow]:
    """Per kill that fired (in time order): what the survivor and the killed group did."""
    kills = sorted((t, g, s) for g in range(GROUPS) for t, s in fired(run_dir / f"fired_g{g}"))
    rows = []
    for k, (tf, g, step) in enumerate(kills):
        t_next = kills[k + 1][0] if k + 1 < len(kills) else float("inf")
        survivor = 1 - g
        row = FaultRow(g, step, 0.0, 0.0, None, None, None, None, None)
        died = [x for x in lives if x.group == g and x.started < tf and x.ended and x.ended >= tf]
        if died:
            row.fault_to_exit_s = died[0].ended - tf
        members = [
            (t, int(s), int(n))
            for t, (s, n) in ft_events(lives, survivor, MEMBERS)
            if tf <= t < t_next
        ]
        lost = [(t, s) for t, s, n in members if n < GROUPS]
        if lost:
            row.stall_lost = stall_at(lives, survivor, lost[0][1], lost[0][0])
        back = [(t, s) for t, s, n in members if n == GROUPS and (not lost or t > lost[0][0])]
        if back:
            row.stall_back = stall_at(lives, survivor, back[0][1], back[0][0])
        again = [x for x in lives if x.group == g and x.started >= tf]
        heal = ft_events(again[:1], g, HEALED)
        first_of_two = not heal and k + 1 < len(kills) and kills[k + 1][1] == survivor
        if first_of_two:  # the survivor met its own kill first: no live state left
            row.notes.append(f"group {survivor} killed (kill {k + 2}) before this group healed")
        if heal:
            t_heal, (h_step, h_secs) = heal[0]
            row.heal_s = float(h_secs)
            row.relaunch_to_heal_s = t_heal - again[0].started
            row.fault_to_heal_s = t_heal - tf
            redone = sum(
                1
                for grp in range(GROUPS)
                for t, _ in ft_events(lives, grp, REDONE)
                if tf <= t < t_next
            )
            row.recomputed = redone + max(0, step - int(h_step))
        elif rows and rows[-1].group == survivor and rows[-1].heal_s is None:
            row.recomputed = step  # ckpt.every=0: both groups started again from step 0
            row.notes.append("both groups down: the run started again from step 0")
        elif not first_of_two:
            row.notes.append(f"group {g} never healed")
        rows.append(row)
    return rows


# -- the references and the comparisons -------------------------------------------------


def load_model(run_dir: Path) -> dict:
    import torch

    return torch.load(run_dir / "final_model.pt", map_location="cpu", weights_only=True)


def compare(a_dir: Path, b_dir: Path) -> tuple[bool, float, float]:
    """(bitwise equal, max |a - b|, max over tensors of max |a - b| / max |b|)."""
    a, b = load_model(a_dir), load_model(b_dir)
    if a.keys() != b.keys():
        return False, float("inf"), float("inf")
    equal, worst, rel = True, 0.0, 0.0
    for k, want in b.items():
        got = a[k].float()
        diff = (got - want.float()).abs().max().item() if want.numel() else 0.0
        equal = equal and bool((a[k] == want).all())
        worst = max(worst, diff)
        rel = max(rel, diff / max(want.float().abs().max().item(), 1e-12))
    return equal, worst, rel


def metrics(run_dir: Path) -> dict:
    path = run_dir / "final_metrics.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def one_process(mode: str, base: list[str], run_dir: Path) -> float:
    """The same config in one process without ft: the whole global batch; its seconds."""
    t0 = time.monotonic()
    with open(run_dir.with_suffix(".log"), "w") as log:
        code = subprocess.run(
            [sys.executable, str(ROOT / "train.py"), *base, f"mode={mode}",
             f"hydra.run.dir={run_dir}"],
            cwd=ROOT, env=child_env(), stdout=log, stderr=subprocess.STDOUT,
        ).returncode  # fmt: skip
    if code != 0:
        sys.exit(f"error: the one-process {mode} reference failed; see {run_dir}.log")
    return time.monotonic() - t0


def torchrun_soak(
    mode: str, base: list[str], plan: list[tuple[int, int, int]], every: int, out: Path
) -> tuple[list[tuple[int, float]], float, int]:
    """The same kills under one torchrun of all ranks and --max-restarts, resuming from
    checkpoints every `every` steps: ([(steps recomputed, s from fault to resume)], wall
    s, return code)."""
    ranks = RANKS[mode]
    world = GROUPS * ranks
    run_dir, fired_dir = out / f"{mode}_torchrun", out / f"{mode}_torchrun_fired"
    entries = [f"{g * ranks + r % ranks}:{s}:kill" for g, r, s in plan]
    env = {"SHARDTRAIN_FAULT": ",".join(entries), "SHARDTRAIN_FAULT_ONCE": str(fired_dir)}
    args = [*base, f"mode={mode}", f"ckpt.every={every}", "ckpt.keep=2", f"hydra.run.dir={run_dir}"]
    if mode == "fsdp":
        args.append(f"mode.shard_group_size={ranks}")  # hybrid, as the ft groups
    secs, code, lines = chaos.launch(args, world, env, len(plan) + 2, out / f"{run_dir.name}.log")
    back = chaos.resumes(lines)
    per_fault = []
    for t, step in fired(fired_dir):
        after = [(tr, s) for tr, s in back if tr > t]
        if after:
            per_fault.append((max(0, step - after[0][1]), after[0][0] - t))
    return per_fault, secs, code


# -- ft's cost per step when nothing fails ------------------------------------------------


def step_time(run_dir: Path) -> float | None:
    return metrics(run_dir).get("perf/step_time_s")


def overhead(
    name: str, base: list[str], steps: int, reps: int, tick_ms: int, out: Path
) -> tuple[float | None, float | None]:
    """Median step time (s) of the second half of `steps` steps: 2 ft groups of 1 rank
    (ddp) and torchrun of 2 ranks, alternated `reps` times each."""
    args = [*base, f"train.steps={steps}", f"train.log_every={steps // 2}", "ckpt.every=0"]
    ft, plain = [], []
    for i in range(reps):
        d = out / f"overhead_{name}_ft_{i}"
        supervise("ddp", d, args, {}, tick_ms, 600)
        ft.append(step_time(d / "g0"))
        d = out / f"overhead_{name}_torchrun_{i}"
        chaos.launch([*args, "mode=ddp", f"hydra.run.dir={d}"], 2, {}, 0, out / f"{d.name}.log")
        plain.append(step_time(d))
        print(f"  overhead {name} #{i}: ft {ft[-1]} s, torchrun {plain[-1]} s", flush=True)
    ft_ok, plain_ok = [x for x in ft if x], [x for x in plain if x]
    return (
        statistics.median(ft_ok) if ft_ok else None,
        statistics.median(plain_ok) if plain_ok else None,
    )


# -- the report ---------------------------------------------------------------------------


def fmt(x: float | int | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def mean(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


@dataclass
class ModeResult:
    mode: str
    rows: list[FaultRow]
    torchrun: list[tuple[int, float]]
    torchrun_code: int
    groups_equal: bool
    to_clean: tuple[bool, float, float]
    to_one: tuple[bool, float, float]
    clean_to_one: tuple[bool, float, float]
    tokens: list[float | None]
    lives: int
    walls: dict[str, float]

    def failures(self) -> list[str]:
        out = []
        if not self.groups_equal:
            out.append(f"{self.mode}: the two groups of the faulty run differ")
        bound = SPREAD * self.clean_to_one[1]
        if self.to_clean[1] > bound:
            out.append(
                f"{self.mode}: {self.to_clean[1]:.2e} from the uninterrupted run, beyond "
                f"{SPREAD:g} x its own {self.clean_to_one[1]:.2e} from one process"
            )
        if len(set(self.tokens)) != 1 or self.tokens[0] is None:
            out.append(f"{self.mode}: tokens seen differ: {self.tokens}")
        return out


def report(results: list[ModeResult], over: list[tuple], a: argparse.Namespace, head: str) -> str:
    per_fault = [
        "| mode | fault | group killed | step | survivor stall s (lost / back) | steps "
        "recomputed | heal s (transfer+load) | s relaunch -> healed | s fault -> group exited "
        "| s fault -> healed |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        for i, f in enumerate(r.rows, 1):
            note = f" ({'; '.join(f.notes)})" if f.notes else ""
            per_fault.append(
                f"| {r.mode} | {i} | {f.group} | {f.step} | "
                f"{max(f.stall_lost, f.stall_back):.1f} ({f.stall_lost:.1f} / {f.stall_back:.1f}) "
                f"| {fmt(f.recomputed, 'd')}{note} | {fmt(f.heal_s)} | "
                f"{fmt(f.relaunch_to_heal_s, '.1f')} | {fmt(f.fault_to_exit_s, '.1f')} | "
                f"{fmt(f.fault_to_heal_s, '.1f')} |"
            )
    summary = [
        "| mode | kills fired ft / torchrun | ft: mean survivor stall s | ft: mean s fault -> "
        "healed | torchrun: mean s fault -> resume | steps lost ft (sum) | steps recomputed "
        "torchrun (sum) | max abs diff to uninterrupted (rel) | to one process (rel) | "
        "uninterrupted to one process (rel) | "
        "groups bitwise equal | tokens equal |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in results:
        stalls = mean([max(f.stall_lost, f.stall_back) for f in r.rows])
        lost = [f.recomputed for f in r.rows]
        summary.append(
            f"| {r.mode} | {len(r.rows)} / {len(r.torchrun)} | {fmt(stalls)} | "
            f"{fmt(mean([f.fault_to_heal_s for f in r.rows]), '.1f')} | "
            f"{fmt(mean([s for _, s in r.torchrun]), '.1f')} | "
            f"{sum(x for x in lost if x is not None)} | {sum(n for n, _ in r.torchrun)} | "
            f"{r.to_clean[1]:.2e} ({r.to_clean[2]:.1e}) | {r.to_one[1]:.2e} ({r.to_one[2]:.1e}) | "
            f"{r.clean_to_one[1]:.2e} ({r.clean_to_one[2]:.1e}) | "
            f"{'yes' if r.groups_equal else 'NO'} | "
            f"{'yes' if len(set(r.tokens)) == 1 else 'NO'} ({fmt(r.tokens[0], '.0f')}) |"
        )
    over_rows = [
        "| model | ft 2 x 1 rank, s/step | torchrun 2 ranks, s/step | ft overhead ms/step |",
        "|---|---:|---:|---:|",
    ]
    for name, ft, plain in over:
        extra = (
            f"{(ft - plain) * 1e3:.1f} ({(ft / plain - 1) * 100:+.0f}%)" if ft and plain else "-"
        )
        over_rows.append(f"| {name} | {fmt(ft, '.4f')} | {fmt(plain, '.4f')} | {extra} |")
    walls = "; ".join(
        f"{r.mode}: " + ", ".join(f"{k} {v:.0f} s" for k, v in r.walls.items()) for r in results
    )
    notes = [
        f"Seed {a.seed}, {a.steps} steps, kills at least {a.gap} steps apart in the first 70%; "
        f"ft.min_groups=1, ckpt.every=0 (the last step only), Lighthouse join and heartbeat "
        f"timeouts 1000 ms, quorum tick {a.tick_ms} ms; torchrun: ckpt.every={a.ckpt_every}, "
        f"keep 2, --max-restarts=kills+2 (fsdp: mode.shard_group_size=2). {head}",
        "Survivor stall: its `committed X s after the last` at the step it lost the group and "
        "at the step the group came back, the larger; 0.0: under the trainer's 0.5 s threshold "
        "(nothing printed). Steps recomputed (ft): `did not commit` redos in either group "
        "between this kill and the next, plus any steps a heal went back; where the survivor "
        "was killed before the other group healed (both down, no live state, no checkpoint: "
        "ckpt.every=0), the second kill counts every step from 0. Heal s: the healed "
        "group's own figure (quorum, state sent and loaded); s relaunch -> healed includes the "
        "process start and imports; s fault -> healed includes the supervisor noticing the "
        "exit (and for fsdp torchrun tearing down the other rank).",
        f"Overhead: median over {a.overhead_reps} alternated runs of perf/step_time_s in "
        f"final_metrics.json (the second half of the run, one logging interval; group 0's "
        f"for ft), ddp, same global batch. Wall: {walls}.",
    ]
    return (
        "## Per kill\n\n" + "\n".join(per_fault) + "\n\n## Per mode, against torchrun restarts\n\n"
        + "\n".join(summary) + "\n\n## ft's cost per step with no fault\n\n"
        + "\n".join(over_rows) + "\n\n" + "\n\n".join(notes) + "\n"
    )  # fmt: skip


def run_mode(mode: str, a: argparse.Namespace, plan: list[tuple[int, int, int]]) -> ModeResult:
    base = [*SMALL, f"train.steps={a.steps}", f"train.log_every={a.steps // 4}"]
    out = a.out
    walls: dict[str, float] = {}
    kills: dict[int, list[str]] = {g: [] for g in range(GROUPS)}
    for g, r, s in plan:
        kills[g].append(f"{r % RANKS[mode]}:{s}:kill")
    print(f"{mode}: kills {', '.join(f'g{g}:{r % RANKS[mode]}:{s}' for g, r, s in plan)}")
    t0 = time.monotonic()
    lives = supervise(
        mode, out / f"{mode}_ft", [*base, "ckpt.every=0"], kills, a.tick_ms, a.timeout_s
    )
    walls["ft with kills"] = time.monotonic() - t0
    rows = fault_rows(lives, out / f"{mode}_ft")
    t0 = time.monotonic()
    clean = supervise(
        mode, out / f"{mode}_ft_clean", [*base, "ckpt.every=0"], {}, a.tick_ms, a.timeout_s
    )
    walls["ft uninterrupted"] = time.monotonic() - t0
    if any(x.code != 0 for x in clean):
        sys.exit(f"error: the uninterrupted {mode} ft run failed; see {out / f'{mode}_ft_clean'}")
    walls["one process"] = one_process(mode, base, out / f"{mode}_one")
    torchrun, walls["torchrun with kills"], code = torchrun_soak(
        mode, base, plan, a.ckpt_every, out
    )
    faulty = [out / f"{mode}_ft" / f"g{g}" for g in range(GROUPS)]
    finished = all((d / "final_model.pt").is_file() for d in faulty)
    missing = (False, float("inf"), float("inf"))
    tokens = [metrics(d).get("train/tokens_seen") for d in faulty]
    tokens += [metrics(out / f"{mode}_ft_clean" / "g0").get("train/tokens_seen")]
    tokens += [metrics(out / f"{mode}_one").get("train/tokens_seen")]
    return ModeResult(
        mode,
        rows,
        torchrun,
        code,
        finished and compare(faulty[0], faulty[1])[0],
        compare(faulty[0], out / f"{mode}_ft_clean" / "g0") if finished else missing,
        compare(faulty[0], out / f"{mode}_one") if finished else missing,
        compare(out / f"{mode}_ft_clean" / "g0", out / f"{mode}_one"),
        tokens,
        len(lives),
        walls,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kills", type=int, default=10, help="kills per mode (default 10)")
    p.add_argument("--modes", default="ddp,fsdp")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, help="train.steps (default: from --kills and --gap)")
    p.add_argument("--gap", type=int, default=2500, help="fewest steps between two kills")
    p.add_argument("--first", type=int, default=40, help="the earliest kill step")
    p.add_argument("--ckpt-every", type=int, default=20, help="torchrun's ckpt.every")
    p.add_argument("--tick-ms", type=int, default=20, help="the Lighthouse's quorum tick")
    p.add_argument("--timeout-s", type=float, default=1200, help="one ft run's wall limit")
    p.add_argument("--overhead-reps", type=int, default=3, help="0: no overhead runs")
    p.add_argument("--overhead-steps", default="1000,40", help="small,big model steps")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "chaos_ft")
    a = p.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    t_all = time.monotonic()
    if a.steps is None:  # the kills in 70% of the run, a quarter of the gap drawn
        a.steps = math.ceil((a.first + a.kills * a.gap * 1.25) / 0.7 / 100) * 100
    plan = kill_plan(a.seed, a.kills, a.steps, a.gap, a.first)
    results = []
    for mode in a.modes.split(","):
        results.append(run_mode(mode, a, plan))
        print(f"{mode}: {results[-1]}", flush=True)
    over = []
    if a.overhead_reps:
        small_steps, big_steps = (int(x) for x in a.overhead_steps.split(","))
        for name, base, steps in (
            ("small GPT", SMALL, small_steps),
            ("bigger GPT", BIG, big_steps),
        ):
            key = name.split()[0]
            over.append((name, *overhead(key, base, steps, a.overhead_reps, a.tick_ms, a.out)))
    head = f"Soak wall time {(time.monotonic() - t_all) / 60:.1f} min."
    text = report(results, over, a, head)
    (a.out / "chaos_ft.md").write_text(text)
    print(text)
    bad = [line for r in results for line in r.failures()]
    for line in bad:
        print(f"error: {line}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
