"""DiLoCo and local SGD across replica groups (ft.semi_sync; [Note: DiLoCo across replica
groups] in trainer/comm/diloco.py): real processes, one job per group, joined through a
Lighthouse in this process. Each run is held against `simulate`, a plain one-process
simulation of the groups (the same initial model, each group's data slots, torch's SGD
inside and outside), or against the per-step sync where the two are the same."""

from __future__ import annotations

import copy
import json
import signal
from pathlib import Path

import pytest
import torch
from ft_harness import Lighthouse, final_model, finished, fresh_then_back, start_group

torchft = pytest.importorskip("torchft", reason="torchft is in make install's extras")
ROOT = Path(__file__).resolve().parents[1]

# Inner SGD without momentum (the exactness case) or with it (state a heal carries).
BASE = [
    "model=mlp", "data=synthetic", "optim=sgd", "optim.lr=0.05", "train.steps=12",
    "train.log_every=4", "train.batch_size=64", "ckpt.every=0", "train.eval_every=0",
]  # fmt: skip
FT = ["ft.enabled=true", "ft.replica_groups=2", "ft.timeout_s=10", "ft.heartbeat_ms=50"]


def _compose(overrides: list[str]):
    from hydra import compose, initialize_config_dir

    from trainer.config import schema  # noqa: F401  (registers the types)

    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides)


