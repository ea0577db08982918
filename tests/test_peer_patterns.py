"""Peer patterns from PyTorch's own DDP and FSDP2 suites (issue 15, "never silently wrong").

Every case trains a small model for a few steps through `build_engine` in every mode, at
2 and 4 ranks (the call shapes from FSDP2's suite at 3 too), each rank on its slice of the
global batch, and compares the final parameters (and buffers) with
  (a) one process training the same model on the whole global batch, and
  (b) torch's own DistributedDataParallel on the same per-rank slices, and, for the
      shapes from FSDP2's suite, torch's FSDP2 (`fully_shard`) in the same reshard
      setting.
Models are built from the same seed on every rank; losses are means over a rank's slice,
so averaging gradients over ranks is one big batch's gradient.

Speed, and cases that fail or hang: [Note: one process group for every case] beside
_run_cases.

Tolerances: fp32 throughout, SGD (or AdamW with eps=1e-3, where AdamW's handling of
"no gradient" is what is tested: its default eps would turn the rounding noise of a zero
gradient into lr-sized steps). The three trainings differ only in the order in which
per-rank gradients are summed: relative differences of about 1e-7, which 3 steps of SGD
(lr 0.05) or AdamW (an update moves by at most lr/eps = 10 times a gradient's change)
carry into parameter differences far below `assert_state_close`'s atol=1e-5/rtol=1e-4.
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import re
import tempfile
import time
import traceback
from collections import namedtuple
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import pytest
import torch
from dist_harness import CTX, free_port, worker
from reference import (
    IN,
    OUT,
    OddMLP,
    WithBatchNorm,
    any_loss,
    assert_state_close,
    local_checkpoint_data,
    rank_slice,
)
from torch import nn
from torch.utils.checkpoint import checkpoint

pytestmark = pytest.mark.slow  # about a minute on two free cores, most of it starting ranks

WORLDS = (2, 4)
STEPS, BATCH = 3, 24  # 24 splits into 2 or 4 slices, and each slice into 2 micro-batches
FSDP_UNITS = {"unit_classes": [], "min_unit_params": 1}  # every module with parameters
MODES: dict[str, dict[str, Any]] = {
    "ddp": {"bucket_mb": 0.0005},  # ~130 floats a bucket: several buckets
    "zero": {"bucket_mb": 0.0005},
    "fsdp": {**FSDP_UNITS},
    "fsdp_keep": {**FSDP_UNITS, "reshard_after_forward": False},
}
TORCH_DDP = "torch_ddp"
# torch's FSDP2, both reshard settings: the reference for the cases from its own suite
TORCH_FSDP2 = {"torch_fsdp2": True, "torch_fsdp2_keep": False}  # reshard_after_forward

OPTIMIZERS = {
    "sgd": functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9),
    # eps=1e-3: see the module docstring; weight decay makes "no gradient" (skipped:
    # untouched) differ from "zero gradient" (decayed, moved by stale moments).
    "adamw": functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1, eps=1e-3),
}


def _no_decay_for_vectors(name: str, p: nn.Parameter) -> dict[str, Any]:
    return {"weight_decay": 0.0} if p.ndim < 2 else {}


# ---------------------------------------------------------------------------------------
# The three ways of training, behind one small interface that a case's step function uses


class _Runner:
    """What a case's step sees: forward (`run(x)`), `backward(loss)`, `no_sync()`, and the
    rank whose slice it is given (None: one process on the whole batch)."""

    rank: int | None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def no_sync(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def part(self, name: str) -> Callable[..., Any]:
        """The submodule `name` of the model, to call on its own (a forward that does not
        start at the root)."""
        raise NotImplementedError


class _EngineRunner(_Runner):
    def __init__(self, engine, rank: int, plain: bool):
        self.engine, self.rank, self.plain = engine, rank, plain

    def __call__(self, *args, **kwargs):
        return self.engine(*args, **kwargs)

    def backward(self, loss):
        if self.plain:
            loss.backward()
        else:
            self.engine.backward(loss)

    def no_sync(self):
        return self.engine.no_sync()

    def part(self, name):
        return self.engine.module.get_submodule(name)


class _TorchDDPRunner(_Runner):
    def __init__(self, ddp: nn.parallel.DistributedDataParallel, rank: int):
        self.ddp, self.rank = ddp, rank

    def __call__(self, *args, **kwargs):
        return self.ddp(*args, **kwargs)

    def no_sync(self):
        return self.ddp.no_sync()


class _TorchFSDP2Runner(_Runner):
    """torch's FSDP2 (`fully_shard`) on a model whose units are already sharded."""

    def __init__(self, model: nn.Module, rank: int):
        self.model, self.rank = model, rank

    def __call__(self, *args, **kwargs):
        return self.model(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        self.model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)

    def part(self, name):
        return self.model.get_submodule(name)


class _SingleRunner(_Runner):
    """One process. `scale` = 1/P when it replays the P ranks' slices one by one."""

    def __init__(self, model: nn.Module, rank: int | None, scale: float = 1.0):
        self.model, self.rank, self.scale = model, rank, scale

    def __call__(self, *args, **kwargs):
        return self.model(*args, **kwargs)

    def backward(self, loss):
        (loss * self.scale).backward()

    def part(self, name):
        return self.model.get_submodule(name)


Step = Callable[[_Runner, torch.Tensor, torch.Tensor, int], None]


def _one_loss(run: _Runner, x: torch.Tensor, y: torch.Tensor, i: int) -> None:
    run.backward(any_loss(run(x), y))


