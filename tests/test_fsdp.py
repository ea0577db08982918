"""mode=fsdp: unit policy, parity with one process and torch DDP, prefetch order and
memory mid-step, no_sync accumulation, full_state_dict, config."""

import inspect
from pathlib import Path

import pytest
import torch
from dist_harness import run_distributed
from omegaconf import OmegaConf
from reference import (
    OPTIMIZERS,
    any_loss,
    assert_state_close,
    batches,
    make_model,
    train_engine_and_torch_ddp,
    train_single,
)
from torch import nn

from trainer.models.builtin import GPT, MLP, SmallCNN
from trainer.parallel.flat import FlatLayout
from trainer.parallel.units import plan_units

STEPS, BATCH = 2, 8
# OddMLP: fc1 (104 params), fc2 (154) and fc3 (60) become units; `scale` stays in the root.
MLP_UNITS = {"unit_classes": [], "min_unit_params": 50}
# GPT: the Blocks by class; wte and lm_head (255 each) by size, unless they are tied.
GPT_UNITS = {"min_unit_params": 250}


def _unit_names(model, **options):
    return [u.name for u in plan_units(model, **options)]


# -- unit policy (no processes) -----------------------------------------------------------


def test_units_by_class_and_by_size():
    gpt = make_model("gpt", seed=0)
    assert _unit_names(gpt) == ["", "blocks.0", "blocks.1", "blocks.2"]
    root = plan_units(gpt)[0]
    assert [n for n, _ in root.params] == [
        "wte.weight",
        "wpe.weight",
        "ln_f.weight",
        "ln_f.bias",
        "lm_head.weight",
    ]
    assert _unit_names(gpt, **GPT_UNITS) == ["", "wte", "blocks.0", "blocks.1"] + [
        "blocks.2",
        "lm_head",
    ]
    resnet = make_model("resnet18", seed=0)
    blocks = [f"layer{i}.{j}" for i in range(1, 5) for j in range(2)]
    assert _unit_names(resnet) == [""] + blocks
    assert {n.split(".")[0] for n, _ in plan_units(resnet)[0].params} == {"conv1", "bn1", "fc"}
    # The repeated Linears of a ModuleList become units whatever their size; the head,
    # alone of its kind, only by size.
    mlp = MLP(in_dim=32, hidden=16, depth=3)
    layers = ["layers.0", "layers.1", "layers.2"]
    assert _unit_names(mlp) == ["", *layers]  # 1.4k parameters, far below min_unit_params
    assert _unit_names(mlp, min_unit_params=100) == ["", *layers, "head"]
    # Without the repetition rule, the size rule alone: a ModuleList has no forward of its
    # own, so its layers become units one by one once they are large enough.
    assert _unit_names(mlp, repeated_children=False) == [""]
    assert _unit_names(mlp, repeated_children=False, min_unit_params=100) == [
        "",
        *layers,
        "head",
    ]
    # Repeated classes without a class rule: ConvBlocks in a ModuleList, the resnet's
    # BasicBlocks in their Sequentials (the same units as by class).
    assert _unit_names(SmallCNN()) == ["", "blocks.0", "blocks.1"]
    assert _unit_names(resnet, unit_classes=[]) == [""] + blocks
    # Configured by class name, as conf/mode/fsdp.yaml does. A named class wins over the
    # repetition of the Blocks that hold it: the cut is finer, not nested.
    assert _unit_names(gpt, unit_classes=["FeedForward"], min_unit_params=10**9) == [""] + [
        f"blocks.{i}.mlp" for i in range(3)
    ]
    # Without a named class, the repeated Blocks are units, their inner Linears are not
    # (the outermost repetition takes the whole layer), however low min_unit_params is.
    assert _unit_names(gpt, unit_classes=[], min_unit_params=250) == ["", "wte"] + [
        f"blocks.{i}" for i in range(3)
    ] + ["lm_head"]


def test_repeated_children_need_parameters_and_a_forward():
    # Two ReLUs (no parameters) and two ModuleLists (no forward: searched instead) are not
    # units; the Linears inside the ModuleLists repeat and are. The lone Linear is not.
    model = nn.Sequential(
        nn.Linear(3, 4),
        nn.ReLU(),
        nn.ReLU(),
        nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)]),
        nn.ModuleList([nn.Conv1d(1, 1, 1)]),
    )
    assert _unit_names(model) == ["", "3.0", "3.1"]
    # A module registered twice in one list is one child, not a repetition.
    shared = nn.Linear(2, 2)
    assert _unit_names(nn.Sequential(shared, shared, nn.LayerNorm(2))) == [""]


