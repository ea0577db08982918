"""Gradient accumulation, clipping, activation checkpointing, weight-decay groups, the lr
schedule, evaluation and throughput figures, in every mode, against one process.

The distributed cases of one world size run in one process group (the `ranks` fixture):
starting processes is the slow part on a small machine.
"""

from __future__ import annotations

import functools
import io
import sys

import pytest
import torch
from dist_harness import run_distributed
from omegaconf import OmegaConf
from reference import (
    IN,
    OPTIMIZERS,
    OUT,
    SEQ,
    VOCAB,
    assert_state_close,
    batches,
    make_model,
    rank_slice,
    train_single,
)
from test_cli import run_cli, scalars
from torch import nn

from trainer.config.checks import validate
from trainer.errors import ConfigError
from trainer.models.builtin import GPT, MLP, SmallCNN
from trainer.run.optim import lr_lambda

MODES = ("ddp", "zero", "fsdp")
STEPS, BATCH, ACCUM = 2, 12, 3
MAX_NORM = 0.05  # well below the models' gradient norms: clipping is active
# Small buckets / units so that each mode spreads the model over several of them.
OPTIONS = {"ddp": {"bucket_mb": 0.002}, "zero": {"bucket_mb": 0.002}, "fsdp": {}}


def _engine(mode: str, model: nn.Module, optim: str = "adamw", **extra):
    from trainer.parallel import build_engine

    return build_engine(model, mode, OPTIMIZERS[optim], **{**OPTIONS[mode], **extra})


# ---------------------------------------------------------------------------------------
# What each rank runs


def _accumulate(env, mode: str) -> dict:
    """The training loop's forward_backward: ACCUM micro-batches per rank and step."""
    from trainer.run.loop import forward_backward

    # SGD: Adam divides by the gradients' magnitude, so it turns the rounding differences
    # of near-zero gradients into full-size steps; SGD keeps parity meaningful.
    engine = _engine(mode, make_model("gpt", seed=env.rank), optim="sgd")
    for x, y in batches("gpt", STEPS, BATCH):
        xr, yr = rank_slice(x, env.rank, env.world_size), rank_slice(y, env.rank, env.world_size)
        forward_backward(engine, xr, yr, ACCUM)
        engine.step()
    return engine.full_state_dict()


def _clip(env, mode: str) -> dict:
    from trainer.models.builtin import loss_fn

    engine = _engine(mode, make_model("gpt_tied", seed=env.rank), optim="sgd")
    (x, y), *_ = batches("gpt_tied", 1, BATCH)
    xr, yr = rank_slice(x, env.rank, env.world_size), rank_slice(y, env.rank, env.world_size)
    engine.backward(loss_fn(engine(xr), yr))
    norm = engine.clip_grad_norm_(MAX_NORM)
    engine.step()
    return {"norm": norm, "state": engine.full_state_dict()}


def _checkpoint_models(flag: bool) -> dict[str, tuple[nn.Module, dict]]:
    """Models with and without activation checkpointing; fsdp options making units of
    their blocks. In `mlp` the checkpointed region (Linear, then ReLU) ends after the unit
    (the Linear): its recomputation comes before the unit's pre-backward hook."""
    torch.manual_seed(0)
    gpt = GPT(vocab_size=VOCAB, block_size=SEQ, n_layer=3, n_head=3, n_embd=15)
    gpt.activation_checkpointing = flag
    torch.manual_seed(0)
    cnn = SmallCNN(in_channels=3, num_classes=OUT, width=4, activation_checkpointing=flag)
    torch.manual_seed(0)
    mlp = MLP(in_dim=IN, hidden=16, depth=3, num_classes=OUT, activation_checkpointing=flag)
    # fsdp: Blocks are units by class, ConvBlocks and hidden Linears by repetition. (By
    # size alone, >= 100 params, the Linears too, but of a ConvBlock only its conv.)
    units = {"min_unit_params": 100}
    return {"gpt": (gpt, {}), "cnn": (cnn, units), "mlp": (mlp, units)}