def _float_batches(seed: int = 1234) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(BATCH, IN, generator=g), torch.randint(0, OUT, (BATCH,), generator=g))
        for _ in range(STEPS)
    ]


@dataclass(frozen=True)
class Case:
    name: str
    pattern: str  # the numbering: 1..6
    model: Callable[[], nn.Module]  # built under torch.manual_seed(0)
    step: Step = _one_loss  # the forwards and backwards of one step, on one batch
    optim: str = "sgd"
    # torch DDP's options; None where torch DDP cannot express the pattern
    ddp: dict[str, Any] | None = field(default_factory=dict)
    plain: bool = False  # loss.backward() instead of engine.backward(loss)
    # The one-process reference replays each rank's slice (loss / P each) instead of one
    # big batch, where the two differ: BatchNorm statistics are per rank, or the code
    # depends on the rank.
    by_rank: bool = False
    clip: float | None = None
    param_options: Callable[[str, nn.Parameter], dict[str, Any]] | None = None
    batches: Callable[[], list[tuple[torch.Tensor, torch.Tensor]]] = _float_batches
    eval_input: bool = False  # after training: eval() and a no_grad forward on every rank
    untouched: tuple[str, ...] = ()  # state keys no rank ever uses: bitwise initial values
    worlds: tuple[int, ...] = WORLDS  # the cases from FSDP2's suite run at 3 ranks too
    # The submodules torch FSDP2 shards on their own before the root; None: no FSDP2 run
    fsdp2: Callable[[nn.Module], list[nn.Module]] | None = None


def _build(case: Case) -> nn.Module:
    torch.manual_seed(0)
    return case.model()


# ---------------------------------------------------------------------------------------
# Models and steps. Sizes are odd so that flat buffers need padding at 2 and 4 ranks.


class TwoHeads(nn.Module):
    """A trunk shared by two heads; `head` picks one, "both" returns a dict of both."""

    def __init__(self, shared_trunk: bool = True):
        super().__init__()
        self.trunk = nn.Linear(IN, 13)
        self.head_a = nn.Linear(13, OUT)
        self.head_b = nn.Linear(13 if shared_trunk else IN, OUT)
        self.shared_trunk = shared_trunk

    def forward(self, x, head: str = "a"):
        h = torch.relu(self.trunk(x))
        if head == "a":
            return self.head_a(h)
        if head == "b":
            return self.head_b(h)
        # disjoint graphs: head_b reads the input, not the trunk
        return {"a": self.head_a(h), "b": self.head_b(x)}


def _two_forwards_two_backwards(run, x, y, i):
    run.backward(any_loss(run(x, head="a"), y))
    run.backward(0.5 * any_loss(run(x, head="b"), y))  # touches neither head_a nor ...


def _one_forward_two_backwards(run, x, y, i):
    out = run(x, head="both")
    run.backward(any_loss(out["a"], y))  # trunk and head_a
    run.backward(0.5 * any_loss(out["b"], y))  # head_b only


class SometimesExtra(nn.Module):
    """`extra` runs when `use_extra`: on even steps, or on rank 0 only."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(IN, 13)
        self.extra = nn.Linear(13, 13)
        self.fc2 = nn.Linear(13, OUT)

    def forward(self, x, use_extra: bool):
        h = torch.relu(self.fc1(x))
        if use_extra:
            h = torch.relu(self.extra(h))
        return self.fc2(h)


def _extra_on_even_steps(run, x, y, i):
    run.backward(any_loss(run(x, use_extra=i % 2 == 0), y))


def _extra_on_rank0(run, x, y, i):
    run.backward(any_loss(run(x, use_extra=run.rank == 0), y))


class WithAux(nn.Module):
    """Returns (main, aux); the loss leaves aux out, so aux_head gets no gradient."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(IN, 13)
        self.fc2 = nn.Linear(13, OUT)
        self.aux_head = nn.Linear(13, 3)

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        return self.fc2(h), self.aux_head(h)


def _main_output_only(run, x, y, i):
    main, _aux = run(x)
    run.backward(any_loss(main, y))


class Unused(OddMLP):
    """fc_unused is never called."""

    def __init__(self):
        super().__init__()
        self.fc_unused = nn.Linear(IN, 3)


VOCAB, TOKENS = 11, 4


class TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, 6)
        self.mid = nn.Linear(6, 6)
        self.lm_head = nn.Linear(6, VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx):  # (B, T) -> (B, T, VOCAB)
        return self.lm_head(torch.tanh(self.mid(self.wte(idx))))


def _token_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(99)
    return [
        tuple(torch.randint(0, VOCAB, (BATCH, TOKENS), generator=g) for _ in range(2))
        for _ in range(STEPS)
    ]


