"""Per-step fault tolerance across replica groups (ft.enabled; [Note: fault-tolerant replica
groups] in trainer/comm/replicas.py): real processes, one per group (two ranks per group
for the sharded heal, under torchrun), joined through a Lighthouse this test process runs
on the loopback address. Every run is held against one process on the whole global batch:
the constant global batch makes each ft run, whatever its faults, that run's update up to
the order of the fp32 sums."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from ft_harness import clean_env as _env
from ft_harness import final_model as _final
from ft_harness import finished as _done
from ft_harness import fresh_then_back, start_group
from warm_cli import command

from trainer.comm.replicas import slots_of

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("RUST_LOG", "warn")  # torchft logs every quorum at INFO
torchft = pytest.importorskip("torchft", reason="torchft is in make install's extras")

# A small job whose optimizer has state (momentum) that a heal must carry.
BASE = [
    "model=mlp", "data=synthetic", "optim=sgd", "optim.momentum=0.9", "optim.lr=0.05",
    "train.steps=12", "train.log_every=4", "train.batch_size=64", "ckpt.every=0",
    "train.eval_every=0",
]  # fmt: skip
FT = ["ft.enabled=true", "ft.replica_groups=2", "ft.timeout_s=10", "ft.heartbeat_ms=50"]
QUIET = {"RUST_LOG": "warn"}  # torchft's own logging: warnings only (ft_harness.clean_env)


def _run(tmp, lh, g, args=(), env=None, nproc=1, restarts=0):
    """Replica group g of this file's job (BASE, FT, then `args`): `python train.py`, or
    torchrun for nproc > 1 (restarting its workers up to `restarts` times)."""
    return start_group(tmp, lh.address, g, [*BASE, *FT, *args], env, nproc, restarts)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, torch.Tensor]:
    """One process on the whole global batch: what every ft run below must end at."""
    d = tmp_path_factory.mktemp("reference")
    r = command([sys.executable, "train.py", *BASE, f"hydra.run.dir={d}"], QUIET, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return _final(d)


def _same_as(reference: dict, got: dict, what: str) -> float:
    """`got` equals `reference` up to the order of the fp32 sums: a step's gradient is the
    same mean of the same 64 samples' gradients, summed in another association (a group's
    two halves before or after the cross-group AllReduce). Each such sum is within
    ~n * 2^-24 relative of the other; 12 SGD steps of lr 0.05 with momentum carry that
    forward without amplifying it past 1e-5 relative here (measured: 2.2e-8 absolute at
    most). Returns the largest absolute difference."""
    worst = 0.0
    for k, want in reference.items():
        torch.testing.assert_close(got[k], want, rtol=1e-5, atol=1e-6, msg=f"{what}: {k}")
        worst = max(worst, (got[k] - want).abs().max().item())
    print(f"{what}: max |diff| to one process {worst:.2e}")  # shown with pytest -s
    return worst


def _equal(a: dict, b: dict) -> None:
    """The groups end bitwise equal: the same reduced gradients, the same state."""
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_missing_groups_are_dealt_to_the_present_ones():
    assert slots_of(0, [0, 1, 2, 3], 4) == (0,)
    assert slots_of(1, [1], 2) == (1, 0)
    # groups 1 and 3 missing: the first present group takes 1, the second takes 3
    assert slots_of(0, [0, 2], 4) == (0, 1)
    assert slots_of(2, [0, 2], 4) == (2, 3)
    # more missing than present: dealt cyclically
    assert slots_of(0, [0, 4], 5) == (0, 1, 3)
    assert slots_of(4, [0, 4], 5) == (4, 2)


@pytest.mark.parametrize("data", ["synthetic", "tokens"])
def test_slot_batches_are_what_the_loader_hands_each_rank(data):
    """SlotBatches.take(step, groups) concatenates what the DataLoader of rank g*P + r
    hands out at that step: the slots of a missing group are exactly its samples."""
    from hydra import compose, initialize_config_dir

    from trainer.config import schema  # noqa: F401  (registers the types)
    from trainer.data.datasets import SlotBatches, make_loader
    from trainer.models.build import model_and_data

    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", [f"data={data}", "model=gpt" if data == "tokens" else "model=mlp"])
    _, dataset, _ = model_and_data(cfg, ("m", "d"))
    groups, per_group, batch = 3, 2, 24
    loaders = [make_loader(dataset, batch, s, groups * per_group, 0) for s in range(6)]
    handed = [[next(it) for _ in range(5)] for it in map(iter, loaders)]  # steps 1..5
    for r in range(per_group):
        slots = SlotBatches(make_loader(dataset, batch, r, groups * per_group, 0), r, per_group)
        for step in (1, 4, 5):
            got = slots.take(step, (2, 0))
            want = [handed[2 * per_group + r][step - 1], handed[0 * per_group + r][step - 1]]
            for i in range(2):
                assert torch.equal(got[i], torch.cat([w[i] for w in want]))


def test_two_groups_end_where_one_process_does(tmp_path, lighthouse, reference):
    lh = lighthouse(min_replicas=2)
    groups = [_run(tmp_path, lh, g) for g in (0, 1)]
    logs = [_done(p) for p in groups]
    for p, log in zip(groups, logs, strict=True):
        assert p.returncode == 0, log[-3000:]
    a, b = _final(tmp_path / "g0"), _final(tmp_path / "g1")
    _equal(a, b)
    _same_as(reference, a, "two groups")


def test_a_group_down_leaves_the_global_batch_whole(tmp_path, lighthouse, reference):
    """Group 1 is killed after step 4 and stays down: group 0 takes its slots from then on,
    and ends where one process on the whole batch does, having seen the same tokens."""
    lh = lighthouse(min_replicas=1)
    g0 = _run(tmp_path, lh, 0)
    g1 = _run(tmp_path, lh, 1, env={"SHARDTRAIN_FAULT": "0:4:kill"})
    log1, log0 = _done(g1), _done(g0)
    assert g1.returncode == -signal.SIGKILL, log1[-2000:]
    assert g0.returncode == 0, log0[-3000:]
    assert "group 0: step 5: 1 of 2 replica groups [0]; takes the slots of group(s) [1]" in log0
    _same_as(reference, _final(tmp_path / "g0"), "one group for the steps after 4")


def test_a_killed_group_heals_from_its_peer_and_the_survivor_never_restarts(
    tmp_path, lighthouse, reference
):
    """min_groups=2: the survivor commits nothing while group 1 is down, group 1 comes
    back as a new process, heals from group 0 (no checkpoint: ckpt.every=0) and both end
    bitwise equal, where one process ends."""
    lh = lighthouse(min_replicas=1)
    args = ["ft.min_groups=2"]
    g0 = _run(tmp_path, lh, 0, args)
    g1 = _run(tmp_path, lh, 1, args, env={"SHARDTRAIN_FAULT": "0:5:kill"})
    log1 = _done(g1)
    assert g1.returncode == -signal.SIGKILL, log1[-2000:]
    assert g0.poll() is None  # waiting for a second group, not restarted
    again = _run(tmp_path, lh, 1, args)
    log1, log0 = _done(again), _done(g0)
    assert again.returncode == 0, log1[-3000:]
    assert g0.returncode == 0, log0[-3000:]
    assert "group 1: healed from a live peer at step 5" in log1, log1[-2000:]
    assert not list((tmp_path / "g1").glob("checkpoints/step_*")), "healed without a checkpoint"
    a, b = _final(tmp_path / "g0"), _final(tmp_path / "g1")
    _equal(a, b)
    _same_as(reference, a, "killed and healed")


@pytest.mark.parametrize("where", ["both", "one"])
def test_a_step_that_does_not_commit_is_redone(tmp_path, lighthouse, reference, where):
    """Step 6's commit fails in both groups (both redo it) or in group 1 alone (group 0
    commits; group 1 is behind at the next quorum and heals): never half-applied."""
    lh = lighthouse(min_replicas=2)

    def fault(g: int) -> dict[str, str] | None:  # fires once in each group given one
        once = {"SHARDTRAIN_FAULT_ONCE": str(tmp_path / f"once{g}")}
        return {"SHARDTRAIN_FAULT": "0:6:nocommit", **once} if g == 1 or where == "both" else None

    groups = [_run(tmp_path, lh, g, env=fault(g)) for g in (0, 1)]
    logs = [_done(p) for p in groups]
    for p, log in zip(groups, logs, strict=True):
        assert p.returncode == 0, log[-3000:]
    assert "group 1: step 6 did not commit (RuntimeError: SHARDTRAIN_FAULT" in logs[1]
    if where == "one":
        assert "group 1: healed from a live peer at step 6" in logs[1], logs[1][-2000:]
    a, b = _final(tmp_path / "g0"), _final(tmp_path / "g1")
    _equal(a, b)
    _same_as(reference, a, f"no commit in {where}")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["fsdp", "zero"])
def test_a_sharded_group_heals_shard_by_shard(tmp_path, lighthouse, reference, mode):
    """Two groups of two ranks: rank r of the restarted group takes rank r's shard (its
    slice of the parameters and of the optimizer state) from rank r of the live one.
    fsdp: the group is launched again; zero: its own torchrun restarts its workers
    (`--max-restarts`, its store kept from the attempt that died)."""
    lh = lighthouse(min_replicas=1)
    args = [f"mode={mode}", "ft.min_groups=2"]
    g0 = _run(tmp_path, lh, 0, args, nproc=2)
    fault = {"SHARDTRAIN_FAULT": "1:5:kill", "SHARDTRAIN_FAULT_ONCE": str(tmp_path / "once")}
    if mode == "zero":
        again = _run(tmp_path, lh, 1, args, env=fault, nproc=2, restarts=1)
    else:
        g1 = _run(tmp_path, lh, 1, args, env=fault, nproc=2)
        log1 = _done(g1)
        assert g1.returncode != 0, log1[-2000:]
        # its rank 0, waiting for rank 1 in the quorum, ended on torchrun's SIGTERM at once
        # ([Note: a group torn down while it waits]), not on its SIGKILL 30 s later
        assert "error: ft: group 1 rank 0: SIGTERM while waiting" in log1, log1[-3000:]
        again = _run(tmp_path, lh, 1, args, nproc=2)
    log1, log0 = _done(again), _done(g0)
    assert again.returncode == 0, log1[-3000:]
    assert g0.returncode == 0, log0[-3000:]
    assert "group 1: healed from a live peer at step 5" in log1, log1[-2000:]
    a, b = _final(tmp_path / "g0"), _final(tmp_path / "g1")
    _equal(a, b)
    _same_as(reference, a, f"{mode}, healed shard by shard")


@pytest.fixture(scope="module")
def stalled(tmp_path_factory) -> SimpleNamespace:
    """min_groups=2 and group 1 killed after step 5, gone for good: group 0 stops after
    ft.stall_timeout_s with a checkpoint of its last step. (Its run directory `dir / g0`,
    its exit code and log.)"""
    from ft_harness import Lighthouse

    d = tmp_path_factory.mktemp("stalled")
    lh = Lighthouse(min_replicas=1)
    try:
        args = ["ft.min_groups=2", "ft.stall_timeout_s=3"]
        g0 = _run(d, lh, 0, args)
        g1 = _run(d, lh, 1, args, env={"SHARDTRAIN_FAULT": "0:5:kill"})
        _done(g1)
        log0 = _done(g0)
    finally:
        lh.close()
    return SimpleNamespace(dir=d, code=g0.returncode, log=log0)


def test_too_few_groups_for_too_long_stops_with_a_checkpoint_a_plain_run_resumes(
    tmp_path, stalled, reference
):
    """min_groups=2 and group 1 gone for good: group 0 stops after ft.stall_timeout_s with
    a checkpoint of its last step, which a run without ft resumes as any checkpoint, to
    the end one process reaches."""
    log0 = stalled.log
    assert stalled.code == 1, log0[-3000:]
    assert "error: ft: 1 of 2 replica groups alive for" in log0, log0[-2000:]
    assert "longer than ft.stall_timeout_s=3 (ft.min_groups=2): stopping" in log0
    saved = stalled.dir / "g0" / "checkpoints" / "step_000005"
    assert (saved / "COMPLETE").exists(), log0[-2000:]
    r = command(
        [sys.executable, "train.py", *BASE, f"resume={saved}", f"hydra.run.dir={tmp_path}/plain"],
        QUIET, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    _same_as(reference, _final(tmp_path / "plain"), "ft checkpoint resumed without ft")


@pytest.mark.slow
def test_a_group_started_afresh_while_the_run_was_down_heals_from_the_runs_checkpoint(
    tmp_path, lighthouse, stalled, reference
):
    """[Note: a group's origin]. Both groups go down: group 1 killed after step 5, group 0
    stopped by the stall with its checkpoint of step 5 (only the lowest group writes them).
    Group 1 comes back first, with no checkpoint: it starts afresh, trains alone to step 8
    and pauses there, in the quorum. Group 0 comes back from the run's checkpoint at step 5.
    torchft heals from the highest step: group 0 would take group 1's 8 steps, which are not
    the run's (with this deterministic job they happen to equal them; after a change of the
    data or the schedule they would not). Instead group 0 keeps its model, group 1 drops its
    steps and heals from group 0 at step 5, and both end where one process does."""
    lh = lighthouse(min_replicas=1)
    assert stalled.code == 1 and "stopping" in stalled.log, stalled.log[-3000:]
    shutil.copytree(stalled.dir / "g0", tmp_path / "g0")  # group 0's run, down at step 5
    assert (tmp_path / "g0" / "checkpoints" / "step_000005" / "COMPLETE").exists()
    fresh_then_back(tmp_path, lh.address, [*BASE, *FT], resumed_at=5, dropped=8)
    a, b = _final(tmp_path / "g0"), _final(tmp_path / "g1")
    _equal(a, b)
    _same_as(reference, a, "a group started afresh, then healed from the run's checkpoint")


def test_a_group_of_another_config_is_refused(tmp_path, lighthouse):
    lh = lighthouse(min_replicas=2)
    groups = [_run(tmp_path, lh, 0), _run(tmp_path, lh, 1, ["seed=1"])]
    logs = [_done(p) for p in groups]
    for p, log in zip(groups, logs, strict=True):
        assert p.returncode == 2, log[-3000:]
        assert "ft: a replica group of another config or run joined the quorum" in log


def test_no_lighthouse_is_one_line(tmp_path):
    r = command(
        [sys.executable, "train.py", *BASE, *FT, "ft.lighthouse=http://127.0.0.1:9",
         "ft.connect_timeout_s=1", f"hydra.run.dir={tmp_path}"],
        QUIET, timeout=120,
    )  # fmt: skip
    assert r.returncode == 2, r.stderr[-2000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "ft.lighthouse=http://127.0.0.1:9: no Lighthouse answers" in lines[0]
    assert "Traceback" not in r.stderr


class LighthouseProcess:
    """torchft's Lighthouse as a process of its own (its `torchft_lighthouse`), on the
    loopback address: SIGKILLed and started again on the same port, as a supervisor
    restarts it."""

    def __init__(self, logs: Path, heartbeat_timeout_ms: int = 500) -> None:
        self.logs, self.port, self.starts = logs, 0, 0
        self.heartbeat_timeout_ms = heartbeat_timeout_ms
        self.proc: subprocess.Popen | None = None
        self.start()
        self.address = f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        """Starts it (on a free port the first time) and returns once it listens: its own
        line says so, not a connection that another process on the port could answer."""
        self.starts += 1
        log = self.logs / f"lighthouse{self.starts}.log"
        argv = [
            str(Path(sys.executable).with_name("torchft_lighthouse")),
            f"--bind=127.0.0.1:{self.port}", "--min_replicas=1", "--join_timeout_ms=10000",
            "--quorum_tick_ms=10", f"--heartbeat_timeout_ms={self.heartbeat_timeout_ms}",
        ]  # fmt: skip
        with open(log, "w") as out:
            self.proc = subprocess.Popen(argv, env={**_env(), "RUST_LOG": "info"}, stdout=out,
                                         stderr=subprocess.STDOUT)  # fmt: skip
        deadline = time.monotonic() + 60
        while not (listening := re.search(r"Lighthouse listening on: \S+:(\d+)", log.read_text())):
            assert self.proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.01)
        self.port = int(listening.group(1))

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.kill()


def _steps_done(log: Path, steps: int) -> int:
    """The last step the group's progress bar shows."""
    done = re.findall(rf"\b(\d+)/{steps} \[", log.read_text(errors="replace"))
    return int(done[-1]) if done else 0


