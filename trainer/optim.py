"""Optimizer-side options of the `optim` config group that are not the optimizer's own
arguments: weight-decay groups, the learning-rate schedule and gradient clipping.

    optimizer = optimizer_factory(cfg.optim)                 # a callable for build_engine
    engine = build_engine(model, mode, optimizer, param_options=param_options(cfg.optim))
    scheduler = lr_scheduler(engine.optimizer, cfg.optim, cfg.train.steps)

Clipping itself is `engine.clip_grad_norm_` (trainer/parallel/engine.py): only the
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
from trainer.parallel.engine import OptimizerFactory, ParamGroupFn

# Keys of the optim group read by the trainer; everything else goes to the optimizer.
TRAINER_KEYS = ("clip_grad_norm", "schedule", "warmup_steps", "min_lr_ratio", "no_decay_bias_norm")
SCHEDULES = ("constant", "cosine")


def optimizer_factory(optim: DictConfig) -> OptimizerFactory:
    """The optimizer partial from `optim`, the trainer's own keys removed."""
    kwargs = OmegaConf.to_container(optim, resolve=True)
    for key in TRAINER_KEYS:
        kwargs.pop(key, None)
    return instantiate(kwargs)


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
    optimizer: torch.optim.Optimizer, optim: DictConfig | dict[str, Any], steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """LambdaLR over the engine's optimizer (its shards' groups in zero/fsdp: the lr is
    per group, so sharding does not change it). Call `.step()` after each optimizer step."""
    factor = lr_lambda(
        optim.get("schedule", "constant"),
        steps,
        int(optim.get("warmup_steps", 0)),
        float(optim.get("min_lr_ratio", 0.0)),
    )
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
