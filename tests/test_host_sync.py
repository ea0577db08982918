"""No host reads of device values in a steady step of any mode and precision, counted two
ways: the reads that go through trainer.observe.host, and the aten ops that can only run by
reading a value back (`_local_scalar_dense` behind `.item()` and `bool()`, `nonzero`).
On a GPU each would stall the CPU until the device catches up. fp16 decides on the
device whether to skip a step; only an optimizer that cannot skip by itself makes the
host read the flag ([Note: dynamic loss scaling] in trainer/parallel/scaling.py)."""

import functools

import pytest
import torch
from dist_harness import run_distributed
from reference import any_loss, batches, make_model, rank_slice
from torch.utils._python_dispatch import TorchDispatchMode

MODES = {
    "ddp": {},
    "zero": {},
    "fsdp": {"min_unit_params": 50, "unit_classes": []},
    "fsdp_keep": {"min_unit_params": 50, "unit_classes": [], "reshard_after_forward": False},
}
SYNCING_OPS = {"_local_scalar_dense", "nonzero", "is_nonzero"}


class CountSyncingOps(TorchDispatchMode):
    """Counts the syncing ops, except reads of the optimizer's step counters: torch keeps
    those on the CPU even when training on a GPU (non-capturable optimizers), so AdamW's
    `step.item()` for its bias correction is no device read."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        super().__init__()
        self.ops: list[str] = []
        self._steps = {id(s["step"]) for s in optimizer.state.values() if "step" in s}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in SYNCING_OPS and not (args and id(args[0]) in self._steps):
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


def _steady_reads(env, cases) -> dict:
    from trainer.observe import host
    from trainer.parallel import build_engine

    out = {}
    for name, kind, precision, clip, *optim in cases:  # optim: AdamW's options, if any
        mode = name.split("_")[0]
        engine = build_engine(
            make_model(kind, seed=0),
            mode,
            functools.partial(torch.optim.AdamW, lr=1e-3, eps=1e-3, **dict(*optim)),
            precision=precision,
            **MODES[name],
        )
        data = batches(kind, 5, 8)

        def step(x, y, engine=engine, clip=clip, precision=precision):
            x, y = rank_slice(x, env.rank, env.world_size), rank_slice(y, env.rank, 2)
            loss = any_loss(engine(x), y)
            engine.backward(loss) if precision == "fp16" else loss.backward()
            if clip:
                engine.clip_grad_norm_(1.0)
            engine.step()

        for x, y in data[:2]:  # warm-up: optimizer state, first-step bookkeeping
            step(x, y)
        with host.counting() as reads, CountSyncingOps(engine.optimizer) as ops:
            for x, y in data[2:]:
                step(x, y)
        out[(name, kind, precision, clip, *optim)] = (reads.count, reads.where, ops.ops)
    return out


CASES = [
    (mode, "mlp", precision, clip)
    for mode in MODES
    for precision in ("fp32", "bf16", "fp16")
    for clip in (False, True)
]
# AdamW with foreach=True has no fused kernel to skip a step: the host decides
HOST_DECIDED = (("foreach", True),)


@pytest.fixture(scope="module")
def reads():
    extra = [(mode, "mlp", "fp16", False, HOST_DECIDED) for mode in MODES]
    extra += [(mode, "unused", "fp32", False) for mode in MODES]
    return run_distributed(_steady_reads, 2, CASES + extra)[0]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_no_host_reads_in_a_steady_step(reads, case):
    count, where, ops = reads[case]
    assert count == 0, where
    assert ops == []


@pytest.mark.parametrize("mode", MODES)
def test_fp16_without_a_fused_optimizer_reads_one_flag_per_step(reads, mode):
    # The fallback: whether to skip must be known on the host, as torch.amp.GradScaler
    # reads it for such optimizers: one read of the found-inf flag per step (3 counted).
    count, where, ops = reads[mode, "mlp", "fp16", False, HOST_DECIDED]
    assert count == 3 and set(where) == {"fp16 found_inf"}
    assert ops == ["_local_scalar_dense"] * 3


@pytest.mark.parametrize("mode", MODES)
def test_a_rank_that_left_a_parameter_unused_reads_the_used_flags(reads, mode):
    # fc_unused takes no part in forward: to know whether another rank used it, this
    # rank reads the reduced used-flags once per step (and a rank that used every
    # parameter would not). Also shows that both counters see reads.
    count, where, ops = reads[mode, "unused", "fp32", False]
    assert count == 3 and set(where) == {"unused parameters"}
    assert ops == ["nonzero"] * 3


def _train_and_count(env, run_dir: str) -> dict[str, tuple[list[str], dict]]:
    """The trainer's own loop, 12 steps, logging every 4: which host reads it makes, in
    fp32 and in fp16 (whose first steps overflow and are skipped, with a warm-up and
    cosine schedule that must not advance on them), and in fp32 with an eval and a
    checkpoint between log points."""
    from pathlib import Path

    from hydra import compose, initialize_config_dir
    from test_cli import ROOT

    from trainer.observe import host
    from trainer.run import loop as trainer_loop

    overrides = [
        "mode=zero",
        "model.hidden=16",
        "model.depth=2",
        "train.steps=12",
        "train.log_every=4",
        "ckpt.every=0",
        "train.save_final=false",
    ]
    fp16 = [
        "precision=fp16",
        "loss_scale.init_scale=1048576",  # 2^20: overflows until halved far enough
        "optim.schedule=cosine",
        "optim.warmup_steps=3",
    ]
    # an eval and a checkpoint at step 6, between log points
    between = ["train.eval_every=6", "train.eval_batches=1", "ckpt.every=6"]
    out = {}
    for name, extra in (("fp32", []), ("fp16", fp16), ("between", between)):
        with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
            cfg = compose("config", overrides=overrides + extra)
        # No Hydra run here: the run directory is the test's.
        trainer_loop.shared_run_dir = lambda env, d=Path(run_dir) / name: d
        with host.counting() as reads:
            final = trainer_loop.train_in_group(cfg, env)
        out[name] = (reads.where, final)
    return out


# The reads and device waits of 12 steps logged every 4: a check before the first step,
# then per interval: the step clock's wait when its first step starts, the check step
# and the clock's wait at the log step ([Note: timing steps] in trainer/observe/metrics.py).
LOOP_READS = ["check step"] + ["step clock", "check step", "step clock"] * 3


def test_the_training_loop_reads_the_device_at_check_steps_only(tmp_path):
    # 12 steps, checks before the first step (a SIGTERM during set-up) and at 4, 8 and 12
    # (log steps; the last step): the non-finite loss and SIGTERM agreement is read
    # there and nowhere else. The step clock waits for the device at the first step of
    # each interval (1, 5, 9) and at each log step, in no other step. fp16 also reads
    # what its checkpoint at the end saves (the steps the schedule took, the loss
    # scaler) and its count of skipped steps for the summary.
    runs = run_distributed(_train_and_count, 2, str(tmp_path))[0]
    # Each checkpoint reads which ranks failed to write their part, once, and whether
    # rank 0's commit failed, once (where a barrier waited for it before).
    saved = ["checkpoint errors", "checkpoint commit"]
    assert runs["fp32"][0] == LOOP_READS + saved
    where, final = runs["fp16"]
    assert where == LOOP_READS + ["lr schedule", "loss scaler", *saved, "loss scaler"]
    assert 0 < final["overflow_steps"] < 12  # some steps were skipped, on the device
    # Step 6 is a check step (a checkpoint) inside the second interval: its check, then
    # the step clock's two waits around the eval and the checkpoint, left out of the
    # step time. At step 12 the clock has stopped: no wait around the last checkpoint.
    at_6 = ["check step", "step clock", *saved, "step clock"]
    between = LOOP_READS[:5] + at_6 + LOOP_READS[5:] + saved
    assert runs["between"][0] == between