def _gaps(log: str) -> list[float]:
    """The seconds between two committed steps that the group reported (longer than 0.5 s:
    replicas.py names those)."""
    return [float(x) for x in re.findall(r"committed ([\d.]+) s after the last", log)]


def _reconnect_wait(outage: float) -> float:
    """How long after the Lighthouse is back a group's ManagerServer finds it, at most
    ([Note: a Lighthouse outage] in trainer/comm/replicas.py): its tries after a failed
    quorum fall 0.1 s after it, then after waits of 0.1 * 1.5^k s, each with up to 0.1 s
    of jitter (torchft's reconnection backoff). Past an outage of d, the next try is at
    most the wait after the last try that can come before d, plus its jitter."""
    tried, wait = 0.1, 0.1
    while tried + wait <= outage:
        tried, wait = tried + wait, wait * 1.5
    return wait + 0.1


ALLREDUCE_TIMEOUT_S = 5  # ft.timeout_s of the outage test


def test_a_lighthouse_outage_costs_about_its_length(tmp_path):
    """The Lighthouse SIGKILLed while two groups train (every step's quorum goes through it)
    and started again on the same port: both groups go on, no step waits much longer than
    the outage, and they end bitwise equal."""
    steps = 120
    lh = LighthouseProcess(tmp_path)
    try:
        args = [
            f"train.steps={steps}",
            "ft.quorum_timeout_s=20",
            f"ft.timeout_s={ALLREDUCE_TIMEOUT_S}",
        ]
        groups = [_run(tmp_path, lh, g, args) for g in (0, 1)]
        deadline = time.monotonic() + 180
        while min(_steps_done(p.log, steps) for p in groups) < 3:
            if any(p.poll() is not None for p in groups) or time.monotonic() > deadline:
                pytest.fail("\n".join(_done(p, timeout=30)[-2000:] for p in groups))
            time.sleep(0.02)
        lh.kill()
        killed = time.monotonic()
        time.sleep(1.0)  # and its start-up: a Python process importing torch, 1-5 s here
        lh.start()
        outage = time.monotonic() - killed  # until it accepts connections again
        logs = [_done(p, timeout=180) for p in groups]
    finally:
        lh.close()
    for p, log in zip(groups, logs, strict=True):
        assert p.returncode == 0, log[-3000:]
    gaps = [sorted(_gaps(log)) for log in logs]
    longest = max(g[-1] for g in gaps if g)
    assert longest >= outage - 0.1, (outage, gaps)  # the outage fell inside the run
    # Besides the outage, the longest gap holds: the reconnection's last wait; three steps
    # (the one the kill landed in, whose quorum fails or the next one's does; the step
    # after; and for a group later than the first quorum after the outage, which heals
    # at the next one, one more), each at most the slowest other step the run reported
    # (0.5 s if none: faster ones are not reported); and 1 s of process scheduling on the
    # 2 cores the suite shares (two groups and the Lighthouse woken by the reconnection,
    # each wake-up a scheduler slice or more behind the other tests' processes); and, when
    # the kill lands while the Lighthouse hands a quorum out (one group got it, the other
    # not: seen in the suite), one cross-group AllReduce waited out, ft.timeout_s (5 s
    # here). Before the retries it was the whole quorum timeout, 20 s here.
    step = max([0.5] + [x for g in gaps for x in g[:-1]])
    bound = outage + _reconnect_wait(outage) + 3 * step + 1.0 + ALLREDUCE_TIMEOUT_S
    print(f"Lighthouse down {outage:.1f} s: longest gap {longest:.1f} s (bound {bound:.1f} s)")
    assert longest <= bound, (longest, bound, gaps)
    _equal(_final(tmp_path / "g0"), _final(tmp_path / "g1"))