def _model_batches(name: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if name == "gpt":
        return batches("gpt", STEPS, BATCH)
    g = torch.Generator().manual_seed(5)
    shape = (3, 8, 8) if name == "cnn" else (IN,)
    return [
        (torch.randn(BATCH, *shape, generator=g), torch.randint(0, OUT, (BATCH,), generator=g))
        for _ in range(STEPS)
    ]


def _checkpointing(env, mode: str) -> dict:
    from trainer import comm
    from trainer.models.builtin import loss_fn

    out = {}
    for flag in (False, True):
        for name, (model, fsdp_options) in _checkpoint_models(flag).items():
            engine = _engine(mode, model, **(fsdp_options if mode == "fsdp" else {}))
            traces = []
            for x, y in _model_batches(name):
                with comm.tracing() as trace:
                    xr = rank_slice(x, env.rank, env.world_size)
                    yr = rank_slice(y, env.rank, env.world_size)
                    engine.backward(loss_fn(engine(xr), yr))
                    engine.step()
                traces.append(trace)
            out[name, flag] = {"state": engine.full_state_dict(), "trace": traces[-1]}
    return out


def _evaluate(env, mode: str) -> dict:
    from trainer import comm
    from trainer.data.datasets import make_eval_loader, synthetic_tokens
    from trainer.observe.metrics import evaluate

    engine = _engine(mode, make_model("gpt", seed=env.rank))
    held_out = synthetic_tokens(n=50, block_size=SEQ, vocab_size=VOCAB, train=False)
    loader = make_eval_loader(held_out, 8, env.rank, env.world_size)
    comm.stats.reset()
    values = evaluate(engine, loader, torch.device("cpu"))
    return {
        "values": values,
        "training": engine.module.training,
        "counted": dict(comm.stats.calls),
        "evaluated": len(loader.dataset) * env.world_size,
    }


def _metrics(env) -> dict | None:
    from trainer.observe.metrics import IntervalMetrics

    clock = iter([10.0, 10.5]).__next__  # the interval starts at 10 s and ends at 10.5 s
    m = IntervalMetrics(torch.device("cpu"), flops_per_token=600.0, peak_flops=1e6, clock=clock)
    # 8 sequences of 8 tokens per rank in 0.5 s; the grad norm is the same on every rank
    m.start_step()
    m.add(torch.tensor(1.0), torch.tensor(32.0), 64, samples=8, grad_norm=torch.tensor(2.0))
    return m.reduce()


def _decay_groups(env, mode: str):
    from trainer.models.builtin import loss_fn
    from trainer.parallel import build_engine
    from trainer.run.optim import optimizer_factory, param_options

    model = make_model("gpt", seed=env.rank)
    optim = OmegaConf.create(
        {
            "_target_": "torch.optim.AdamW",
            "_partial_": True,
            "lr": 1e-2,
            "weight_decay": 0.5,
            "eps": 1e-3,  # AdamW's default amplifies rounding noise: see reference.py
            "no_decay_bias_norm": True,
        }
    )
    engine = build_engine(
        model,
        mode,
        optimizer_factory(optim),
        param_options=param_options(optim),
        **OPTIONS[mode],
    )
    for x, y in batches("gpt", STEPS, BATCH):
        xr, yr = rank_slice(x, env.rank, env.world_size), rank_slice(y, env.rank, env.world_size)
        engine.backward(loss_fn(engine(xr), yr))
        engine.step()
    groups = [(g["weight_decay"], len(g["params"])) for g in engine.optimizer.param_groups]
    return {"state": engine.full_state_dict(), "groups": groups}


# ---------------------------------------------------------------------------------------
# A model's hooks ([Note: model hooks] in trainer/models/hooks.py), through the loop itself


class Hooked(MLP):
    """An MLP with every hook. Its extra loss is `knob`, a parameter of its own that
    nothing else uses: knob's gradient is 1 exactly, and only if the loop adds the extra
    loss to the loss it backpropagates. The HUGE_AT-th extra loss is HUGE x knob (its
    gradient, HUGE x the loss scale / 2, overflows fp16: a step skipped on the device),
    the NAN_AT-th is nan (a step the loop skips for a non-finite loss).
    after_step records each flag."""

    last: Hooked | None = None  # the latest built, for the test to read

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.knob = nn.Parameter(torch.zeros(1))
        self.extra_losses = 0  # how often the loop asked for the extra loss
        self.after_steps: list[tuple[int, bool | torch.Tensor]] = []
        Hooked.last = self

    def extra_loss(self) -> torch.Tensor:
        self.extra_losses += 1
        factor = {HOOKED_HUGE_AT: HOOKED_HUGE, HOOKED_NAN_AT: float("nan")}
        # in fp32: HUGE x knob is finite there (the loss is), its fp16 gradient is not
        return factor.get(self.extra_losses, 1.0) * self.knob.float().sum()

    def after_step(self, stepped: bool | torch.Tensor) -> None:  # kept unread: no host sync
        flag = stepped.clone() if isinstance(stepped, torch.Tensor) else stepped
        self.after_steps.append((self.extra_losses, flag))

    def figures(self) -> dict[str, torch.Tensor]:
        return {"hooked/knob": self.knob.detach().sum()}

    def figures_to_log(self, means: dict[str, float]) -> dict[str, float]:
        return {"hooked/knob_x2": 2 * means["hooked/knob"]}


# 6 steps of 2 micro-batches in fp16, loss scale 2^10: knob's scaled gradient is 2^9 per
# micro-batch (the others', below 1 unscaled, stay far from fp16's 65504). Step 2's first
# micro-batch (the 3rd extra loss) is HUGE x knob: its gradient overflows, the step is
# skipped on the device and the scale halved. Step 4's first (the 7th) is nan: the loop
# skips that step. The other four are taken.
HOOKED_HUGE, HOOKED_HUGE_AT, HOOKED_NAN_AT = 1e6, 3, 7
HOOKED_STEPS, HOOKED_ACCUM = 6, 2
HOOKED_TAKEN = [True, False, True, False, True, True]
HOOKED_ARGS = [
    "model._target_=test_training_features.Hooked",
    "model.hidden=16",
    "model.depth=2",
    "train.meta_build=false",  # knob is a parameter of the root, which no init re-runs
    "precision=fp16",
    "loss_scale.init_scale=1024",
    "optim=sgd",
    "optim.lr=0.01",
    f"train.steps={HOOKED_STEPS}",
    f"train.grad_accum_steps={HOOKED_ACCUM}",
    "train.batch_size=8",
    "train.log_every=3",
    "train.eval_every=0",
    "train.on_nonfinite=skip",
    "train.save_final=false",
]


def _hooked(env, run_root: str) -> dict:
    """The trainer's own loop (train_in_group) on Hooked, in fp16 with ddp."""
    from pathlib import Path

    from trainer.run import loop as trainer_loop

    cfg = _cfg(*HOOKED_ARGS)
    shared = trainer_loop.shared_run_dir  # no Hydra run here: the run directory is ours
    trainer_loop.shared_run_dir = lambda env: Path(run_root) / "hooked"
    try:
        final = trainer_loop.train_in_group(cfg, env)
    finally:
        trainer_loop.shared_run_dir = shared
    model = Hooked.last
    flags = [(n, bool(f)) for n, f in model.after_steps]  # read now, after the run
    return {"final": final, "after_steps": flags, "knob": model.knob.detach().clone()}


def _all_features(env, run_root: str) -> dict:
    out = {"hooked": _hooked(env, run_root)}
    for mode in MODES:
        out[mode] = {
            "accumulate": _accumulate(env, mode),
            "clip": _clip(env, mode),
            "checkpointing": _checkpointing(env, mode),
            "evaluate": _evaluate(env, mode),
            "decay": _decay_groups(env, mode),
        }
    out["metrics"] = _metrics(env)
    return out


@pytest.fixture(scope="module", params=[1, 2])
def ranks(request, tmp_path_factory):
    run_root = str(tmp_path_factory.mktemp(f"features_p{request.param}"))
    return request.param, run_distributed(_all_features, request.param, run_root, timeout=300)


# ---------------------------------------------------------------------------------------
# References on one process


@functools.cache
def _big_batch() -> dict:
    return train_single("gpt", "sgd", STEPS, BATCH, accum=1)


@functools.cache
def _clipped() -> tuple[torch.Tensor, dict]:
    model = make_model("gpt_tied", seed=0)
    opt = OPTIMIZERS["sgd"](model.parameters())
    (x, y), *_ = batches("gpt_tied", 1, BATCH)
    nn.functional.cross_entropy(model(x).flatten(0, -2), y.flatten()).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    opt.step()
    return norm, {k: v.detach().clone() for k, v in model.state_dict().items()}


@functools.cache
def _decayed() -> dict:
    model = make_model("gpt", seed=0)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=1e-2,
        weight_decay=0.5,
        eps=1e-3,  # as _decay_groups: the default would turn rounding noise into steps
    )
    for x, y in batches("gpt", STEPS, BATCH):
        nn.functional.cross_entropy(model(x).flatten(0, -2), y.flatten()).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ---------------------------------------------------------------------------------------