def test_tied_and_shared_parameters_go_to_the_common_unit():
    tied = make_model("gpt_tied", seed=0)
    plan = plan_units(tied, **GPT_UNITS)
    # wte and lm_head both reach the one tied weight: it moves to the root and the two
    # units, left empty, are dropped.
    assert [u.name for u in plan] == ["", "blocks.0", "blocks.1", "blocks.2"]
    assert any(p is tied.wte.weight for _, p in plan[0].params)

    # A module registered under two units (16 params, too small to be a unit itself).
    shared = nn.Linear(4, 4, bias=False)
    model = nn.Sequential(
        nn.Sequential(nn.Linear(4, 4), shared), nn.Sequential(shared, nn.Linear(4, 8))
    )
    plan = plan_units(model, unit_classes=[], min_unit_params=30, repeated_children=False)
    assert [u.name for u in plan] == ["", "0", "1.1"]
    assert [n for n, _ in plan[0].params] == ["0.1.weight"]
    assert sum(len(u.params) for u in plan) == len(list(model.parameters()))
    # By default the two inner Sequentials repeat: both are units, the shared weight still
    # goes to the root.
    plan = plan_units(model, unit_classes=[])
    assert [u.name for u in plan] == ["", "0", "1"]
    assert [n for n, _ in plan[0].params] == ["0.1.weight"]
    assert [n for n, _ in plan[2].params] == ["1.1.weight", "1.1.bias"]


class _Body(nn.Module):
    """A module that encloses the layers and holds parameters of its own beside them, as
    HF GPT-2's `transformer` holds `wpe` and `ln_f` around its blocks."""

    def __init__(self, width: int = 8, depth: int = 4):
        super().__init__()
        self.pos = nn.Parameter(torch.randn(width))
        self.layers = nn.ModuleList([nn.Linear(width, width) for _ in range(depth)])

    def forward(self, x):
        x = x + self.pos
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def test_a_module_enclosing_units_is_never_one():
    # `pos` (8) reaches min_unit_params in `_Body`, which has a forward: the size rule
    # would make it a unit around the Linears'. Its parameters go to the root instead.
    torch.manual_seed(0)
    model = nn.Sequential(_Body(), nn.Linear(8, 2))
    plan = plan_units(model, min_unit_params=8)
    assert [u.name for u in plan] == ["", "0.layers.0", "0.layers.1", "0.layers.2"] + [
        "0.layers.3",
        "1",
    ]
    assert [n for n, _ in plan[0].params] == ["0.pos"]
    nested = [
        (a.name, b.name)
        for a in plan[1:]
        for b in plan[1:]
        if a is not b and any(m is a.module for m in b.module.modules())
    ]
    assert nested == []  # no unit inside another: the root encloses each of them
    # HF GPT-2 whose wpe (64 x 1536) and ln_f together, not apart, reach 100k parameters.
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=8, n_positions=64, n_embd=1536, n_layer=2, n_head=2)
    with torch.device("meta"):
        gpt2 = GPT2LMHeadModel(config)
    plan = plan_units(gpt2)
    assert [u.name for u in plan] == ["", "transformer.h.0", "transformer.h.1"]
    assert {n for n, _ in plan[0].params} == {
        "transformer.wte.weight",  # tied to lm_head
        "transformer.wpe.weight",
        "transformer.ln_f.weight",
        "transformer.ln_f.bias",
    }


def _enclosed_step(env) -> dict:
    from trainer import comm
    from trainer.parallel import build_engine

    torch.manual_seed(0)
    model = nn.Sequential(_Body(), nn.Linear(8, 2))
    reference = nn.Sequential(_Body(), nn.Linear(8, 2))
    reference.load_state_dict(model.state_dict())
    sgd = OPTIMIZERS["sgd"]
    engine = build_engine(model, "fsdp", sgd, min_unit_params=8)
    x, y = torch.randn(4, 8), torch.randn(4, 2)
    with comm.tracing() as events:
        mine = slice(2 * env.rank, 2 * env.rank + 2)
        engine.backward(nn.functional.mse_loss(engine(x[mine]), y[mine]))
    engine.step()
    nn.functional.mse_loss(reference(x), y).backward()
    opt = sgd(reference.parameters())
    opt.step()
    got = engine.full_state_dict()
    return {
        "events": events,
        "max_diff": max((got[k] - v).abs().max().item() for k, v in reference.state_dict().items()),
    }