class _TwoGroups:
    """A stand-in for torchft's Manager in one process: its AllReduce adds what the other
    group sends (`theirs`, one tensor per call, in call order; zeros with no other group
    in the quorum, `participants=1`)."""

    def __init__(self, theirs: list[torch.Tensor], participants: int = 2) -> None:
        self.theirs, self.error, self.participants = list(theirs), None, participants

    def allreduce(self, t: torch.Tensor, reduce_op=None):
        t.add_(self.theirs.pop(0).to(t.dtype))

        class Done:
            def wait(self) -> None:
                pass

        return Done()

    def errored(self):
        return self.error

    def num_participants(self) -> int:
        return self.participants


def _replicas(manager: _TwoGroups):
    from trainer.comm.replicas import FaultTolerantReplicas

    r = object.__new__(FaultTolerantReplicas)  # the Manager and Lighthouse left out
    r.groups, r.index, r.manager = 2, 0, manager
    r.teardown = SimpleNamespace(waiting=lambda what: contextlib.nullcontext())
    return r


def _engine(grads: list[torch.Tensor | None]):
    params = [torch.nn.Parameter(torch.zeros(3)) for _ in grads]
    for p, g in zip(params, grads, strict=True):
        p.grad = g
    return SimpleNamespace(
        optimizer=SimpleNamespace(param_groups=[{"params": params}]),
        grad_tensors=lambda: ([g for g in grads if g is not None], False),
    )