# Tests


def test_the_loop_calls_a_models_hooks_once_per_step_with_its_flag(ranks):
    """[Note: model hooks]: the loop adds the model's extra loss to the loss it
    backpropagates, and calls after_step once per step, after that step's micro-batches,
    with the step's flag: fp16's device flag (False on an overflow), False for a step
    skipped for a nan loss. TensorBoard gets figures_to_log of the mean of figures."""
    world, results = ranks
    want = [(HOOKED_ACCUM * (i + 1), taken) for i, taken in enumerate(HOOKED_TAKEN)]
    # knob's steps: SGD with momentum (torch's update, written out) on a gradient of 1
    # exactly (powers of two throughout), on the taken steps only
    knob, buf = torch.zeros(1), torch.ones(1)
    for i in range(sum(HOOKED_TAKEN)):
        buf = buf if i == 0 else buf * 0.9 + 1.0
        knob = knob - 0.01 * buf
    for r in results:
        got = r["hooked"]
        assert got["after_steps"] == want
        assert got["final"]["overflow_steps"] == 1 and got["final"]["skipped_steps"] == 1
        # The module holds fp16 copies of the fp32 masters: within half an fp16 ulp
        # (2^-11 relative) of the master, which the engine's fused SGD may round apart
        # from these few fp32 operations by a few fp32 ulps (~1e-7): one fp16 ulp bounds
        # both.
        torch.testing.assert_close(got["knob"].float(), knob, rtol=2**-10, atol=0)
    final = results[0]["hooked"]["final"]
    assert "hooked/knob" not in final  # what figures_to_log made of it, instead
    assert final["hooked/knob_x2"] == 2 * results[0]["hooked"]["knob"].item()


