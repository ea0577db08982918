"""Mixed precision: which dtype computes, which one communicates gradients, and the loss
scaling that fp16 needs.

    precision = Precision.of("bf16", reduce_dtype="fp32")
    engine = build_engine(model, mode, optimizer, precision="bf16", reduce_dtype="fp32")

[Note: master weights]
With `param_dtype` bf16 or fp16 the module's parameters (and floating buffers) are cast
to it, so forward and backward run in that dtype and produce gradients in it. Each mode
keeps fp32 master copies of the parameters it owns (ddp all of them, zero and fsdp their
shard) and builds the optimizer over those, so its state is fp32 too and small updates
are not rounded away. After a step the masters are cast back: ddp copies them into the
module, zero casts its shard into the flat parameter buffer and AllGathers that (half
the bytes of fp32), fsdp casts its shard right before each AllGather of a unit. Gradients
are reduced in `reduce_dtype` (fp32 by default: summing P low-precision values loses
bits) and land in fp32 next to the masters. Inputs that are floating point are cast to
`param_dtype` on the way in and floating outputs back to fp32 on the way out, so the loss
is computed in fp32.

[Note: dynamic loss scaling]
fp16 has 5 exponent bits: gradients below ~6e-8 flush to zero. Multiplying the loss by a
large factor S moves them into range; the gradients are divided by S again before
clipping or the optimizer see them. If any gradient on any rank is inf/NaN, S was too
large: every rank skips the step (one 1-element AllReduce makes them agree) and S is
halved. After `growth_interval` good steps in a row S doubles. This is the algorithm of
`torch.amp.GradScaler`; bf16 has fp32's exponent range and needs no scaling.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from trainer.errors import ConfigError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def dtype_of(name: str, key: str = "precision") -> torch.dtype:
    if name not in DTYPES:
        raise ConfigError(f"{key}={name!r} is not one of {', '.join(DTYPES)}")
    return DTYPES[name]


@dataclass(frozen=True)
class Precision:
    param_dtype: torch.dtype = torch.float32  # forward/backward, AllGathered parameters
    reduce_dtype: torch.dtype = torch.float32  # gradient AllReduce / ReduceScatter

    @classmethod
    def of(cls, precision: str = "fp32", reduce_dtype: str = "fp32") -> Precision:
        return cls(dtype_of(precision), dtype_of(reduce_dtype, "mode.reduce_dtype"))

    @property
    def mixed(self) -> bool:
        """True when the module computes in a lower precision than its fp32 masters."""
        return self.param_dtype != torch.float32

    def cast_in(self, x: Any) -> Any:
        """Floating tensors to `param_dtype` (integer token ids stay as they are)."""
        return _cast(x, self.param_dtype) if self.mixed else x

    def cast_out(self, x: Any) -> Any:
        """Floating tensors to fp32, so that the loss is computed in fp32."""
        return _cast(x, torch.float32) if self.mixed else x


def _cast(x: Any, dtype: torch.dtype) -> Any:
    if isinstance(x, torch.Tensor):
        return x.to(dtype) if x.is_floating_point() else x
    if isinstance(x, tuple | list):
        return type(x)(_cast(v, dtype) for v in x)
    if isinstance(x, dict):
        return {k: _cast(v, dtype) for k, v in x.items()}
    return x


@torch.no_grad()
def cast_module(module: torch.nn.Module, dtype: torch.dtype) -> None:
    """Cast floating parameters and buffers in place, keeping the Parameter objects (the
    engines registered hooks on them)."""
    for t in list(module.parameters()) + list(module.buffers()):
        if t.is_floating_point() and t.dtype != dtype:
            t.data = t.data.to(dtype)


class LossScaler:
    """Dynamic loss scaling ([Note: dynamic loss scaling]); a no-op when disabled."""

    def __init__(
        self,
        enabled: bool = False,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
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
        self.scale = float(init_scale) if enabled else 1.0
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval = growth_interval
        self.good_steps = 0  # finite steps since the scale last changed
        self.skipped = 0  # steps skipped for inf/NaN gradients, in total

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale if self.enabled else loss

    def update(self, found_inf: bool) -> None:
        """After each step: back off on overflow, grow after a run of good steps."""
        if not self.enabled:
            return
        if found_inf:
            self.scale *= self.backoff_factor
            self.good_steps = 0
            self.skipped += 1
            return
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "enabled": self.enabled,
            "scale": self.scale,
            "good_steps": self.good_steps,
            "skipped": self.skipped,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # A checkpoint of a run without scaling (fp32, bf16) leaves the initial scale.
        if self.enabled and state.get("enabled"):
            self.scale = float(state["scale"])
            self.good_steps = int(state["good_steps"])
            self.skipped = int(state["skipped"])


class GradAccumulator:
    """Gradients summed across no_sync micro-batches in the reduction dtype, when the
    parameters compute in a lower one (as FSDP2 does): k bf16 gradients added in bf16
    would lose bits at every addition. Used by zero and fsdp, which keep the full
    gradients of a micro-batch on the module's parameters (ddp adds them into its
    reduce-dtype buckets directly)."""

    def __init__(self) -> None:
        self._sums: dict[int, torch.Tensor] = {}

    def add(self, p: torch.nn.Parameter, dtype: torch.dtype) -> None:
        """Move `p.grad` into the running sum (nothing to do when it is already `dtype`:
        autograd then accumulates in `p.grad` itself)."""
        if p.grad is None or p.grad.dtype == dtype:
            return
        total = self._sums.get(id(p))
        if total is None:
            self._sums[id(p)] = p.grad.to(dtype)
        else:
            total.add_(p.grad)
        p.grad = None

    @torch.no_grad()
    def take(self, p: torch.nn.Parameter) -> torch.Tensor | None:
        """`p`'s whole gradient (the running sum plus `p.grad`), dropping both; None when
        there is none."""
        total = self._sums.pop(id(p), None)
        grad, p.grad = p.grad, None
        if total is None:
            return grad
        return total if grad is None else total.add_(grad)

    def tensors(self) -> list[torch.Tensor]:
        return list(self._sums.values())

    def clear(self) -> None:
        self._sums.clear()
