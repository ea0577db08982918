"""fp16's dynamic loss scaling, decided on the device: the scale and its counters
(`LossScaler`), and the optimizers that skip an overflowed step by themselves
(`fused_for_scaling`, `can_skip_on_device`, `skipping_if`), and the fp16 step itself
(`LossScaler.unscale_agreed`, `LossScaler.step`), which Engine.step (engine.py) hands
over to. [Note: dynamic loss scaling], below, says how; the dtypes are precision.py's.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.optim.optimizer import _get_fused_kernels_supported_devices  # torch's own list

from trainer import comm
from trainer.errors import ConfigError
from trainer.observe import host

# [Note: dynamic loss scaling]
# fp16 has 5 exponent bits: gradients below ~6e-8 flush to zero. Multiplying the loss by a
# large factor S moves them into range; the gradients are divided by S again before
# clipping or the optimizer see them. If any gradient on any rank is inf/NaN, S was too
# large: every rank skips the step (one 1-element AllReduce makes them agree) and S is
# halved. After `growth_interval` good steps in a row S doubles. This is the algorithm of
# `torch.amp.GradScaler`; bf16 has fp32's exponent range and needs no scaling.
#
# Everything is decided on the device, with no host read in a step, as GradScaler does
# with optimizers that can skip their own update (`_step_supports_amp_scaling`):
# - S, the count of good steps and the count of skipped steps are device tensors;
#   `torch._amp_foreach_non_finite_check_and_unscale_` divides the gradients by S and
#   sets the found-inf flag, `torch._amp_update_scale_` halves or grows S.
# - The flag, summed over ranks and clamped to 0 or 1 (the kernels skip on exactly 1), is
#   handed to the optimizer as `optimizer.found_inf`: torch's fused Adam, AdamW and SGD
#   then leave parameters and state untouched on the device, and take back the step
#   counters they incremented. So fp16 builds these optimizers fused where torch has the
#   kernels for the device (`fused_for_scaling`; their rounding differs slightly from the
#   foreach kernels'); fp32 and bf16 keep theirs as configured.
# - The modes run their usual step around it: zero's AllGather after a skipped step
#   gathers the unchanged shards, ddp and fsdp cast the unchanged masters.
# - `engine.step()` returns the device flag "stepped"; the lr schedule counts only the
#   steps taken, on the device ([Note: the schedule counts taken steps] in optim.py); the
#   metrics leave a skipped step's gradient norm out there, and read the scale and the
#   count of skipped steps with the interval's other figures, at log intervals.
# Two corners of torch's fused SGD with momentum: a skipped first step leaves uninitialised
# momentum buffers, and a parameter whose first gradient comes after the others' crashes
# it. Zero buffers created before each step (`_fill_momentum`) avoid both and give the
# same first step as torch's (buf = grad) when dampening is 0; SGD with dampening is
# therefore not built fused.
# Fallback: an optimizer that cannot skip on the device (not fused: a configured
# `foreach=True` or `fused=False`, another class, a device without fused kernels) is
# stepped or not by the host, which reads the agreed flag: one read per step, counted
# as "fp16 found_inf", the step then returning a Python bool.


class LossScaler:
    """Dynamic loss scaling on the device ([Note: dynamic loss scaling]); a no-op when
    disabled. `scale`, `good_steps` and `skipped` are 0-d tensors on `device`: read them
    at log intervals, not every step."""

    def __init__(
        self,
        enabled: bool = False,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        device: torch.device | str = "cpu",
    ):
        if not (init_scale > 0 and math.isfinite(init_scale)):
            raise ConfigError(f"loss_scale.init_scale={init_scale!r} must be a positive number")
        if not growth_factor > 1:
            raise ConfigError(f"loss_scale.growth_factor={growth_factor!r} must be > 1")
        if not 0 < backoff_factor < 1:
            raise ConfigError(f"loss_scale.backoff_factor={backoff_factor!r} must be in (0, 1)")
        if not (isinstance(growth_interval, int) and growth_interval >= 1):
            raise ConfigError(
                f"loss_scale.growth_interval={growth_interval!r} must be a whole number >= 1"
            )
        self.enabled = enabled
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval = growth_interval
        # fp32 and int32: what torch._amp_update_scale_ takes (as GradScaler keeps them)
        self.scale = torch.full((), float(init_scale) if enabled else 1.0, device=device)
        self.good_steps = torch.zeros((), dtype=torch.int32, device=device)  # in a row
        self.skipped = torch.zeros((), dtype=torch.int64, device=device)  # in total
        # The ranks' agreed found-inf flag, 0-d on the device, once the gradients of the
        # current backward are unscaled; None until then (the engine resets it).
        self.found_inf: torch.Tensor | None = None
        self.scaling = False  # inside `backward`, which scales the loss

    def to(self, device: torch.device | str) -> LossScaler:
        """Move the scale and counters to the device the gradients live on."""
        self.scale, self.good_steps, self.skipped = (
            t.to(device) for t in (self.scale, self.good_steps, self.skipped)
        )
        return self

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale if self.enabled else loss

    def backward(self, loss: torch.Tensor) -> None:
        """`loss.backward()`, scaled first when enabled (`engine.backward`)."""
        self.scaling = True
        try:
            self.scale_loss(loss).backward()
        finally:
            self.scaling = False

    def refuse_unscaled(self) -> None:
        """Raise where fp16 gradients arrive from a backward not started by `backward`."""
        if self.enabled and not self.scaling:
            raise ConfigError(
                "precision=fp16 needs engine.backward(loss), which scales the loss: a plain "
                "loss.backward() would let small fp16 gradients underflow to zero"
            )

    @torch.no_grad()
    def unscale_(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """Divide `grads` by the scale in place; return this rank's found-inf flag, (1,)
        fp32 on the device: 1.0 if any of them holds an inf or NaN, else 0.0."""
        found = torch.zeros(1, device=self.scale.device)
        if grads:
            # 1/S in fp64, then fp32: exact for powers of two, as GradScaler computes it
            inv = self.scale.double().reciprocal().float()
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv)
        return found

    @torch.no_grad()
    def unscale_agreed(self, grads: Callable[[], list[torch.Tensor]]) -> torch.Tensor | None:
        """Divide the gradients `grads()` returns by the scale (once per step) and return
        whether any rank holds an inf/NaN among them: a 0-d fp32 flag on the device, 1.0
        or 0.0. Without loss scaling: nothing to do, None."""
        if not self.enabled:
            return None
        if self.found_inf is None:
            found = self.unscale_(grads())  # (1,)
            if comm.world_size() > 1:  # ranks must agree, else their collectives diverge
                comm.all_reduce(found, tag="found_inf", account=False).wait()
                found.clamp_(max=1.0)  # a count of ranks; fused kernels skip on exactly 1
            self.found_inf = found.reshape(())
        return self.found_inf

    def step(
        self,
        optimizer: torch.optim.Optimizer,
        step: Callable[[], None],
        zero_grad: Callable[[], None],
    ) -> bool | torch.Tensor:
        """fp16's step, after `unscale_agreed`: `step()` (the mode's) where no rank
        overflowed, `zero_grad()` otherwise; then the scale updated. Returns the device
        flag "stepped", or a bool where the host decided ([Note: dynamic loss scaling])."""
        found_inf = self.found_inf
        if can_skip_on_device(optimizer):
            with skipping_if(optimizer, found_inf):
                step()  # the optimizer updates nothing where found_inf is 1
            stepped = found_inf == 0
        else:  # the fallback of the note: the host decides, one read per step
            stepped = host.item(found_inf, "fp16 found_inf") == 0
            if stepped:
                step()
            else:
                zero_grad()
        self.update(found_inf)
        self.found_inf = None
        return stepped

    def update(self, found_inf: torch.Tensor) -> None:
        """After each step, with the agreed 0-d flag: back off on overflow, grow after a
        run of good steps; count the skipped step. Device ops only."""
        if not self.enabled:
            return
        torch._amp_update_scale_(
            self.scale,
            self.good_steps,
            found_inf,
            self.growth_factor,
            self.backoff_factor,
            self.growth_interval,
        )
        self.skipped += found_inf.to(self.skipped.dtype)

    def total_skipped(self) -> int:
        """Steps skipped for inf/NaN gradients so far: a host read (end of a run)."""
        return int(host.item(self.skipped, "loss scaler")) if self.enabled else 0

    def state_dict(self) -> dict[str, Any]:
        """Plain Python numbers, as GradScaler saves (one host read, at a checkpoint)."""
        if not self.enabled:
            return {"enabled": False, "scale": 1.0, "good_steps": 0, "skipped": 0}
        packed = torch.stack([self.scale.double(), self.good_steps.double(), self.skipped.double()])
        scale, good, skipped = host.tolist(packed, "loss scaler")
        return {"enabled": True, "scale": scale, "good_steps": int(good), "skipped": int(skipped)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # A checkpoint of a run without scaling (fp32, bf16) leaves the initial scale.
        if self.enabled and state.get("enabled"):
            self.scale.fill_(float(state["scale"]))
            self.good_steps.fill_(int(state["good_steps"]))
            self.skipped.fill_(int(state["skipped"]))


# Optimizers whose fused variant skips its update when `optimizer.found_inf` is 1.
_FUSED_SKIPPING = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)


def fused_for_scaling(factory: Callable[..., Any], device: torch.device) -> Callable[..., Any]:
    """fp16: `factory` (a functools.partial of Adam, AdamW or SGD, as the optim configs
    build) made to build torch's fused variant, which can skip a step on the device
    ([Note: dynamic loss scaling]). Left as it is when it is another callable or class,
    when it names `fused`, `foreach` or `differentiable` itself (the user's choice
    stands), for SGD with dampening, or when torch has no fused kernels for `device`."""
    if not (isinstance(factory, functools.partial) and factory.func in _FUSED_SKIPPING):
        return factory
    kwargs = factory.keywords
    if factory.args or {"fused", "foreach", "differentiable"} & kwargs.keys():
        return factory
    if factory.func is torch.optim.SGD and kwargs.get("dampening", 0) != 0:
        return factory
    if device.type not in _get_fused_kernels_supported_devices():
        return factory
    return functools.partial(factory, fused=True)


def can_skip_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer.step()` skips its own update when handed a found-inf flag."""
    if not getattr(optimizer, "_step_supports_amp_scaling", False):
        return False
    # Fused SGD with momentum and dampening: its first step is not zero buffers' step.
    return not (
        isinstance(optimizer, torch.optim.SGD)
        and any(g["momentum"] != 0 and g["dampening"] != 0 for g in optimizer.param_groups)
    )


@contextmanager
def skipping_if(optimizer: torch.optim.Optimizer, found_inf: torch.Tensor) -> Iterator[None]:
    """`optimizer.step()` inside updates nothing when the 0-d flag `found_inf` is 1, as
    decided on the device (an optimizer for which `can_skip_on_device` holds)."""
    # At each step() call, for the parameters it steps: an offloaded step calls it once
    # per buffer ([Note: offloaded state]), and fills that buffer's momentum only.
    filling = optimizer.register_step_pre_hook(lambda opt, args, kwargs: _fill_momentum(opt))
    optimizer.found_inf = found_inf  # what GradScaler hands fused optimizers
    try:
        yield
    finally:
        del optimizer.found_inf
        filling.remove()


@torch.no_grad()
def _fill_momentum(optimizer: torch.optim.Optimizer) -> None:
    """Zero momentum buffers for SGD's parameters about to step without one (see the
    note): fused SGD then never takes its first-step path."""
    if not isinstance(optimizer, torch.optim.SGD):
        return
    for group in optimizer.param_groups:
        if group["momentum"] == 0:
            continue
        for p in group["params"]:
            if p.grad is not None and optimizer.state[p].get("momentum_buffer") is None:
                optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p)