@pytest.mark.parametrize("mode", MODES)
def test_accumulation_equals_one_big_batch(ranks, mode):
    _, results = ranks
    for r in results:
        assert_state_close(r[mode]["accumulate"], _big_batch())


@pytest.mark.parametrize("mode", MODES)
def test_clip_grad_norm_equals_torch_on_one_process(ranks, mode):
    _, results = ranks
    want_norm, want_state = _clipped()
    assert want_norm > 4 * MAX_NORM  # the clip did something
    for r in results:
        torch.testing.assert_close(r[mode]["clip"]["norm"], want_norm, rtol=1e-5, atol=1e-6)
        assert_state_close(r[mode]["clip"]["state"], want_state)


@pytest.mark.parametrize("mode", MODES)
def test_activation_checkpointing_gives_the_same_parameters(ranks, mode):
    _, results = ranks
    got = results[0][mode]["checkpointing"]
    for name in ("gpt", "cnn", "mlp"):
        # buffers included: BatchNorm statistics are updated once, not again in recompute
        assert_state_close(got[name, True]["state"], got[name, False]["state"], 1e-6, 1e-6)


def _launches(trace):
    return [e for e in trace if e[0].startswith("launch:")]


def test_fsdp_checkpointing_gathers_each_unit_once_in_backward(ranks):
    _, results = ranks
    got = results[0]["fsdp"]["checkpointing"]
    for name in ("gpt", "cnn", "mlp"):
        plain, ckpt = got[name, False]["trace"], got[name, True]["trace"]
        # The recomputation adds no collective: the same launches in the same order.
        assert _launches(ckpt) == _launches(plain), name
        recomputed = {tag for ev, tag in ckpt if ev == "recompute_begin"}
        backward = ckpt[ckpt.index(next(e for e in ckpt if e[0] == "backward_begin")) :]
        gathers = [tag for ev, tag in backward if ev == "launch:all_gather"]
        forward_units = {tag for ev, tag in ckpt if ev == "forward_begin" and tag != "root"}
        assert recomputed == forward_units and recomputed, (name, recomputed)
        # one AllGather per unit in backward (the root stays gathered from forward)
        assert sorted(gathers) == sorted(forward_units), (name, gathers)