class SharedTwice(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc_in = nn.Linear(IN, 9)
        self.shared = nn.Linear(9, 9)
        self.fc_out = nn.Linear(9, OUT)

    def forward(self, x):
        h = torch.tanh(self.shared(torch.tanh(self.fc_in(x))))
        return self.fc_out(torch.tanh(self.shared(h)))


class OddShapes(OddMLP):
    """Besides OddMLP's odd sizes: a zero-element parameter, a 1-element one, a (3,)."""

    def __init__(self):
        super().__init__()
        self.empty = nn.Parameter(torch.zeros(0))
        self.one = nn.Parameter(torch.randn(1))
        self.vec = nn.Parameter(torch.randn(3))

    def forward(self, x):
        out = super().forward(x) * (1 + self.empty.sum())
        return out + self.one + 0.1 * self.vec.sum()


class NonContiguous(nn.Module):
    """`w` is created as a transposed (non-contiguous) tensor."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(IN, 9).t())  # (9, IN), strides (1, 9)
        self.fc = nn.Linear(9, OUT)

    def forward(self, x):
        return self.fc(torch.relu(x @ self.w.t()))


def _frozen_fc1() -> nn.Module:
    m = OddMLP()
    m.fc1.requires_grad_(False)
    return m


def _no_sync_two_micro(run, x, y, i):
    (x1, x2), (y1, y2) = x.chunk(2), y.chunk(2)
    with run.no_sync():
        run.backward(any_loss(run(x1), y1) / 2)
    run.backward(any_loss(run(x2), y2) / 2)


Parts = namedtuple("Parts", ["logits", "energy"])


class DictOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(IN, 13)
        self.fc2 = nn.Linear(13, OUT)
        self.energy = nn.Linear(13, 1)

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        return {"parts": Parts(self.fc2(h), self.energy(h)), "hidden": h}


def _dict_loss(run, x, y, i):
    out = run(x)
    parts = out["parts"]
    loss = any_loss(parts.logits, y) + 0.1 * parts.energy.pow(2).mean()
    run.backward(loss + 0.01 * out["hidden"].mean())


class Kwargs(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(IN, 13)
        self.fc2 = nn.Linear(13, OUT)

    def forward(self, *, x, temperature: float = 1.0, shift: torch.Tensor | None = None):
        out = self.fc2(torch.relu(self.fc1(x))) / temperature
        return out if shift is None else out + shift


def _kwargs_step(run, x, y, i):
    run.backward(any_loss(run(x=x, temperature=2.0, shift=torch.linspace(0, 1, OUT)), y))


class Inner(nn.Module):
    """A parameter of its own and a child with parameters: with min_unit_params=1 it is
    an fsdp unit holding `gain`, with the unit `fc` inside it."""

    def __init__(self):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(9) + 0.1 * torch.randn(9))
        self.fc = nn.Linear(IN, 9)

    def forward(self, x):
        return torch.tanh(self.fc(x)) * self.gain


class Nested(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = Inner()
        self.scale = nn.Parameter(torch.ones(9) + 0.1 * torch.randn(9))
        self.fc_out = nn.Linear(9, OUT)

    def forward(self, x):
        return self.fc_out(self.inner(x) * self.scale)


class Checkpointed(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc_in = nn.Linear(IN, 11)
        self.block = nn.Sequential(nn.Linear(11, 11), nn.Tanh(), nn.Linear(11, 11))
        self.fc_out = nn.Linear(11, OUT)

    def forward(self, x):
        h = torch.relu(self.fc_in(x))
        h = h + checkpoint(self.block, h, use_reentrant=False)
        return self.fc_out(torch.relu(h))


def _two_forwards_one_backward(run, x, y, i):
    (x1, x2), (y1, y2) = x.chunk(2), y.chunk(2)
    run.backward((any_loss(run(x1), y1) + any_loss(run(x2), y2)) / 2)


# -- Call shapes from FSDP2's own suite, every rank alike (test_fully_shard_frozen.py,
# test_fully_shard_training.py)


class MultiForward(nn.Module):
    """FSDP2's test_multi_forward_mixed_requires_grad: a unit called several times in one
    forward, with grad and under no_grad in turn, around a frozen unit."""

    def __init__(self):
        super().__init__()
        self.layer_0 = nn.Linear(IN, 9)
        self.layer_no_grad = nn.Linear(9, 9)
        self.layer_with_grad = nn.Linear(9, 9)
        self.head = nn.Linear(9, OUT)
        self.layer_no_grad.requires_grad_(False)

    def forward(self, x):
        x = self.layer_0(x)
        for _ in range(3):
            x = self.layer_no_grad(torch.relu(self.layer_with_grad(x)))
            with torch.no_grad():
                x += torch.relu(self.layer_with_grad(x))
        return self.head(x)


class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(IN, 9)
        self.fc2 = nn.Linear(9, IN)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(x)))


def _residual_stack() -> nn.Module:
    return nn.Sequential(Residual(), Residual(), Residual(), nn.Linear(IN, OUT))


def _non_root_on_odd_steps(run, x, y, i):
    """FSDP2's test_non_root_forward_backward: after an ordinary step, a forward and
    backward through the first block alone (`model[0](x)`); the rest get no gradient."""
    if i % 2 == 0:
        run.backward(any_loss(run(x), y))
    else:
        run.backward(run.part("0")(x).pow(2).mean())


def _root_then_non_root(run, x, y, i):
    """An ordinary forward and backward, then a forward and backward of a non-root block
    alone, in the same step: the gradients sum."""
    run.backward(any_loss(run(x), y))
    run.backward(run.part("1")(x).pow(2).mean())


def _frozen_every_other() -> nn.Module:
    """FSDP2's test_train_mixed_requires_grad_across_groups: frozen and trainable linears
    in turn (tanh, not relu: a pre-activation that rounding moves across relu's kink would
    change a gradient by more than rounding)."""
    layers: list[nn.Module] = []
    for i in range(6):
        layers += [nn.Linear(IN, IN), nn.Tanh()]
        if i % 2 == 0:
            layers[-2].requires_grad_(False)
    return nn.Sequential(*layers, nn.Linear(IN, OUT))


def _no_grad_forward_on_step_1(run, x, y, i):
    """Step 1 is an evaluation under no_grad, with no backward: the step changes nothing."""
    if i == 1:
        with torch.no_grad():
            run(x)
        return
    run.backward(any_loss(run(x), y))


def _biases_only() -> nn.Module:
    """FSDP2's test_train_mixed_requires_grad_per_group: frozen and trainable parameters
    in one unit (only the biases train, as BitFit)."""
    m = _residual_stack()
    for n, p in m.named_parameters():
        p.requires_grad_("bias" in n)
    return m


# -- Weight sharing: one block called again between other blocks (ALBERT, looped models),
# every rank alike; FSDP2 gathers it again for each call (its test_multi_forward_module)


class SharedBlock(nn.Module):
    """A residual block; `tie`: its two layers share one weight; `nested`: the block has a
    parameter of its own around an inner block of units."""

    def __init__(self, tie: bool = False, nested: bool = False):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(IN, IN), nn.Linear(IN, IN)
        if tie:
            self.fc2.weight = self.fc1.weight
        self.scale = nn.Parameter(torch.ones(IN) + 0.1 * torch.randn(IN)) if nested else None

    def forward(self, x):
        h = x + self.fc2(torch.tanh(self.fc1(x)))
        return h if self.scale is None else h * self.scale


class WeightShared(nn.Module):
    """`shared` called before each of three other blocks; registered first or last (the
    first or the last unit), called under no_grad once, or frozen."""

    def __init__(self, last: bool = False, no_grad: bool = False, frozen: bool = False, **kw):
        super().__init__()
        if not last:
            self.shared = SharedBlock(**kw)
        self.others = nn.ModuleList(SharedBlock() for _ in range(3))
        if last:
            self.shared = SharedBlock(**kw)
        self.head = nn.Linear(IN, OUT)
        self.no_grad = no_grad
        self.shared.requires_grad_(not frozen)

    def forward(self, x):
        for i, other in enumerate(self.others):
            if self.no_grad and i == 1:
                with torch.no_grad():
                    extra = self.shared(x)
                x = x + 0.5 * extra
            else:
                x = self.shared(x)
            x = other(x)
        return self.head(x)


def _two_backwards_halves(run, x, y, i):
    """Accumulation without no_sync: two backwards before one step."""
    (x1, x2), (y1, y2) = x.chunk(2), y.chunk(2)
    run.backward(any_loss(run(x1), y1) / 2)
    run.backward(any_loss(run(x2), y2) / 2)


def _shared_blocks(m: nn.Module) -> list[nn.Module]:
    return [*m.others, m.shared]


def _linears(m: nn.Module) -> list[nn.Module]:
    return [c for c in m.modules() if isinstance(c, nn.Linear)]


def _blocks(m: nn.Module) -> list[nn.Module]:
    return list(m.children())


def _linears_and_shared(m: nn.Module) -> list[nn.Module]:
    return [*_linears(m), m.shared]  # the shared block around its own units


FIND_UNUSED = {"find_unused_parameters": True}

CASES = [
    # 1. loss.backward(), not engine.backward(loss); and its twin for exact equality
    Case("plain_backward", "1", OddMLP, plain=True),
    Case("engine_backward", "1", OddMLP),
    # 2. several backwards before one step, without no_sync: gradients sum
    Case("two_backwards", "2", TwoHeads, _two_forwards_two_backwards, ddp=FIND_UNUSED),
    Case(
        "two_backwards_plain",
        "2",
        TwoHeads,
        _two_forwards_two_backwards,
        ddp=FIND_UNUSED,
        plain=True,
    ),
    # torch DDP with one forward and two backwards over disjoint graphs: every parameter
    # still gets its gradient once, in the second backward or the first.
    Case(
        "one_forward_two_backwards",
        "2",
        functools.partial(TwoHeads, shared_trunk=False),
        _one_forward_two_backwards,
    ),
    # 3. parameters no rank used in a step (AdamW with weight decay)
    Case(
        "unused_module",
        "3",
        Unused,
        optim="adamw",
        ddp=FIND_UNUSED,
        untouched=("fc_unused.weight", "fc_unused.bias"),
    ),
    Case("unused_on_odd_steps", "3", SometimesExtra, _extra_on_even_steps, "adamw", FIND_UNUSED),
    Case(
        "unused_output",
        "3",
        WithAux,
        _main_output_only,
        "adamw",
        # torch DDP cannot express it: it looks for unused parameters from every output
        # of forward, so it waits for aux_head's gradient (find_unused_parameters=True
        # and static_graph=True both fail with "Expected to have finished reduction in
        # the prior iteration"); a zero loss term instead would give it a zero gradient.
        ddp=None,
        untouched=("aux_head.weight", "aux_head.bias"),
    ),
    # 5. buffers before an eval forward (and BatchNorm buffers during training)
    Case("batchnorm_eval", "5", WithBatchNorm, by_rank=True, eval_input=True),
    # 6. keep passing
    Case("tied_weights", "6", TiedLM, batches=_token_batches),
    Case("shared_module_twice", "6", SharedTwice),
    Case("odd_and_empty_shapes", "6", OddShapes),
    Case("non_contiguous", "6", NonContiguous),
    Case("frozen", "6", _frozen_fc1),
    Case("no_sync", "6", OddMLP, _no_sync_two_micro),
    Case("clip_grad_norm", "6", OddMLP, clip=0.05),  # below the gradients' norm: active
    Case("param_groups", "6", OddMLP, optim="adamw", param_options=_no_decay_for_vectors),
    Case("dict_namedtuple_outputs", "6", DictOut, _dict_loss),
    Case("kwargs", "6", Kwargs, _kwargs_step),
    Case("nested_units", "6", Nested),
    Case("activation_checkpointing", "6", Checkpointed),
    Case("two_forwards_one_backward", "6", OddMLP, _two_forwards_one_backward),
    # 7. call shapes from FSDP2's suite, every rank alike; FSDP2 is a reference too
    Case("multi_forward_mixed_grad", "7", MultiForward, fsdp2=_linears, worlds=(2, 3, 4)),
    Case(
        "non_root_forward_backward",
        "7",
        _residual_stack,
        _non_root_on_odd_steps,
        # torch DDP cannot: a forward of `ddp.module[0]` bypasses its reducer
        ddp=None,
        fsdp2=_blocks,
        worlds=(2, 3, 4),
    ),
    Case(
        "root_then_non_root",
        "7",
        _residual_stack,
        _root_then_non_root,
        ddp=None,
        fsdp2=_blocks,
        worlds=(2, 3, 4),
    ),
    Case(
        "frozen_every_other_no_grad_step",
        "7",
        _frozen_every_other,
        _no_grad_forward_on_step_1,
        ddp=FIND_UNUSED,
        fsdp2=_linears,
        worlds=(2, 3, 4),
    ),
    Case("biases_only", "7", _biases_only, ddp=FIND_UNUSED, fsdp2=_blocks, worlds=(2, 3, 4)),
    # 8. weight sharing: a unit called again after other units, every rank alike
    *(
        Case(
            f"weight_shared{name}",
            "8",
            functools.partial(WeightShared, **kw),
            step,
            fsdp2=fsdp2,
            worlds=(2, 3, 4),
        )  # fmt: skip
        for name, kw, step, fsdp2 in [
            ("", {}, _one_loss, _linears),
            ("_last_tied", {"last": True, "tie": True}, _one_loss, _shared_blocks),
            ("_no_grad", {"no_grad": True}, _one_loss, _linears),
            ("_frozen", {"frozen": True}, _one_loss, _linears),
            ("_nested", {"nested": True}, _one_loss, _linears_and_shared),
            ("_no_sync", {}, _no_sync_two_micro, _linears),
            ("_accumulate", {"last": True}, _two_backwards_halves, _linears),
        ]
    ),
]
# 4. parameters used on some ranks only: its own process groups (see the docstring)
RANK_DEPENDENT = Case(
    "rank_dependent", "4", SometimesExtra, _extra_on_rank0, ddp=FIND_UNUSED, by_rank=True
)
BY_NAME = {c.name: c for c in [*CASES, RANK_DEPENDENT]}


def _eval_batch() -> torch.Tensor:
    return torch.randn(5, IN, generator=torch.Generator().manual_seed(7))


def _optimizer(case: Case, named: list[tuple[str, nn.Parameter]]) -> torch.optim.Optimizer:
    """The reference optimizer, with the param groups `case.param_options` asks for."""
    groups: dict[tuple, dict[str, Any]] = {}
    for n, p in named:
        opts = case.param_options(n, p) if case.param_options else {}
        groups.setdefault(tuple(sorted(opts.items())), {**opts, "params": []})["params"].append(p)
    return OPTIMIZERS[case.optim](list(groups.values()))


def _state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


# ---------------------------------------------------------------------------------------
# What each rank runs


def _train_engine(env, case: Case, mode: str, initial: list) -> dict[str, Any]:
    from trainer.parallel import build_engine

    engine = build_engine(
        _build(case),
        "fsdp" if mode.startswith("fsdp") else mode,
        OPTIMIZERS[case.optim],
        param_options=case.param_options,
        **MODES[mode],
    )
    initial += [engine, _local_state(engine)]  # to compare with after a refusal
    run = _EngineRunner(engine, env.rank, case.plain)
    for i, (x, y) in enumerate(case.batches()):
        xr, yr = rank_slice(x, env.rank, env.world_size), rank_slice(y, env.rank, env.world_size)
        case.step(run, xr, yr, i)
        if case.clip is not None:
            engine.clip_grad_norm_(case.clip)
        engine.step()
    return {"engine": engine}


def _train_torch_ddp(env, case: Case) -> dict[str, Any]:
    ddp = nn.parallel.DistributedDataParallel(_build(case), **case.ddp)
    opt = _optimizer(case, list(ddp.module.named_parameters()))
    run = _TorchDDPRunner(ddp, env.rank)
    for i, (x, y) in enumerate(case.batches()):
        xr, yr = rank_slice(x, env.rank, env.world_size), rank_slice(y, env.rank, env.world_size)
        case.step(run, xr, yr, i)
        if case.clip is not None:
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), case.clip)
        opt.step()
        opt.zero_grad()
    out: dict[str, Any] = {}
    if case.eval_input:  # first: it brings rank 0's buffers to every rank
        ddp.eval()
        with torch.no_grad():
            out["eval"] = ddp(_eval_batch())
    out["state"] = _state(ddp.module)
    return out


def _train_torch_fsdp2(env, case: Case, reshard_after_forward: bool) -> dict[str, Any]:
    """torch FSDP2: `fully_shard` on `case.fsdp2`'s submodules, then on the root, as its
    own tests do; every rank builds the same model (FSDP2 does not broadcast)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    model = _build(case)
    mesh = init_device_mesh("cpu", (env.world_size,))
    for m in case.fsdp2(model):
        fully_shard(m, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
    opt = _optimizer(case, list(model.named_parameters()))
    run = _TorchFSDP2Runner(model, env.rank)
    for i, (x, y) in enumerate(case.batches()):
        xr, yr = rank_slice(x, env.rank, env.world_size), rank_slice(y, env.rank, env.world_size)
        case.step(run, xr, yr, i)
        opt.step()
        opt.zero_grad()
    state = {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
        for k, v in model.state_dict().items()
    }
    return {"state": state}


def _describe(e: BaseException) -> str:
    """The exception's first line and where it was raised."""
    lines = str(e).strip().splitlines()
    frame = traceback.extract_tb(e.__traceback__)[-1] if e.__traceback__ else None
    where = f" [{os.path.basename(frame.filename)}:{frame.lineno} in {frame.name}]" if frame else ""
    return f"{type(e).__name__}: {lines[0] if lines else ''}{where}"


def _agree(store, key: str, env, outcome: str, wait_s: float) -> list[str]:
    """Every rank's outcome, exchanged through the file store: "died" for a rank whose
    process is gone, "no answer" for one that did not report within `wait_s` (blocked in
    a collective that its peers never issued)."""
    store.set(f"{key}/{env.rank}", outcome)
    out = []
    deadline = time.monotonic() + wait_s
    for r in range(env.world_size):
        k = f"{key}/{r}"
        while not store.check([k]) and time.monotonic() < deadline:
            if not _alive(int(store.get(f"pid/{r}"))):
                break
            time.sleep(0.05)
        if store.check([k]):
            out.append(store.get(k).decode())
        else:
            out.append("no answer" if _alive(int(store.get(f"pid/{r}"))) else "died")
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[-1][:1] != "Z"  # not a zombie
    except ProcessLookupError:
        return False
    except OSError:
        return True


def _group_healthy(store, key: str, env) -> bool:
    """After a failed case: does a fresh AllReduce still pair up across the ranks? An odd
    size (17) makes a pairing with some leftover collective of the failed case fail."""
    try:
        t = torch.full((17,), float(env.rank + 1))
        torch.distributed.all_reduce(t)
        ok = bool((t == env.world_size * (env.world_size + 1) / 2).all())
    except Exception:
        ok = False
    return set(_agree(store, key, env, str(ok), RANK_DEPENDENT_TIMEOUT_S)) == {"True"}


# Collectives give up after these: a case whose ranks issue different collectives then
# fails in seconds instead of blocking the group (Gloo's default is 30 minutes).
MAIN_TIMEOUT_S, RANK_DEPENDENT_TIMEOUT_S = 60, 20


# [Note: one process group for every case]
# Speed: all cases of one world size run in one process group (`_results`); starting
# processes is the slow part. Within it, every case is caught on its own: an exception
# becomes a recorded error and the next case starts. After each case the ranks compare
# outcomes through a file store (not through a collective, which a failed case could have
# left out of step); after an error, a fresh AllReduce must still pair up. Otherwise the
# group is not trusted any more and the cases left run again in a fresh group.
# The case that can put the ranks' collectives out of step (pattern 4: code that runs on
# some ranks only) comes last, under a short collective timeout, so that a hang fails its
# test in seconds; a rank that Gloo aborts (messages of different sizes paired up) is
# noticed at once and its results so far are read from the file it saves after each case.
def _run_cases(env, plan: list[tuple[str, list[str]]], folder: str) -> dict:
    """Each (case, modes) of `plan` on this rank, in order: {(case, mode): result}. A
    result has "state" (and "eval"), or "error" (with "unchanged": whether this rank's
    parameters and optimizer state are still those the engine started with), or
    "not_run" when an earlier case left the group out of step. Saved to `folder` after
    every case too, for the parent to read if this process dies."""
    import torch.distributed as dist

    store = dist.FileStore(os.path.join(folder, "store"), env.world_size)
    store.set_timeout(timedelta(seconds=MAIN_TIMEOUT_S))  # reading a peer's pid
    store.set(f"pid/{env.rank}", str(os.getpid()))
    results: dict[tuple[str, str], dict[str, Any]] = {}
    broken = ""
    for name, modes in plan:
        case = BY_NAME[name]
        limit = RANK_DEPENDENT_TIMEOUT_S if case is RANK_DEPENDENT else MAIN_TIMEOUT_S
        dist.set_timeout(timedelta(seconds=limit))
        for mode in modes:
            _save(results, folder, env.rank)
            if mode == TORCH_DDP and case.ddp is None:
                continue
            if mode in TORCH_FSDP2 and case.fsdp2 is None:
                continue
            if broken:
                results[name, mode] = {"not_run": broken}
                continue
            made: list = []
            start = time.perf_counter()
            try:
                if mode == TORCH_DDP:
                    out = _train_torch_ddp(env, case)
                elif mode in TORCH_FSDP2:
                    out = _train_torch_fsdp2(env, case, TORCH_FSDP2[mode])
                else:
                    out = _train_engine(env, case, mode, made)
                outcome, error = "ok", ""
            except Exception as e:
                outcome, error = "error", _describe(e)
            # a peer blocked in a collective reports once the collective times out
            everyone = _agree(store, f"{name}/{mode}", env, outcome, limit + 10)
            if set(everyone) != {outcome}:
                broken = f"ranks disagreed in {name}/{mode}: {everyone}"
                results[name, mode] = {"error": f"{error or 'trained'}; {broken}"}
                continue
            if outcome == "error":
                unchanged = None
                if made:  # the engine was built: did the refusal leave it untouched?
                    unchanged = _same(_local_state(made[0]), made[1])
                results[name, mode] = {"error": error, "unchanged": unchanged}
                if not _group_healthy(store, f"{name}/{mode}/healthy", env):
                    broken = f"the process group was out of step after {name}/{mode}"
                continue
            if mode != TORCH_DDP and mode not in TORCH_FSDP2:
                engine, out = out["engine"], {}
                if case.eval_input:  # first, as for torch DDP: buffers may follow rank 0
                    engine.eval()
                    with torch.no_grad():
                        out["eval"] = engine(_eval_batch())
                out["state"] = engine.full_state_dict()  # a collective: all ranks are here
            out["seconds"] = time.perf_counter() - start
            results[name, mode] = out
    _save(results, folder, env.rank)
    return results


def _save(results: dict, folder: str, rank: int) -> None:
    path = os.path.join(folder, f"rank{rank}.pt")
    torch.save(results, path + ".tmp")
    os.replace(path + ".tmp", path)


def _same(a: Any, b: Any) -> bool:
    """Nested lists/dicts of tensors equal bit for bit."""
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _local_state(engine) -> list:
    """This rank's parameters and optimizer state as a checkpoint would write them, with
    no communication."""
    return list(local_checkpoint_data(engine))


# ---------------------------------------------------------------------------------------
# One process group per world size, and the references


def _launch(world: int, plan: list[tuple[str, list[str]]]) -> list[dict]:
    """`run_distributed(_run_cases, world, plan, ...)`, except that a rank that dies does
    not cost the harness's whole timeout: Gloo aborts the process when the ranks'
    collectives pair messages of different sizes. Its results up to its last case come
    from the file it saves after every case; its peers then fail their collectives
    ("connection closed") and report."""
    with tempfile.TemporaryDirectory() as folder:
        queue, port = CTX.Queue(), free_port()
        procs = [
            CTX.Process(target=worker, args=(_run_cases, r, world, port, queue, (plan, folder), {}))
            for r in range(world)
        ]
        for p in procs:
            p.start()
        got: dict[int, dict] = {}
        deadline = time.monotonic() + 300
        try:
            while len(got) < world and time.monotonic() < deadline:
                try:
                    rank, status, out = queue.get(timeout=1)
                except Exception:  # queue.Empty: go on unless every silent rank has died
                    silent = [p for r, p in enumerate(procs) if r not in got]
                    if all(p.exitcode is not None for p in silent):
                        break
                    continue
                got[rank] = torch.load(io.BytesIO(out)) if status == "ok" else {"crash": out}
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
        results = []
        for r, p in enumerate(procs):
            saved = got.get(r)
            if saved is None or "crash" in saved:
                path = os.path.join(folder, f"rank{r}.pt")
                saved = torch.load(path) if os.path.exists(path) else {}
                died = {"error": f"rank {r} died (exit code {p.exitcode}) or hung in this case"}
                for name, modes in plan:
                    for mode in modes:
                        if (name, mode) not in saved:
                            saved[name, mode] = died
                            died = {"not_run": f"rank {r} died in an earlier case"}
            results.append(saved)
        return results


@functools.cache
def _results(world: int) -> list[dict]:
    """Every case in every mode, and torch DDP, in one process group. The rank-dependent
    case comes last, fsdp last of all: if its ranks issue different collectives, the short
    timeout ends them (or Gloo aborts a process) and the group is not trusted after it.
    Cases left unrun by a broken group run again in a fresh one."""
    modes = [*MODES, TORCH_DDP, *TORCH_FSDP2]
    plan = [(c.name, modes) for c in CASES if world in c.worlds]
    if world in RANK_DEPENDENT.worlds:
        plan.append((RANK_DEPENDENT.name, [TORCH_DDP, "ddp", "zero", "fsdp", "fsdp_keep"]))
    results = _launch(world, plan)
    for _ in range(2):
        left = [(n, [m for m in ms if _unrun(results, n, m)]) for n, ms in plan]
        left = [(n, ms) for n, ms in left if ms]
        if not left:
            break
        again = _launch(world, left)
        for mine, new in zip(results, again, strict=True):
            mine.update(new)
    return results


def _unrun(results: list[dict], name: str, mode: str) -> bool:
    return any("not_run" in r.get((name, mode), {}) for r in results)


@functools.cache
def _single(name: str, world: int) -> dict[str, Any]:
    """One process. The whole global batch per step; or, for `by_rank` cases, each rank's
    slice in turn with loss / P (the gradient torch DDP averages), BatchNorm statistics
    starting each rank's forward from rank 0's (torch DDP broadcasts rank 0's buffers
    before every forward) and ending each step as rank 0's."""
    case = BY_NAME[name]
    model = _build(case)
    opt = _optimizer(case, list(model.named_parameters()))
    for i, (x, y) in enumerate(case.batches()):
        if not case.by_rank:
            case.step(_SingleRunner(model, None), x, y, i)
        else:
            rank0 = [b.clone() for b in model.buffers()]
            start = rank0
            for r in range(world):
                with torch.no_grad():
                    for b, v in zip(model.buffers(), start, strict=True):
                        b.copy_(v)
                xr, yr = rank_slice(x, r, world), rank_slice(y, r, world)
                case.step(_SingleRunner(model, r, 1.0 / world), xr, yr, i)
                if r == 0:
                    rank0 = [b.clone() for b in model.buffers()]
            with torch.no_grad():
                for b, v in zip(model.buffers(), rank0, strict=True):
                    b.copy_(v)
        if case.clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), case.clip)
        opt.step()
        opt.zero_grad()
    out: dict[str, Any] = {"state": _state(model)}
    if case.eval_input:
        model.eval()
        with torch.no_grad():
            out["eval"] = model(_eval_batch())
    return out