def test_enclosed_units_are_gathered_one_by_one_in_backward():
    for out in run_distributed(_enclosed_step, 2):
        events = out["events"]
        start = events.index(("backward_begin", "root"))
        # AllGathers issued before each ReduceScatter of the backward: the last unit and
        # the one before it (prefetched), then one more per unit reduced. Gathering the
        # enclosing module as a unit would bring every unit inside it in at once.
        gathers, between = [], 0
        for event, _ in events[start:]:
            if event == "launch:all_gather":
                between += 1
            elif event == "launch:reduce_scatter":
                gathers.append(between)
                between = 0
        assert gathers[0] <= 2 and max(gathers[1:]) <= 1, (gathers, events)
        # equal to one process over the whole batch up to rounding: averaging over 2 ranks
        # adds the two halves' gradients in another order (a few ulps of values ~1)
        assert out["max_diff"] < 1e-6


@pytest.mark.parametrize("mode", ["ddp", "zero", "fsdp"])
def test_mode_config_matches_the_constructor(mode):
    from trainer.parallel import ENGINES, build_engine

    cfg = OmegaConf.load(Path(__file__).parent.parent / f"conf/mode/{mode}.yaml")
    assert cfg.name == mode
    # build_engine takes the options every mode shares (reduce_dtype), the mode the rest
    accepted = {*inspect.signature(ENGINES[mode]).parameters}
    accepted |= {*inspect.signature(build_engine).parameters}
    # `defaults` names the mode's typed schema (trainer/config/schema.py) for Hydra
    assert set(cfg) - {"name", "defaults"} <= accepted


@pytest.mark.parametrize("mode", ["ddp", "zero", "fsdp"])
def test_a_bucket_mb_sweep_composes_for_every_mode(mode):
    """`mode.bucket_mb=...` over all modes: fsdp takes the key (and ignores it)."""
    from hydra import compose, initialize_config_dir

    import trainer.config.schema  # noqa: F401  (registers the schema conf/config.yaml extends)
    from trainer.config.checks import engine_options, validate

    conf = Path(__file__).parent.parent / "conf"
    with initialize_config_dir(str(conf), version_base="1.3"):
        cfg = compose("config", overrides=[f"mode={mode}", "mode.bucket_mb=10"])
    validate(cfg, 1)
    assert engine_options(cfg)["bucket_mb"] == 10


# -- parity -------------------------------------------------------------------------------


def _pads(kind: str, world: int, options: dict) -> bool:
    options = {k: v for k, v in options.items() if k in ("unit_classes", "min_unit_params")}
    plan = plan_units(make_model(kind, seed=0), **options)
    layouts = [FlatLayout.of([p for _, p in u.params], world) for u in plan]
    return any(lay.padded_numel > lay.numel for lay in layouts)


@pytest.mark.parametrize(
    "world,kind,reshard,options",
    [
        (1, "mlp", True, MLP_UNITS),
        (2, "mlp", False, MLP_UNITS),
        (4, "mlp", True, MLP_UNITS),
        (1, "gpt", True, {}),
        (2, "gpt", False, GPT_UNITS),
        (2, "gpt_tied", True, GPT_UNITS),
        (4, "gpt_tied", False, {}),
    ],
)
def test_parity_with_single_process_and_torch_ddp(world, kind, reshard, options):
    if world > 1:
        assert _pads(kind, world, options)  # some unit's flat buffer carries padding
    want = train_single(kind, "adamw", STEPS, BATCH)
    out = run_distributed(
        train_engine_and_torch_ddp,
        world,
        "fsdp",
        kind,
        "adamw",
        STEPS,
        BATCH,
        reshard_after_forward=reshard,
        **options,
    )
    for got, ref in out:
        assert_state_close(got, want)  # keys equal model.state_dict()'s, tied ones included
        assert_state_close(got, ref)
        assert_state_close(got, out[0][0], atol=0, rtol=0)  # every rank holds the same model


@pytest.mark.parametrize("world,reshard", [(1, False), (2, True)])
def test_resnet18_batchnorm_follows_torch_ddp(world, reshard):
    # Per-rank BatchNorm statistics differ from one process on the whole batch, so the
    # reference is torch DDP, which also broadcasts buffers from rank 0 every forward.
    out = run_distributed(
        train_engine_and_torch_ddp,
        world,
        "fsdp",
        "resnet18",
        "sgd",
        STEPS,
        BATCH,
        reshard_after_forward=reshard,
    )
    for got, ref in out:
        assert_state_close(got, ref)


def test_no_sync_accumulation_equals_big_batch():
    want = train_single("mlp", "adamw", STEPS, 24)
    out = run_distributed(
        train_engine_and_torch_ddp, 2, "fsdp", "mlp", "adamw", STEPS, 24, accum=3, **MLP_UNITS
    )
    for got, ref in out:
        assert_state_close(got, want)
        assert_state_close(got, ref)