@pytest.mark.parametrize("mode", MODES)
def test_evaluation_on_held_out_data(ranks, mode):
    from trainer.data.datasets import synthetic_tokens

    world, results = ranks
    got = results[0][mode]["evaluate"]
    model = make_model("gpt", seed=0).eval()
    held_out = synthetic_tokens(n=50, block_size=SEQ, vocab_size=VOCAB, train=False)
    x, y = held_out.tensors
    n = got["evaluated"]
    assert n == 50 // world * world
    with torch.no_grad():
        logits = model(x[:n])
    loss = nn.functional.cross_entropy(logits.flatten(0, -2), y[:n].flatten())
    acc = (logits.argmax(-1) == y[:n]).float().mean()
    assert got["values"]["eval/loss"] == pytest.approx(loss.item(), rel=1e-5)
    assert got["values"]["eval/accuracy"] == pytest.approx(acc.item(), abs=1e-6)
    assert all(r[mode]["evaluate"]["values"] is None for r in results[1:])  # rank 0 only
    assert got["training"]  # back in training mode
    assert got["counted"] == {}  # not training traffic


@pytest.mark.parametrize("mode", MODES)
def test_no_decay_on_biases_and_norms(ranks, mode):
    _, results = ranks
    for r in results:
        assert_state_close(r[mode]["decay"]["state"], _decayed())
        # two param groups; in zero and fsdp made of flat shards that never mix them
        [(wd0, n0), (wd1, n1)] = r[mode]["decay"]["groups"]
        assert (wd0, wd1) == (0.5, 0.0) and n0 > 0 and n1 > 0


def test_throughput_and_mfu_figures(ranks):
    world, results = ranks
    m = results[0]["metrics"]
    assert m["perf/samples_per_s"] == pytest.approx(8 * world / 0.5)
    assert m["perf/tokens_per_s"] == pytest.approx(64 * world / 0.5)
    assert m["train/grad_norm"] == pytest.approx(2.0)
    # 600 FLOPs per token x tokens/s per device, over a 1e6 FLOP/s peak
    assert m["perf/mfu_pct"] == pytest.approx(100 * 600 * 64 / 0.5 / 1e6)
    assert all(r["metrics"] is None for r in results[1:])


# ---------------------------------------------------------------------------------------
# Peak memory with activation checkpointing, as the memory accounting reads it


