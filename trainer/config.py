"""Checks on the composed config, and the mapping from config groups to constructors."""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf

from trainer.errors import ConfigError


def _positive(name: str, value: Any) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{name}={value!r} must be a positive number")


def validate(cfg: DictConfig, world_size: int) -> None:
    _positive("train.steps", cfg.train.steps)
    _positive("train.batch_size", cfg.train.batch_size)
    _positive("train.log_every", cfg.train.log_every)
    if "lr" in cfg.optim:
        _positive("optim.lr", cfg.optim.lr)
    if "bucket_mb" in cfg.mode:
        _positive("mode.bucket_mb", cfg.mode.bucket_mb)
    if cfg.train.batch_size % world_size:
        raise ConfigError(
            f"train.batch_size={cfg.train.batch_size} is not divisible by world size "
            f"{world_size}; use a multiple of {world_size}"
        )


def engine_options(cfg: DictConfig) -> dict[str, Any]:
    """Everything under mode/ except its name goes to the engine's constructor."""
    opts = OmegaConf.to_container(cfg.mode, resolve=True)
    opts.pop("name")
    return opts