def test_reduce_weights_each_group_by_its_slots_and_sums():
    """Group 1 is missing and group 0 took its slot (2 slots of N=2): weighted 2/2, the
    result is group 0's own mean gradient and loss over both slots, and its count."""
    g = torch.tensor([1.0, 2.0, 3.0])
    r = _replicas(_TwoGroups([torch.zeros(3), torch.zeros(2 + 1)], participants=1))
    loss, correct = r.reduce(_engine([g]), torch.tensor(0.5), torch.tensor(7.0), slots=2)
    assert torch.equal(g, torch.tensor([1.0, 2.0, 3.0])) and loss.item() == 0.5
    assert correct.item() == 7.0
    # two groups with one slot each: the mean of the two
    mine, theirs = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([3.0, 2.0, 1.0])
    figures = torch.tensor([0.25 * 0.5, 4.0, 1.0], dtype=torch.float64)  # loss 0.25, 4 right
    r = _replicas(_TwoGroups([theirs * 0.5, figures]))
    loss, correct = r.reduce(_engine([mine]), torch.tensor(0.75), torch.tensor(3.0), slots=1)
    assert torch.equal(mine, torch.tensor([2.0, 2.0, 2.0]))
    assert loss.item() == 0.5 and correct.item() == 7.0


def test_reduce_refuses_a_gradient_some_groups_have_and_others_not():
    from trainer.errors import TrainingError

    # this group has a gradient for tensor 1, the other group (flags 0) does not
    figures = torch.tensor([0.0, 0.0, 1.0, 0.0], dtype=torch.float64)
    r = _replicas(_TwoGroups([torch.zeros(6), figures]))
    with pytest.raises(TrainingError, match=r"1 optimizer tensor\(s\) \(the first #1\) got a"):
        r.reduce(_engine([torch.ones(3), torch.ones(3)]), torch.tensor(1.0), torch.tensor(1.0), 1)
    # a tensor no group gave a gradient (flags 0 everywhere) is no disagreement
    r = _replicas(_TwoGroups([torch.zeros(3), torch.tensor([0.0, 0.0, 1.0, 0.0]).double()]))
    r.reduce(_engine([torch.ones(3), None]), torch.tensor(1.0), torch.tensor(1.0), 1)