def _step_peak(env, flag: bool) -> int:
    """Growth of this process's peak memory (what the memory accounting reports as
    `peak` on CPU) over one training step of a GPT whose activations dominate."""
    import ctypes

    from trainer.models.builtin import loss_fn
    from trainer.observe.memory import peak_bytes

    # glibc raises its mmap threshold after large frees and then keeps freed activations
    # in the heap, so the high-water mark would also hold dead tensors: fix the threshold.
    ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD
    torch.manual_seed(0)
    model = GPT(vocab_size=64, block_size=128, n_layer=6, n_head=4, n_embd=64)
    model.activation_checkpointing = flag
    engine = _engine("ddp", model, optim="sgd")
    g = torch.Generator().manual_seed(0)
    warm, x, y = (torch.randint(0, 64, (b, 128), generator=g) for b in (2, 32, 32))
    engine.backward(loss_fn(engine(warm), warm))  # first-call allocations happen here
    engine.step()
    before = peak_bytes(torch.device("cpu"))
    engine.backward(loss_fn(engine(x), y))
    engine.step()
    return peak_bytes(torch.device("cpu")) - before


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_activation_checkpointing_lowers_peak_memory():
    plain = run_distributed(_step_peak, 1, False)[0]
    ckpt = run_distributed(_step_peak, 1, True)[0]
    # Per block and 4096 tokens of 64 floats (1 MiB): about 15 MiB of saved activations
    # plus the attention matrix, against 1 MiB (the block's input) with checkpointing,
    # plus one block's recomputation at a time.
    assert plain > 60 * 2**20, plain
    assert ckpt < 0.5 * plain, (ckpt, plain)


def test_resnet18_checkpointing_keeps_keys_gradients_and_statistics():
    from trainer.models.builtin import loss_fn, resnet18

    torch.manual_seed(0)
    plain = resnet18(num_classes=OUT)
    torch.manual_seed(0)
    ckpt = resnet18(num_classes=OUT, activation_checkpointing=True)
    assert list(ckpt.state_dict()) == list(plain.state_dict())  # torchvision's keys
    x, y = torch.randn(4, 3, 16, 16), torch.randint(0, OUT, (4,))
    for model in (plain, ckpt):
        loss_fn(model(x), y).backward()
    assert_state_close(ckpt.state_dict(), plain.state_dict(), 1e-6, 1e-6)  # BN stats too
    for (name, a), b in zip(ckpt.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-6, rtol=1e-5, msg=name)


# ---------------------------------------------------------------------------------------
# Config, schedule


def test_schedule_warmup_then_cosine():
    f = lr_lambda("cosine", steps=100, warmup_steps=10, min_lr_ratio=0.1)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(10) == pytest.approx(1.0) and f(99) == pytest.approx(0.1)
    values = [f(i) for i in range(10, 100)]
    assert all(a >= b for a, b in zip(values, values[1:], strict=False))
    assert f(200) == pytest.approx(0.1)
    constant = lr_lambda("constant", steps=100, warmup_steps=4)
    assert [constant(i) for i in (0, 3, 50)] == [0.25, 1.0, 1.0]