def _initial(name: str) -> dict[str, torch.Tensor]:
    return _state(_build(BY_NAME[name]))


def _ok(result: dict[str, Any], what: str = "") -> dict[str, Any]:
    if "not_run" in result:
        pytest.fail(f"{what}not run: {result['not_run']}")
    if "error" in result:
        pytest.fail(f"{what}{result['error']}")
    return result


def _torch_ddp(results: list[dict], name: str) -> list[dict]:
    return [_ok(r[name, TORCH_DDP], "the torch DDP reference failed: ") for r in results]


def _check_trained(
    case: Case,
    by_rank: list[dict[str, Any]],
    world: int,
    ddp: list | None,
    fsdp2: list | None = None,
):
    """Every rank's result against the one-process run, torch DDP and torch FSDP2 (when
    given)."""
    want = _single(case.name, world)
    init = _initial(case.name)
    for r, got in enumerate(by_rank):
        got = _ok(got)
        try:
            assert_state_close(got["state"], want["state"])
            if ddp is not None:
                assert_state_close(got["state"], ddp[r]["state"])
            if fsdp2 is not None:
                assert_state_close(got["state"], fsdp2[r]["state"])
        except AssertionError as e:
            raise AssertionError(f"rank {r}: {e}") from None
        for k in case.untouched:  # never used by any rank: no gradient, no step at all
            assert torch.equal(got["state"][k], init[k]), f"rank {r}: {k} changed"
        if case.eval_input:
            # the same parameters and buffers on every rank: the same output, bit for bit
            assert torch.equal(got["eval"], by_rank[0]["eval"]), f"rank {r}: eval output"
            torch.testing.assert_close(got["eval"], want["eval"], atol=1e-5, rtol=1e-4)
            if ddp is not None:
                torch.testing.assert_close(got["eval"], ddp[r]["eval"], atol=1e-5, rtol=1e-4)