def simulate(
    overrides: list[str],
    groups: int = 2,
    sync: int = 4,
    fragments: int = 1,
    delay: int = 0,
    alpha: float = 0.0,
    outer: tuple[float, float] = (0.7, 0.9),
    wire: str = "fp32",
    last_step_of: dict[int, int] | None = None,
    last_sync_of: dict[int, int] | None = None,
    heals: dict[int, int] | None = None,
    ranks: int = 1,
) -> dict[str, torch.Tensor]:
    """The final model of `groups` groups of one rank training DiLoCo on one process:
    [Note: the fragment schedule], each group's slot g of every step's global batch,
    weights by slots trained. `last_step_of[g]`: group g trains no step after that one
    (and takes part in no sync after `last_sync_of[g]`, by default that step); the
    groups left take its slots from the next quorum on, as trainer/comm/replicas.py's
    `slots_of` deals them. `heals[g] = s`: g joins again at the sync sent after step s,
    sending nothing, with group 0's inner state and the global copy. `ranks`: P ranks a
    group, slot g P + r rank r's: a group's step is the mean over its P slots (clipped
    to optim.clip_grad_norm as one process clips)."""
    from trainer.comm import quantized
    from trainer.comm.diloco import BLOCK, fragments_of
    from trainer.comm.replicas import slots_of
    from trainer.data.datasets import make_loader
    from trainer.models.build import model_and_data
    from trainer.models.loss import loss_fn
    from trainer.models.materialize import SeededInit, empty_weights, materialize

    cfg = _compose(overrides)
    with empty_weights():
        model, dataset, _ = model_and_data(cfg, ("m", "d"))
    materialize(model, SeededInit(cfg.seed), "cpu")
    frag = fragments_of(model, fragments)
    names = [n for n, _ in model.named_parameters()]
    models = [copy.deepcopy(model) for _ in range(groups)]
    inner = [
        torch.optim.SGD(m.parameters(), lr=cfg.optim.lr, momentum=cfg.optim.get("momentum", 0))
        for m in models
    ]
    glob = {n: p.detach().clone() for n, p in model.named_parameters()}
    lr, momentum = outer
    outer_opt = {
        f: torch.optim.SGD(
            [glob[n] for n in names if frag[n] == f],
            lr=lr,
            momentum=momentum,
            nesterov=momentum > 0,
        )  # fmt: skip
        for f in range(fragments)
    }
    errors = {(g, n): torch.zeros_like(glob[n]) for g in range(groups) for n in names}
    loaders = [iter(make_loader(dataset, cfg.train.batch_size, s, groups * ranks, cfg.seed))
               for s in range(groups * ranks)]  # fmt: skip
    clip = cfg.optim.get("clip_grad_norm") or 0
    last, heals = last_step_of or {}, heals or {}
    last_sync = {**last, **(last_sync_of or {})}
    alive = list(range(groups))  # at the last quorum
    dealt = {g: slots_of(g, alive, groups) for g in alive}
    trained = {(g, f): 0 for g in range(groups) for f in range(fragments)}
    per, steps = sync // fragments, cfg.train.steps
    in_flight = None
    params = [dict(m.named_parameters()) for m in models]

    def send(f: int, step: int, due: int):
        nonlocal alive, dealt
        joining = [g for g, at in heals.items() if at == step]
        for g in joining:  # the heal: group 0's inner state, the global copy, nothing sent
            last[g] = last_sync[g] = steps
            inner[g].load_state_dict(copy.deepcopy(inner[0].state_dict()))
            for n in names:
                with torch.no_grad():
                    params[g][n].copy_(glob[n])
            for k in range(fragments):
                trained[g, k] = 0
        present = [g for g in range(groups) if last_sync.get(g, steps) >= step]
        alive = present
        dealt = {g: slots_of(g, alive, groups) for g in alive}
        sums, total = {n: torch.zeros_like(glob[n]) for n in names if frag[n] == f}, 0.0
        for g in present:
            w = float(trained[g, f])
            trained[g, f] = 0
            for n in sums:
                delta = glob[n] - params[g][n].detach()
                if wire == "int8":  # error feedback, per group and tensor, as the run
                    x = (delta + errors[g, n]).reshape(1, -1)
                    q, scale = quantized.quantize(x, BLOCK)
                    sent = quantized.dequantize(q, scale, x.shape[1])
                    errors[g, n] = (x - sent).view_as(delta)
                    delta = sent.view_as(delta)
                sums[n] += w * delta
            total += w
        return f, due, sums, total

    def apply(sync_, a: float) -> None:
        f, _, sums, total = sync_
        for n in sums:
            glob[n].grad = sums[n] / total
        outer_opt[f].step()
        for n in sums:
            glob[n].grad = None
            for g in alive:
                with torch.no_grad():
                    params[g][n].copy_(
                        glob[n] if a == 0 else torch.lerp(params[g][n], glob[n], 1 - a)
                    )

    for step in range(1, steps + 1):
        batch = [next(it) for it in loaders]  # every slot's batch of this step
        for g in range(groups):
            if g not in alive or last.get(g, steps) < step:
                continue
            slots = [s * ranks + r for s in dealt[g] for r in range(ranks)]
            for s in slots:
                x, y = batch[s]
                (loss_fn(models[g](x), y) / len(slots)).backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(models[g].parameters(), clip)
            inner[g].step()
            inner[g].zero_grad(set_to_none=True)
            for f in range(fragments):
                trained[g, f] += len(dealt[g])
        k, rest = divmod(step + delay, per)
        if rest == 0 and k >= 1:
            in_flight = send((k - 1) % fragments, step, step + delay)
        applied = set()
        if in_flight is not None and in_flight[1] <= step:
            apply(in_flight, alpha)
            applied.add(in_flight[0])
            in_flight = None
        if step == steps:
            for f in range(fragments):
                if f not in applied:
                    apply(send(f, step, step), 0.0)
                elif alpha:
                    for g in alive:
                        for n in names:
                            if frag[n] == f:
                                with torch.no_grad():
                                    params[g][n].copy_(glob[n])
    return {n: glob[n] for n in names}


