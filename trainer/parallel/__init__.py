"""build_engine(): one entry point for every data-parallel mode."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from trainer import comm
from trainer.errors import ConfigError
from trainer.parallel.ddp import DDPEngine
from trainer.parallel.engine import Engine, OptimizerFactory, ParamGroupFn
from trainer.parallel.fsdp import FSDPEngine
from trainer.parallel.zero import ZeroEngine
from trainer.precision import Precision
from trainer.scaling import LossScaler, fused_for_scaling

ENGINES: dict[str, type[Engine]] = {"ddp": DDPEngine, "zero": ZeroEngine, "fsdp": FSDPEngine}


def build_engine(
    model: nn.Module,
    mode: str,
    optimizer: OptimizerFactory,
    precision: str = "fp32",
    reduce_dtype: str = "fp32",
    loss_scale: dict[str, Any] | None = None,
    param_options: ParamGroupFn | None = None,
    **options: Any,
) -> Engine:
    """Wrap `model` (fp32) for `mode`; `optimizer` is called with the parameters it should
    step. `precision` (fp32 | bf16 | fp16) is the dtype forward and backward run in, with
    fp32 masters for the optimizer; `reduce_dtype` the dtype gradients are reduced in;
    `loss_scale` the options of fp16's dynamic loss scaling (trainer/scaling.py); in
    fp16 Adam, AdamW and SGD partials build torch's fused variant where it exists, which
    skips an overflowed step on the device ([Note: dynamic loss scaling]).
    `param_options(name, param)` gives a parameter's optimizer options (e.g.
    {"weight_decay": 0.0}); the optimizer gets one param group per distinct options.
    `options` are the mode's own (bucket_mb, reshard_after_forward, ...)."""
    mp = Precision.of(precision, reduce_dtype)
    fp16 = mp.param_dtype == torch.float16
    scaler = LossScaler(enabled=fp16, **(loss_scale or {}))
    if mode not in ENGINES:
        raise ConfigError(f"mode={mode!r} is not one of {', '.join(sorted(ENGINES))}")
    engine_cls = ENGINES[mode]
    n, p = sum(t.numel() for t in model.parameters()), comm.world_size()
    if engine_cls.shards_parameters and n < p:
        raise ConfigError(
            f"the model has {n} parameter(s), fewer than the {p} ranks to shard them over; "
            "use fewer ranks or mode=ddp"
        )
    floating = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if mp.mixed and floating - {torch.float32}:
        raise ConfigError(
            f"precision={precision} keeps fp32 masters of an fp32 model; this model's "
            f"parameters are {sorted(map(str, floating))}"
        )
    if fp16:
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        optimizer = fused_for_scaling(optimizer, device)
    return engine_cls(
        model, optimizer, precision=mp, scaler=scaler, param_options=param_options, **options
    )


__all__ = ["ENGINES", "Engine", "build_engine"]