# ---------------------------------------------------------------------------------------
# Tests


def _fsdp2(results: list[dict], name: str, mode: str) -> list[dict]:
    """torch FSDP2's results: with units kept gathered for fsdp_keep, freed otherwise."""
    which = "torch_fsdp2_keep" if mode == "fsdp_keep" else "torch_fsdp2"
    return [_ok(r[name, which], "the torch FSDP2 reference failed: ") for r in results]


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize(
    ("world", "name"), [(w, c.name) for w in (2, 3, 4) for c in CASES if w in c.worlds]
)
def test_pattern(world, mode, name):
    case = BY_NAME[name]
    results = _results(world)
    ddp = _torch_ddp(results, name) if case.ddp is not None else None
    fsdp2 = _fsdp2(results, name, mode) if case.fsdp2 is not None else None
    _check_trained(case, [r[name, mode] for r in results], world, ddp, fsdp2)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("world", WORLDS)
def test_plain_backward_is_engine_backward_exactly(world, mode):
    for r in _results(world):
        plain, engine = _ok(r["plain_backward", mode]), _ok(r["engine_backward", mode])
        for k, v in engine["state"].items():
            assert torch.equal(plain["state"][k], v), k


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("world", WORLDS)
def test_rank_dependent_unit(world, mode):
    """Pattern 4: ddp and zero train like torch DDP (find_unused_parameters=True). fsdp
    either does too, or refuses on every rank, before any parameter changed, with one
    error naming the unit (`extra`) and the ranks that skipped it; it never hangs."""
    case = RANK_DEPENDENT
    results = _results(world)
    ddp = _torch_ddp(results, case.name)
    got = [r[case.name, mode] for r in results]
    trained = ["state" in g for g in got]
    if not mode.startswith("fsdp") or all(trained):
        _check_trained(case, got, world, ddp)
        return
    assert not any(trained), (
        f"ranks that trained: {trained}; the others: {got[trained.index(False)]}"
    )
    for r, g in enumerate(got):
        message = g.get("error", g.get("not_run", ""))
        assert "extra" in message, f"rank {r}: the error does not name the unit: {message}"
        for s in range(1, world):  # the ranks that skipped it
            assert re.search(rf"\b{s}\b", message), f"rank {r}: rank {s} not named: {message}"
        assert g.get("unchanged") is True, f"rank {r}: parameters or optimizer state changed"


@pytest.mark.parametrize("name", [c.name for c in [*CASES, RANK_DEPENDENT] if c.ddp is not None])
@pytest.mark.parametrize("world", WORLDS)
def test_references_agree(world, name):
    """The yardsticks themselves: torch DDP and one process train alike."""
    _check_trained(BY_NAME[name], _torch_ddp(_results(world), name), world, None)


@pytest.mark.parametrize("which", list(TORCH_FSDP2))
@pytest.mark.parametrize(
    ("world", "name"), [(w, c.name) for w in (2, 3, 4) for c in CASES if c.fsdp2 and w in c.worlds]
)
def test_fsdp2_reference_agrees(world, name, which):
    """torch FSDP2 trains the shapes from its own suite as one process does."""
    results = _results(world)
    got = [_ok(r[name, which], "the torch FSDP2 reference failed: ") for r in results]
    _check_trained(BY_NAME[name], got, world, None)