def _same_as(want: dict, got: dict, what: str) -> float:
    """`got` equals `want` up to the order of fp32 sums: each group's inner steps are the
    same float operations as the simulation's (one rank: its gradient is its slot's, no
    reduction); the outer AllReduce adds two groups' w Δ in one order or the other (a + b
    is commutative in IEEE arithmetic, so bitwise the same), and the flat buffers the
    run reduces are the simulation's tensors laid end to end. What differs is where a
    step sums over a batch (ddp's bucket view against the module's own .grad): a few
    ulps per step, carried through 12 SGD steps of lr 0.05 and at most three outer steps
    of lr <= 1, well under 1e-5 relative. Returns the largest absolute difference."""
    worst = 0.0
    for k, w in want.items():
        torch.testing.assert_close(got[k], w, rtol=1e-5, atol=1e-6, msg=f"{what}: {k}")
        worst = max(worst, (got[k] - w).abs().max().item())
    print(f"{what}: max |diff| to the simulation {worst:.2e}")
    return worst


def _equal(a: dict, b: dict) -> None:
    for k in a:
        assert torch.equal(a[k], b[k]), k


def _two_groups(tmp: Path, lh: Lighthouse, args: list[str], env1=None, timeout=120):
    ps = [start_group(tmp, lh.address, g, [*BASE, *FT, *args], env=env1 if g else None)
          for g in (0, 1)]  # fmt: skip
    return ps, [finished(p, timeout) for p in ps]


def test_fragments_are_the_units_dealt_strided():
    from trainer.comm.diloco import fragments_of
    from trainer.errors import ConfigError
    from trainer.models.builtin import GPT

    model = GPT(vocab_size=16, block_size=8, n_layer=4, n_head=2, n_embd=8)
    where = fragments_of(model, 2)  # units: the 4 blocks (units.py's default classes)
    assert where["blocks.0.attn.c_attn.weight"] == 0
    assert where["blocks.1.attn.c_attn.weight"] == 1
    assert where["blocks.2.mlp.c_fc.weight"] == 0
    assert where["blocks.3.mlp.c_fc.bias"] == 1
    assert where["wte.weight"] == where["ln_f.weight"] == 0  # the root's: with fragment 0
    assert set(fragments_of(model, 1).values()) == {0}
    with pytest.raises(ConfigError, match=r"ft.fragments=5: the model has 4 unit"):
        fragments_of(model, 5)


