"""Types of the top-level config, registered with Hydra's ConfigStore as the schema that
conf/config.yaml extends: a value of the wrong type (`seed=abc`, `train.steps=1.5`,
`dist.timeout_s=ten`) is refused for every key at once when the config is composed.
Ranges and rules across keys stay in trainer/config.py. The groups (mode, model, data,
optim) stay untyped here: their keys depend on the choice."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore


@dataclass
class Train:
    steps: int = 3000
    batch_size: int = 128
    grad_accum_steps: int = 1
    log_every: int = 20
    eval_every: int = 0
    eval_batches: int | None = None
    on_nonfinite: str = "stop"
    save_final: bool = True


@dataclass
class Dist:
    backend: str = "auto"
    timeout_s: int = 600  # whole seconds: dist.py names it as given


@dataclass
class Ckpt:
    every: int = 500
    dir: str | None = None
    keep: int = 2


@dataclass
class Launcher:
    nproc: int = 1
    max_restarts: int = 0


@dataclass
class Config:
    mode: Any = None
    model: Any = None
    data: Any = None
    optim: Any = None
    seed: int = 0
    precision: str = "fp32"
    loss_scale: Any = None
    profile: bool = False
    train: Train = field(default_factory=Train)
    dist: Dist = field(default_factory=Dist)
    ckpt: Ckpt = field(default_factory=Ckpt)
    resume: str | None = None
    run: Any = None
    launcher: Launcher = field(default_factory=Launcher)


ConfigStore.instance().store(name="schema", node=Config)