def test_a_failed_reduce_changes_no_gradient():
    g = torch.tensor([1.0, 2.0, 3.0])
    manager = _TwoGroups([torch.full((3,), 9.0), torch.zeros(3, dtype=torch.float64)])
    manager.error = RuntimeError("peer died")
    loss, _ = _replicas(manager).reduce(_engine([g]), torch.tensor(0.5), torch.tensor(1.0), 1)
    assert torch.equal(g, torch.tensor([1.0, 2.0, 3.0])) and loss.item() == 0.5


def test_ddp_sends_each_bucket_across_during_backward(tmp_path):
    """[Note: across replica groups during backward]: a ddp engine (one rank, buckets of
    one layer each) chains each bucket's cross-group AllReduce, weighted by slots / N, on
    its own reduction; backward's end has them all, and `reduce` sends only the figures.
    The gradients are the weighted sum, as the after-backward path makes them."""
    import torch.distributed as dist
    from torch import nn

    from trainer.comm.replicas import _Across
    from trainer.parallel.ddp import DDPEngine

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Linear(16, 2))
        x = torch.randn(4, 8)
        model(x).square().mean().backward()  # the reference: this group's own gradients
        mine = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        engine = DDPEngine(model, lambda groups: torch.optim.SGD(groups, lr=0.1), bucket_mb=1e-3)
        assert len(engine.buckets) >= 3
        # the other group's bucket gradients, in the order the buckets are sent
        theirs = [torch.full_like(b.grad, 0.5 * (i + 1)) for i, b in enumerate(engine.buckets)]
        figures = torch.tensor([0.0, 0.0] + [1.0] * 6, dtype=torch.float64)  # every tensor: a grad
        manager = _TwoGroups([*theirs, figures])
        r = _replicas(manager)
        engine.across = _Across(r, weight=0.5)  # one slot of N = 2
        engine(x).square().mean().backward()
        assert engine.sent_across and manager.theirs[0].dtype == torch.float64  # all sent
        r.reduce(engine, torch.tensor(1.0), torch.tensor(0.0), slots=1)
        assert not manager.theirs and engine.across is None and not engine.sent_across
        other = {id(p): t for b, t in zip(engine.buckets, theirs, strict=True)
                 for p, t in zip(b.params, b.layout.views(t), strict=True)}  # fmt: skip
        for p, g in zip(model.parameters(), mine, strict=True):
            # one product and one sum of fp32 values, as the after-backward path: exact
            assert torch.equal(p.grad, g * 0.5 + other[id(p)])
    finally:
        dist.destroy_process_group()