def test_h1_with_plain_sgd_is_the_per_step_sync(tmp_path, lighthouse):
    """Inner SGD without momentum, H = 1, outer lr 1, no momentum: each sync's mean Δ is
    lr times the mean gradient, the per-step sync's update, so the run ends where one
    process on the whole global batch does."""
    import sys

    from warm_cli import command

    d = tmp_path / "one"
    r = command([sys.executable, "train.py", *BASE, f"hydra.run.dir={d}"], timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    lh = lighthouse()
    args = ["ft.semi_sync=diloco", "ft.sync_steps=1", "ft.outer_lr=1", "ft.outer_momentum=0"]
    ps, logs = _two_groups(tmp_path, lh, args)
    for p, log in zip(ps, logs, strict=True):
        assert p.returncode == 0, log[-3000:]
    a, b = final_model(tmp_path / "g0"), final_model(tmp_path / "g1")
    _equal(a, b)
    _same_as(final_model(d), a, "H=1 against one process")


@pytest.mark.parametrize(
    "args,sim",
    [
        (["optim.momentum=0.9", "train.eval_every=6", "train.eval_batches=2"], {}),
        (["ft.semi_sync=local_sgd"], {"outer": (1.0, 0.0)}),
        (["ft.pseudo_grad_dtype=int8", "optim.momentum=0.9"], {"wire": "int8"}),
    ],
    ids=["diloco", "local_sgd", "int8"],
)
def test_groups_end_where_the_simulation_does(tmp_path, lighthouse, args, sim):
    """H = 4 over 12 steps: three syncs, Nesterov momentum carried between them (diloco,
    with an evaluation of the global copy mid-round, the local copy back after it),
    plain averaging (local_sgd), int8 pseudo-gradients whose rounding error is fed into
    the next sync (int8: the simulation quantizes the same way; without error feedback
    the run differs from it)."""
    lh = lighthouse()
    semi = [a for a in args if a.startswith("ft.semi_sync")] or ["ft.semi_sync=diloco"]
    ps, logs = _two_groups(tmp_path, lh, [*semi, "ft.sync_steps=4", *args])
    for p, log in zip(ps, logs, strict=True):
        assert p.returncode == 0, log[-3000:]
    a, b = final_model(tmp_path / "g0"), final_model(tmp_path / "g1")
    _equal(a, b)
    overrides = [*BASE, *[x for x in args if x.startswith("optim.")]]
    if "train.eval_every=6" in args:  # the global copy evaluated at step 6, by its loss
        assert "eval/loss" in (tmp_path / "g0" / "final_metrics.json").read_text()
    _same_as(simulate(overrides, **sim), a, f"{args} against the simulation")


def test_a_group_killed_mid_round_costs_the_other_nothing(tmp_path, lighthouse):
    """Group 1 dies after step 6, mid-round: group 0 finishes the round alone, its sync
    at step 8 is its own Δ, and it takes group 1's slots from that quorum on; no inner
    step of group 0 is lost (it ends where the simulation of exactly that does)."""
    lh = lighthouse(min_replicas=1)
    args = ["ft.semi_sync=diloco", "ft.sync_steps=4", "optim.momentum=0.9"]
    ps, logs = _two_groups(tmp_path, lh, args, env1={"SHARDTRAIN_FAULT": "0:6:kill"})
    assert ps[1].returncode == -signal.SIGKILL, logs[1][-2000:]
    assert ps[0].returncode == 0, logs[0][-3000:]
    assert "1 of 2 replica groups [0]; takes the slots of group(s) [1]" in logs[0]
    want = simulate([*BASE, "optim.momentum=0.9"], last_step_of={1: 6})
    _same_as(want, final_model(tmp_path / "g0"), "group 1 dead after step 6")


def test_streamed_fragments_with_a_delay_and_a_mix(tmp_path, lighthouse):
    """A GPT of 4 blocks in F = 2 fragments (blocks 0, 2 and the root; blocks 1, 3), H = 4:
    a sync every 2 steps, each sent one step before it is applied (tau = 1), the local
    copy mixed half and half with the global one (alpha = 0.5), 12 steps: the last one
    syncs both fragments and every group takes the global copy."""
    gpt = ["model=gpt", "data=tokens", "model.n_layer=4", "model.n_embd=32",
           "optim.momentum=0.9"]  # fmt: skip
    args = ["ft.semi_sync=diloco", "ft.sync_steps=4", "ft.fragments=2",
            "ft.fragment_sync_delay=1", "ft.fragment_update_alpha=0.5"]  # fmt: skip
    lh = lighthouse()
    ps, logs = _two_groups(tmp_path, lh, [*gpt, *args])
    for p, log in zip(ps, logs, strict=True):
        assert p.returncode == 0, log[-3000:]
    a, b = final_model(tmp_path / "g0"), final_model(tmp_path / "g1")
    _equal(a, b)
    want = simulate([*BASE, *gpt], fragments=2, delay=1, alpha=0.5)
    _same_as(want, a, "F=2, tau=1, alpha=0.5")


def test_a_group_killed_inside_a_sync_costs_the_other_nothing(tmp_path, lighthouse):
    """Group 1 dies once its pseudo-gradient of step 4 is on its way: group 0's AllReduce
    either got it (and commits with it) or fails and is sent again with group 0 alone;
    either way no inner step is lost, and group 0 takes group 1's slots from then on."""
    lh = lighthouse(min_replicas=1)
    args = ["ft.semi_sync=diloco", "ft.sync_steps=4", "optim.momentum=0.9"]
    ps, logs = _two_groups(tmp_path, lh, args, env1={"SHARDTRAIN_FAULT": "0:4:kill_in_sync"})
    assert ps[1].returncode == -signal.SIGKILL, logs[1][-2000:]
    assert ps[0].returncode == 0, logs[0][-3000:]
    got = final_model(tmp_path / "g0")
    outcomes = {}
    for counted in (4, 3):  # group 1's Δ in the sync of step 4, or not
        want = simulate([*BASE, "optim.momentum=0.9"], last_step_of={1: 4},
                        last_sync_of={1: counted})  # fmt: skip
        outcomes[counted] = max((got[k] - w).abs().max().item() for k, w in want.items())
        if all(torch.allclose(got[k], w, rtol=1e-5, atol=1e-6) for k, w in want.items()):
            return
    pytest.fail(f"group 0 ends at neither outcome: max |diff| {outcomes}")


def test_a_group_back_mid_run_heals_with_the_outer_state(tmp_path, lighthouse):
    """min_groups=2: group 1 dies after step 6 and comes back as a new process; group 0
    waits at its sync of step 8, where group 1 heals from it (its step, inner state, the
    global copy and the outer momentum), sends nothing it has not trained, and both go
    on: bitwise equal at the end, where the simulation of exactly that ends."""
    lh = lighthouse(min_replicas=1)
    args = ["ft.semi_sync=diloco", "ft.sync_steps=4", "optim.momentum=0.9", "ft.min_groups=2"]
    g0 = start_group(tmp_path, lh.address, 0, [*BASE, *FT, *args])
    g1 = start_group(tmp_path, lh.address, 1, [*BASE, *FT, *args],
                     env={"SHARDTRAIN_FAULT": "0:6:kill"})  # fmt: skip
    log1 = finished(g1)
    assert g1.returncode == -signal.SIGKILL, log1[-2000:]
    assert g0.poll() is None  # waiting at its sync for a second group, not restarted
    again = start_group(tmp_path, lh.address, 1, [*BASE, *FT, *args])
    log1, log0 = finished(again), finished(g0)
    assert again.returncode == 0, log1[-3000:]
    assert g0.returncode == 0, log0[-3000:]
    assert "group 1: healed from a live peer at step 8" in log1, log1[-2000:]
    a, b = final_model(tmp_path / "g0"), final_model(tmp_path / "g1")
    _equal(a, b)
    want = simulate([*BASE, "optim.momentum=0.9"], last_step_of={1: 6}, heals={1: 8})
    _same_as(want, a, "group 1 healed at step 8")


@pytest.mark.slow
def test_a_group_started_afresh_never_overwrites_the_runs_global_copy(tmp_path, lighthouse):
    """[Note: a group's origin] in trainer/comm/replicas.py. Both groups killed after step
    5 (group 0's checkpoint of step 4, the sync of step 4 in it). Group 1 comes back first,
    with no checkpoint: it starts afresh, takes its own outer steps on its own global copy
    alone, and pauses after step 8. Group 0 comes back from step 4. torchft would heal
    group 0 from group 1 (the higher step): the run's global copy and outer momentum
    replaced by one group's fresh rounds. Instead group 1 drops its steps and heals from
    group 0, and both end bitwise where the uninterrupted run ends. (Inner SGD without
    momentum: the global copy and the outer momentum are all of a group's state after a
    sync, so the checkpoint of the lowest group holds every group's; with inner momentum,
    group 1's own would be lost with its process.)"""
    lh = lighthouse(min_replicas=1)
    args = [*BASE, *FT, "ft.semi_sync=diloco", "ft.sync_steps=2", "optim.momentum=0",
            "ckpt.every=4"]  # fmt: skip
    whole = [start_group(tmp_path / "whole", lh.address, g, args) for g in (0, 1)]
    for p in whole:
        log = finished(p)
        assert p.returncode == 0, log[-3000:]
    kill = {"SHARDTRAIN_FAULT": "0:5:kill"}
    down = [start_group(tmp_path, lh.address, g, args, env=kill) for g in (0, 1)]
    for p in down:
        log = finished(p)
        assert p.returncode == -signal.SIGKILL, log[-3000:]
    assert (tmp_path / "g0" / "checkpoints" / "step_000004" / "COMPLETE").exists()
    assert not list((tmp_path / "g1").glob("checkpoints/step_*"))
    fresh_then_back(tmp_path, lh.address, args, resumed_at=4, dropped=10)
    a, b = final_model(tmp_path / "g0"), final_model(tmp_path / "g1")
    _equal(a, b)
    _equal(final_model(tmp_path / "whole" / "g0"), a)


# inner momentum 0: torch's SGD keeps no state of its own, the outer tensors are all of it;
# int8: the error feedback too (a resumed run's first lossy sync once failed on it), with
# a delay of 3: the checkpoint of step 5 is written while the sync sent after step 5 is
# in flight (due after step 8), so the resumed group sends it again
@pytest.mark.parametrize(
    "momentum, wire, delay", [(0.9, "fp32", 0), (0.0, "fp32", 0), (0.9, "int8", 3)]
)
def test_a_checkpoint_holds_the_global_copy_and_the_outer_state(
    tmp_path, lighthouse, momentum, wire, delay
):
    """One group, killed after step 6 mid-round (checkpoint of step 5) and resumed: the
    global copy, the outer momentum (the error feedback, the sync in flight) and the
    round's position come back with the checkpoint, so the run ends bitwise where the
    uninterrupted one does."""
    lh = lighthouse(min_replicas=1)
    args = [*BASE, "ft.enabled=true", "ft.replica_groups=1", "ft.heartbeat_ms=50", "ckpt.every=5",
            "ft.semi_sync=diloco", "ft.sync_steps=4", f"optim.momentum={momentum}",
            f"ft.pseudo_grad_dtype={wire}", f"ft.fragment_sync_delay={delay}"]  # fmt: skip
    whole = start_group(tmp_path / "whole", lh.address, 0, args)
    assert finished(whole) and whole.returncode == 0
    cut = start_group(tmp_path / "cut", lh.address, 0, args, env={"SHARDTRAIN_FAULT": "0:6:kill"})
    finished(cut)
    assert cut.returncode == -signal.SIGKILL
    resumed = start_group(tmp_path / "cut", lh.address, 0, [*args, "resume=auto"])
    log = finished(resumed)
    assert resumed.returncode == 0, log[-3000:]
    _equal(final_model(tmp_path / "whole" / "g0"), final_model(tmp_path / "cut" / "g0"))


@pytest.mark.parametrize(
    "overrides, line",
    [
        (["ft.semi_sync=sometimes"], "ft.semi_sync=sometimes is not one of null (every step), lo"),
        (["ft.sync_steps=0"], "ft.sync_steps=0 must be a whole number >= 1"),
        (["ft.sync_steps=10", "ft.fragments=4"], "ft.sync_steps=10 is not a multiple of ft.fr"),
        (["ft.sync_steps=8", "ft.fragments=4", "ft.fragment_sync_delay=2"],
         "ft.fragment_sync_delay=2 must be below ft.sync_steps / ft.fragments = 2"),
        (["ft.fragment_update_alpha=1.5"], "ft.fragment_update_alpha=1.5 must be in [0, 1]"),
        (["ft.pseudo_grad_dtype=int4"], "ft.pseudo_grad_dtype=int4 is not one of fp32, bf16, i"),
        (["ft.outer_lr=0"], "ft.outer_lr=0 must be a positive number"),
        (["ft.outer_momentum=1"], "ft.outer_momentum=1 must be in [0, 1) (Nesterov)"),
        (["ft.semi_sync=local_sgd", "ft.outer_lr=0.5"],
         "ft.outer_lr=0.5 is diloco's outer step: ft.semi_sync=local_sgd averages"),
    ],
)  # fmt: skip
def test_a_schedule_that_cannot_run_is_refused_in_one_line(overrides, line):
    from trainer.config.checks import validate
    from trainer.errors import ConfigError

    semi = [] if any("semi_sync" in o for o in overrides) else ["ft.semi_sync=diloco"]
    cfg = _compose([*FT, "ft.lighthouse=http://127.0.0.1:1", *semi, *overrides])
    with pytest.raises(ConfigError) as e:
        validate(cfg, 1)
    assert str(e.value).startswith(line), str(e.value)
    assert "\n" not in str(e.value)
    # the neighbours run: the largest delay, both ends of alpha, every wire
    for ok in (["ft.sync_steps=8", "ft.fragments=4", "ft.fragment_sync_delay=1"],
               ["ft.fragment_update_alpha=1"], ["ft.pseudo_grad_dtype=bf16"],
               ["ft.semi_sync=local_sgd"]):  # fmt: skip
        validate(_compose([*FT, "ft.lighthouse=http://127.0.0.1:1", "ft.semi_sync=diloco", *ok]), 1)


@pytest.mark.slow
@pytest.mark.parametrize(
    "mode, model, sim",
    [
        # zero cuts its bucket into contiguous slices: rank 0 holds nothing of fragment 1
        # (block 1), and sends its empty Δ as its peer in the other group does
        ("zero", ["model=gpt", "data=tokens", "model.n_embd=32", "ft.fragments=2",
                  "ft.fragment_sync_delay=1"], {"fragments": 2, "delay": 1}),
        ("fsdp", [], {}),
        # every rank holds the whole model: each sends and steps half of it (and keeps
        # the whole Δ in flight for a checkpoint: [Note: a checkpoint with a sync in flight])
        ("ddp", ["ft.fragment_sync_delay=1"], {"delay": 1}),
        # hybrid sharding, one rank a shard group: the replica group of two splits it
        ("zero", ["mode.shard_group_size=1"], {}),
    ],
    ids=["zero", "fsdp", "ddp", "zero_hybrid"],
)  # fmt: skip
def test_sharded_groups_of_two_ranks(tmp_path, lighthouse, mode, model, sim):
    """Two groups of two ranks (torchrun each), the mode sharding inside a group: each
    rank syncs its own shard across the groups (its Δ, its outer momentum); with gradient
    accumulation and clipping, against the simulation of groups of two slots."""
    lh = lighthouse()
    args = [*BASE, *FT, f"mode={mode}", "optim.momentum=0.9", "train.grad_accum_steps=2",
            "optim.clip_grad_norm=0.5", "ft.semi_sync=diloco", "ft.sync_steps=4",
            *model]  # fmt: skip
    ps = [start_group(tmp_path, lh.address, g, args, nproc=2) for g in (0, 1)]
    logs = [finished(p, 240) for p in ps]
    for p, log in zip(ps, logs, strict=True):
        assert p.returncode == 0, log[-3000:]
    a, b = final_model(tmp_path / "g0"), final_model(tmp_path / "g1")
    _equal(a, b)
    overrides = [*BASE, "optim.momentum=0.9", "optim.clip_grad_norm=0.5",
                 *[m for m in model if not m.startswith(("ft.", "mode."))]]  # fmt: skip
    _same_as(simulate(overrides, ranks=2, **sim), a, f"{mode}: 2 groups of 2 ranks")
    if mode == "ddp" or "mode.shard_group_size=1" in model:  # [Note: a group's ranks split
        # what they all hold]: each rank of the two holding the whole model sent half
        values = sum(t.numel() for t in a.values())
        sent = json.loads((tmp_path / "g0" / "final_metrics.json").read_text())
        per_sync = 4 * -(-values // 2) + 8  # its slice and the weight, 2(N-1)/N = 1
        assert sent["comm/bytes_per_step/ft_across_replica_groups"] == 3 * per_sync / 12
