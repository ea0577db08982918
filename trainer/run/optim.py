"""Optimizer-side options of the `optim` config group that are not the optimizer's own
arguments: weight-decay groups, the learning-rate schedule and gradient clipping.

    optimizer = optimizer_factory(cfg.optim)                 # a callable for build_engine
    engine = build_engine(model, mode, optimizer, param_options=param_options(cfg.optim))
    scheduler = lr_scheduler(engine.optimizer, cfg.optim, cfg.train.steps,
                             on_device=engine.skips_on_device)
    scheduler.step(engine.step())                            # counts the steps taken

Clipping itself is `engine.clip_grad_norm_` (trainer/parallel/clipping.py): only the
engine knows where its gradients live.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch import nn

from trainer.errors import ConfigError
from trainer.observe import host
from trainer.parallel.engine import OptimizerFactory, ParamGroupFn

# Keys of the optim group read by the trainer; everything else goes to the optimizer.
TRAINER_KEYS = ("clip_grad_norm", "schedule", "warmup_steps", "min_lr_ratio", "no_decay_bias_norm")
SCHEDULES = ("constant", "cosine")


def optimizer_factory(optim: DictConfig) -> OptimizerFactory:
    """The optimizer partial from `optim`, the trainer's own keys removed, and the
    arguments left null (trainer/config/schema.py's `foreach`, `fused`): torch's own default
    then, and fp16 free to build the optimizer fused (scaling.fused_for_scaling).
    conf/optim/adamw.yaml sets `fused: true`."""
    kwargs = OmegaConf.to_container(optim, resolve=True)
    for key in TRAINER_KEYS:
        kwargs.pop(key, None)
    if kwargs.get("foreach") and kwargs.get("fused"):  # torch's own error is a traceback
        raise ConfigError(
            "optim.foreach=true and optim.fused=true name two implementations; "
            "set optim.fused=null to use foreach"
        )
    return instantiate({k: v for k, v in kwargs.items() if v is not None})


def param_options(optim: DictConfig) -> ParamGroupFn | None:
    """Per-parameter optimizer options for build_engine: no weight decay on biases and
    norms when `optim.no_decay_bias_norm` is true, else None (one param group)."""
    return no_decay_bias_norm if optim.get("no_decay_bias_norm", False) else None


def no_decay_bias_norm(name: str, p: nn.Parameter) -> dict[str, Any]:
    """Biases and normalisation weights, the parameters with fewer than two dimensions,
    are not decayed: decay would pull a LayerNorm's gain towards 0, not its identity.
    Every mode honours it: ddp steps parameters one by one; zero and fsdp keep such
    parameters in flat buffers of their own, so no shard mixes the two groups."""
    return {"weight_decay": 0.0} if p.ndim < 2 else {}


def lr_lambda(
    schedule: str, steps: int, warmup_steps: int = 0, min_lr_ratio: float = 0.0
) -> Callable[[int], float]:
    """Multiplier of the base lr for optimizer step `i` (0-based), as LambdaLR wants it.

    Linear warm-up from 1/warmup_steps to 1 over the first `warmup_steps` steps, then
    `constant` (1) or `cosine`: half a cosine from 1 down to `min_lr_ratio` at the last step.
    """
    if schedule not in SCHEDULES:
        raise ConfigError(f"optim.schedule={schedule!r} is not one of {', '.join(SCHEDULES)}")

    def factor(i: int) -> float:
        if i < warmup_steps:
            return (i + 1) / warmup_steps
        if schedule == "constant":
            return 1.0
        decay_steps = max(steps - warmup_steps - 1, 1)
        progress = min((i - warmup_steps) / decay_steps, 1.0)  # 0 -> 1
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def lr_scheduler(
    optimizer: torch.optim.Optimizer,
    optim: DictConfig | dict[str, Any],
    steps: int,
    on_device: bool = False,
) -> TakenStepsLR:
    """The schedule over the engine's optimizer (its shards' groups in zero/fsdp: the lr
    is per group, so sharding does not change it). Call `.step(engine.step())` after each
    step. `on_device`: the engine decides on the device whether a step was taken
    (`engine.skips_on_device`), so the schedule follows it there."""
    factor = lr_lambda(
        optim.get("schedule", "constant"),
        steps,
        int(optim.get("warmup_steps", 0)),
        float(optim.get("min_lr_ratio", 0.0)),
    )
    return TakenStepsLR(optimizer, factor, steps, on_device)


class TakenStepsLR(torch.optim.lr_scheduler.LambdaLR):
    """LambdaLR whose position is the number of optimizer steps taken: `step(taken)`
    with what `engine.step()` returned advances it only where the step was taken.

    [Note: the schedule counts taken steps]
    A step skipped for fp16 overflow must not advance the schedule, or the warm-up and
    the decay would run ahead of the updates. When the host knows (fp32, bf16, and the
    fp16 fallback of [Note: dynamic loss scaling] in scaling.py) `taken` is a bool and
    this is plain LambdaLR, stepped on taken steps only, with host floats as lrs. When
    the device decides (`on_device`), `taken` is a 0-d bool tensor and nothing is read:
    the steps taken since the host last counted them are kept on the device (`_pending`),
    each group's lr is a 0-d device tensor, base_lr × the lambda's value at position
    `last_epoch + _pending`, looked up in a table of the lambda's values at 0..steps that
    was computed once on the host (in fp64: the same doubles LambdaLR multiplies; 8 bytes
    a step on the device), and torch's fused optimizers read that tensor in their
    kernels. Each step thus gets the lr a host-decided skip would have given it: bitwise
    on CPU, where the kernels read a tensor lr as a double; on CUDA they read it as fp32,
    so it is rounded to fp32 there. `state_dict()` adds the pending steps to `last_epoch`
    (one host read, at checkpoints), so a checkpoint holds the steps taken whatever the
    precision, and a plain LambdaLR state loads too.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        lr_lambda: Callable[[int], float],
        steps: int,
        on_device: bool = False,
    ):
        # steps taken since `last_epoch` was brought up to date; None: lrs on the host
        self._pending: torch.Tensor | None = None
        super().__init__(optimizer, lr_lambda)
        if not on_device:
            return
        device = optimizer.param_groups[0]["params"][0].device
        # CUDA kernels read a tensor lr as fp32; the CPU ones as a double (lr.item()).
        self._lr_dtype = torch.float32 if device.type == "cuda" else torch.float64
        values = {id(f): [f(i) for i in range(steps + 1)] for f in self.lr_lambdas}
        self._table = torch.tensor(
            [values[id(f)] for f in self.lr_lambdas], dtype=torch.float64, device=device
        )  # (groups, steps + 1)
        self._pending = torch.zeros((), dtype=torch.int64, device=device)
        self._set_lrs()

    def step(self, taken: bool | torch.Tensor = True) -> None:  # type: ignore[override]
        """Advance by one if the step was taken (`engine.step()`'s return value)."""
        if self._pending is None:  # lrs on the host
            if isinstance(taken, torch.Tensor):  # a device flag: read it, counted
                taken = bool(host.item(taken, "lr schedule"))
            if taken:
                super().step()
            return
        self._step_count += 1
        self._pending += taken
        self._set_lrs()

    def _set_lrs(self) -> None:
        """Each group's lr at position `last_epoch + _pending`, as fresh device tensors
        (not written in place: the lr a step used stays what it was)."""
        last = self._table.shape[1] - 1  # the loop never goes past it; clamped all the same
        at = (self._pending + self.last_epoch).clamp(0, last).reshape(1)
        factors = self._table.index_select(1, at).reshape(-1)  # (groups,)
        self._last_lr = [
            (factors[i] * base).to(self._lr_dtype) for i, base in enumerate(self.base_lrs)
        ]
        for group, lr in zip(self.optimizer.param_groups, self._last_lr, strict=True):
            group["lr"] = lr

    def rebase(self, base_lrs: list[float]) -> None:
        """Go on from the current position with these base lrs: each group's lr, and
        `get_last_lr()`, become base x the lambda's value at `last_epoch`, host floats as
        LambdaLR computes them (a resumed run's configured lr over the checkpoint's)."""
        self.base_lrs = list(base_lrs)
        for group, base, factor in zip(
            self.optimizer.param_groups, self.base_lrs, self.lr_lambdas, strict=True
        ):
            group["lr"] = base * factor(self.last_epoch)
        self._last_lr = [g["lr"] for g in self.optimizer.param_groups]

    def state_dict(self) -> dict[str, Any]:
        """LambdaLR's state, `last_epoch` counting every step taken so far."""
        state = {k: v for k, v in super().state_dict().items() if k not in _DEVICE_KEYS}
        if self._pending is not None:
            # Caught up with the device (one read); plain floats, as LambdaLR keeps them.
            state["last_epoch"] += int(host.item(self._pending, "lr schedule"))
            state["_last_lr"] = [
                base * f(state["last_epoch"])
                for base, f in zip(self.base_lrs, self.lr_lambdas, strict=True)
            ]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict({k: v for k, v in state.items() if k not in _DEVICE_KEYS})
        if self._pending is not None:  # `last_epoch` is the position again
            self._pending.zero_()
            self._set_lrs()


# What only this process's device schedule holds: never saved, never loaded.
_DEVICE_KEYS = ("_pending", "_table", "_lr_dtype")