# -- prefetch order and memory ------------------------------------------------------------


def _one_step_traced(env):
    from trainer import comm
    from trainer.parallel import build_engine

    torch.manual_seed(0)
    model = GPT(vocab_size=17, block_size=8, n_layer=4, n_head=2, n_embd=16)
    engine = build_engine(model, "fsdp", optimizer=OPTIMIZERS["adamw"])
    units = engine.units[1:]
    seen = []  # (phase, running unit, tags of units holding full parameters)

    def measure(phase, i):
        assert all(p.untyped_storage().nbytes() > 0 for p in units[i].params)
        seen.append((phase, units[i].tag, [u.tag for u in units if u.is_full]))

    def in_backward(i):  # a hook on the attention output: runs inside unit i's backward
        def hook(module, args, out):
            if out.requires_grad:
                out.register_hook(lambda grad: measure("backward", i))

        return hook

    for i, block in enumerate(model.blocks):  # hooks inside unit i, around its attention
        block.attn.register_forward_pre_hook(lambda m, a, i=i: measure("forward", i))
        block.attn.register_forward_hook(in_backward(i))
    x, y = batches("gpt", 1, 4)[0]
    with comm.tracing() as events:
        engine.backward(any_loss(engine(x), y))
    engine.step()

    with torch.no_grad():  # eval: gathers and frees unit by unit (measured too), no backward
        engine.eval()(x)
    left_full = [u.tag for u in engine.units if u.is_full]
    keys_equal = list(engine.full_state_dict()) == list(model.state_dict())
    return len(units), seen, events, left_full, keys_equal


def test_prefetch_order_and_at_most_two_units_gathered():
    n, seen, events, left_full, keys_equal = run_distributed(_one_step_traced, 2)[0]
    assert n == 4
    assert [(phase, tag) for phase, tag, _ in seen[: 2 * n]] == [
        ("forward", f"unit{i}") for i in range(n)
    ] + [("backward", f"unit{i}") for i in reversed(range(n))]
    for phase, tag, full in seen:
        assert tag in full and len(full) <= 2, (phase, tag, full)
        i = int(tag[4:])
        nxt = i + 1 if phase == "forward" else i - 1
        if 0 <= nxt < n:
            assert f"unit{nxt}" in full, (phase, tag, full)  # prefetched, in flight or done

    def first(event, start=0):
        return events.index(event, start)

    end_forward = first(("forward_end", "root"))
    for i in range(n - 1):  # unit i+1's AllGather is issued before unit i's compute ends
        assert first(("launch:all_gather", f"unit{i + 1}")) < first(("forward_end", f"unit{i}"))
    for i in range(1, n):  # backward: unit i-1's AllGather before unit i's grads are ready
        gather = first(("launch:all_gather", f"unit{i - 1}"), end_forward)
        assert gather < first(("grads_ready", f"unit{i}")), events
    # the last unit's ReduceScatter is in flight while earlier units compute their backward
    assert first(("launch:reduce_scatter", f"unit{n - 1}")) < first(("backward_begin", "unit0"))
    assert left_full == []
    assert keys_equal


def _frozen(env, mode: str) -> dict:
    """A GPT with its embeddings and one block's attention frozen (fine-tuning), AdamW."""
    from trainer.parallel import build_engine

    model = make_model("gpt", seed=0)
    for p in [model.wte.weight, *model.blocks[0].attn.parameters()]:
        p.requires_grad_(False)
    options = {"min_unit_params": 10} if mode == "fsdp" else {}
    engine = build_engine(model, mode, OPTIMIZERS["adamw"], **options)
    for x, y in batches("gpt", 3, 8):
        x, y = x[env.rank * 4 : (env.rank + 1) * 4], y[env.rank * 4 : (env.rank + 1) * 4]
        engine.backward(any_loss(engine(x), y))
        engine.step()
    return engine.full_state_dict()


def test_frozen_parameters_stay_whole_and_untouched():
    init = make_model("gpt", seed=0).state_dict()
    ddp = run_distributed(_frozen, 2, "ddp")
    for got in run_distributed(_frozen, 2, "fsdp"):
        assert torch.equal(got["wte.weight"], init["wte.weight"])
        assert torch.equal(got["blocks.0.attn.c_attn.weight"], init["blocks.0.attn.c_attn.weight"])
        assert not torch.equal(
            got["blocks.1.attn.c_attn.weight"], init["blocks.1.attn.c_attn.weight"]
        )
        assert_state_close(got, ddp[0])
