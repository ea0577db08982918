"""build_engine(): one entry point for every data-parallel mode."""

from __future__ import annotations

from typing import Any

from torch import nn

from trainer import comm
from trainer.errors import ConfigError
from trainer.parallel.ddp import DDPEngine
from trainer.parallel.engine import Engine, OptimizerFactory
from trainer.parallel.fsdp import FSDPEngine
from trainer.parallel.zero import ZeroEngine

ENGINES: dict[str, type[Engine]] = {"ddp": DDPEngine, "zero": ZeroEngine, "fsdp": FSDPEngine}


def build_engine(
    model: nn.Module, mode: str, optimizer: OptimizerFactory, **options: Any
) -> Engine:
    """Wrap `model` for `mode`; `optimizer` is called with the parameters it should step."""
    if mode not in ENGINES:
        raise ConfigError(f"mode={mode!r} is not one of {', '.join(sorted(ENGINES))}")
    engine_cls = ENGINES[mode]
    n, p = sum(t.numel() for t in model.parameters()), comm.world_size()
    if engine_cls.shards_parameters and n < p:
        raise ConfigError(
            f"the model has {n} parameter(s), fewer than the {p} ranks to shard them over; "
            "use fewer ranks or mode=ddp"
        )
    return engine_cls(model, optimizer, **options)


__all__ = ["ENGINES", "Engine", "build_engine"]
