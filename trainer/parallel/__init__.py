"""build_engine(): one entry point for every data-parallel mode."""

from __future__ import annotations

from typing import Any

from torch import nn

from trainer.errors import ConfigError
from trainer.parallel.ddp import DDPEngine
from trainer.parallel.engine import Engine, OptimizerFactory
from trainer.parallel.fsdp import FSDPEngine
from trainer.parallel.zero import ZeroEngine

ENGINES: dict[str, type[Engine]] = {"ddp": DDPEngine}
ENGINES["fsdp"] = FSDPEngine
ENGINES["zero"] = ZeroEngine


def build_engine(
    model: nn.Module, mode: str, optimizer: OptimizerFactory, **options: Any
) -> Engine:
    """Wrap `model` for `mode`; `optimizer` is called with the parameters it should step."""
    if mode not in ENGINES:
        raise ConfigError(f"mode={mode!r} is not one of {', '.join(sorted(ENGINES))}")
    return ENGINES[mode](model, optimizer, **options)


__all__ = ["ENGINES", "Engine", "build_engine"]