def test_schedule_counts_taken_steps_on_the_device_as_the_host_would():
    # fp16 decides on the device whether a step was taken: the schedule must give every
    # step the lr a host-decided skip gives it, without reading the flag.
    from test_host_sync import CountSyncingOps

    from trainer.observe import host
    from trainer.run.optim import lr_scheduler

    def optimizer() -> torch.optim.Optimizer:  # steps without gradients: only its lr is read
        return torch.optim.AdamW([nn.Parameter(torch.zeros(3))], lr=0.1, fused=True)

    cfg = {"schedule": "cosine", "warmup_steps": 3, "min_lr_ratio": 0.1}
    on_host = lr_scheduler(optimizer(), cfg, 10)
    opt = optimizer()
    on_device = lr_scheduler(opt, cfg, 10, on_device=True)
    taken = [False, True, False, True, True, False, True, True, True]
    used = []
    with host.counting() as reads, CountSyncingOps(opt) as ops:
        for t in taken:
            used.append(opt.param_groups[0]["lr"])
            on_host.optimizer.step()  # no gradients: nothing moves; the order torch wants
            opt.step()
            on_host.step(t)
            on_device.step(torch.tensor(t))
    assert reads.count == 0 and ops.ops == []
    # the same doubles as LambdaLR's, step by step (the lr a step used is kept as it was)
    want = [0.1 * on_host.lr_lambdas[0](i) for i in [0, 0, 1, 1, 2, 3, 3, 4, 5]]
    assert [lr.item() for lr in used] == want
    assert opt.param_groups[0]["lr"].item() == on_host.get_last_lr()[0]
    # a checkpoint holds the steps taken, in plain values, whichever side decided
    state = on_device.state_dict()
    assert state["last_epoch"] == on_host.last_epoch == sum(taken)
    assert state["_last_lr"] == on_host.get_last_lr()
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    resumed_opt = optimizer()
    resumed = lr_scheduler(resumed_opt, cfg, 10, on_device=True)
    resumed.load_state_dict(torch.load(buf, weights_only=True))
    assert resumed_opt.param_groups[0]["lr"].item() == on_host.get_last_lr()[0]
    resumed.step(torch.tensor(True))
    on_host.step(True)
    assert resumed_opt.param_groups[0]["lr"].item() == on_host.get_last_lr()[0]


def _cfg(*overrides: str):
    from hydra import compose, initialize_config_dir
    from test_cli import ROOT

    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=list(overrides))


@pytest.mark.parametrize(
    "overrides, world, needle",
    [
        (
            ["train.batch_size=12", "train.grad_accum_steps=4"],
            2,
            "train.batch_size=12 is not divisible by world size 2 x train.grad_accum_steps=4; "
            "use a multiple of 8",
        ),
        (["train.grad_accum_steps=0"], 1, "train.grad_accum_steps=0 must be a whole number"),
        (["optim.clip_grad_norm=-1"], 1, "optim.clip_grad_norm=-1 must be >= 0"),
        (["optim.schedule=linear"], 1, "optim.schedule='linear' is not one of constant, cosine"),
        (["optim.min_lr_ratio=2"], 1, "optim.min_lr_ratio=2 must be between 0 and 1"),
        (["train.eval_every=-1"], 1, "train.eval_every=-1 must be a whole number >= 0"),
    ],
)
def test_bad_training_options_name_the_values(overrides, world, needle):
    with pytest.raises(ConfigError) as info:
        validate(_cfg(*overrides), world)
    assert needle in str(info.value)


def test_defaults_validate():
    validate(_cfg("train.batch_size=24", "train.grad_accum_steps=3"), 4)
    validate(_cfg(), 1)


# ---------------------------------------------------------------------------------------
# The command line


def test_cli_accumulation_clipping_schedule_eval(tmp_path):
    proc = run_cli(
        [
            f"run.root={tmp_path}",
            "mode=fsdp",
            "model.activation_checkpointing=true",
            "train.steps=40",
            "train.log_every=5",
            "train.grad_accum_steps=2",
            "optim.clip_grad_norm=1.0",
            "optim.schedule=cosine",
            "optim.warmup_steps=10",
            "train.eval_every=20",
            "train.eval_batches=4",
            "train.save_final=false",
        ],
        nproc=2,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    [run_dir] = [p for p in tmp_path.iterdir() if p.is_dir()]
    values = scalars(run_dir)
    for tag in ("train/grad_norm", "train/lr", "eval/loss", "eval/accuracy", "perf/tokens_per_s"):
        assert tag in values, sorted(values)
    assert len(values["eval/loss"]) == 2
    lr = values["train/lr"]
    assert lr[0] < lr[1] and lr[-1] == pytest.approx(1e-4)  # warm-up, then down to 0.1 x lr
    assert values["train/loss"][-1] < 0.7 * values["train/loss"][0], values["train/loss"]
    assert values["eval/loss"][-1] < values["eval/loss"][0]