def test_a_lighthouse_gone_for_good_stops_the_run_after_the_stall_budget():
    """A quorum waits at most what is left of ft.stall_timeout_s since the last commit, so a
    Lighthouse that never comes back stops the run then (with a checkpoint, as too few
    groups do), not a whole ft.quorum_timeout_s later."""
    from trainer.comm.replicas import TooFewGroups

    r = _replicas(SimpleNamespace(_quorum_future=None, current_step=lambda: 6))
    r.stall_s, r.quorum_s, r.min_groups, r.lighthouse = 5.0, 60.0, 1, "http://10.0.0.7:29510"
    r.last_commit = time.monotonic() - 3.0  # 2 s of the budget left
    waits = []

    def no_lighthouse(timeout):
        waits.append(timeout.total_seconds())
        r.last_commit -= timeout.total_seconds()  # the wait passes
        raise TimeoutError('status: Cancelled, message: "Timeout expired"')

    r.manager.start_quorum = no_lighthouse
    with pytest.raises(TooFewGroups) as e:
        r.start_step(7)
    assert len(waits) == 1 and 1.9 < waits[0] <= 2.0, waits
    assert str(e.value).startswith(
        "ft: no quorum from the Lighthouse at http://10.0.0.7:29510 (timed out) for 5 s, "
        "longer than ft.stall_timeout_s=5"
    )
