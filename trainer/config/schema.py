"""Types of the config, registered with Hydra's ConfigStore: a value of the wrong type
(`seed=abc`, `train.steps=1.5`, `mode.bucket_mb=abc`, `mode.reshard_after_forward=maybe`)
is refused for every key at once when the config is composed, and a key no choice has
(`mode.foo=1`) too. Ranges and rules across keys stay in trainer/config/checks.py.

- The top level (`schema`) is what conf/config.yaml extends.
- mode/ and optim/: one dataclass per choice, stored in the group as `<choice>_schema`;
  each conf/<group>/<choice>.yaml names its own in its defaults list. An optim choice
  holds its optimizer's arguments and the trainer's own options that conf/config.yaml
  merges into every choice (trainer/run/optim.py, TRAINER_KEYS); an argument left null is
  not passed.
- model/ and data/ stay untyped: each choice's keys are the arguments of its own
  `_target_` (a model class, a dataset function), so a schema would repeat every
  signature; hydra.utils.instantiate checks the arguments when it calls the target, and
  config.py checks the sizes. A new optim or mode file without a schema works untyped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf


@dataclass
class Train:
    steps: int = 3000
    batch_size: int = 128
    grad_accum_steps: int = 1
    log_every: int = 20
    peak_every: int = 200
    eval_every: int = 0
    eval_batches: int | None = None
    on_nonfinite: str = "stop"
    save_final: bool = True
    compile: bool = False
    compile_backend: str = "inductor"
    meta_build: bool = True


@dataclass
class Dist:
    backend: str = "auto"
    timeout_s: int = 600  # whole seconds: dist.py names it as given


class _Ckpt:  # made a dataclass below
    every: int = 500
    dir: str | None = None
    keep: int = 2
    buffer_mb: float = 64.0


# `ckpt.async` ([Note: async save] in trainer/checkpoint/background.py): `async` is a
# Python keyword, so the field is added by name (read as cfg.ckpt["async"]), and the class
# has no generated __init__, __repr__ or __eq__ (their code could not name it); OmegaConf
# needs none.
_Ckpt.__annotations__["async"] = "bool"
setattr(_Ckpt, "async", False)
Ckpt = dataclass(init=False, repr=False, eq=False)(_Ckpt)


@dataclass
class Comm:
    link_gbps: float | None = None  # a simulated link (trainer/comm/collectives.py)
    latency_us: float = 0.0


@dataclass
class Launcher:
    nproc: int = 1
    max_restarts: int = 0


@dataclass
class Ft:
    enabled: bool = False
    replica_group: int = 0
    replica_groups: int = 1
    min_groups: int = 1
    lighthouse: str | None = None
    advertise_host: str | None = None  # null: the address routing to the Lighthouse
    timeout_s: float = 30.0
    quorum_timeout_s: float = 60.0
    join_timeout_s: float = 60.0
    connect_timeout_s: float = 10.0
    heartbeat_ms: int = 100
    stall_timeout_s: float = 300.0
    # semi-synchronous training across the groups (trainer/comm/diloco.py)
    semi_sync: str | None = None  # null (every step) | local_sgd | diloco
    sync_steps: int = 50  # H
    outer_lr: float = 0.7
    outer_momentum: float = 0.9  # Nesterov
    fragments: int = 1  # F
    fragment_sync_delay: int = 0  # tau
    fragment_update_alpha: float = 0.0
    pseudo_grad_dtype: str = "fp32"  # fp32 | bf16 | int8


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
    comm: Comm = field(default_factory=Comm)
    ft: Ft = field(default_factory=Ft)


# mode/: the options of each engine (trainer/parallel/), as conf/mode/*.yaml sets them.


@dataclass
class DdpMode:
    name: str = "ddp"
    bucket_mb: float = 25.0
    reduce_dtype: str = "fp32"
    quant_block: int = 256
    error_feedback: bool = False
    expert_parallel: int = 1
    offload: str | None = None  # refused: ddp replicates every state


@dataclass
class ZeroMode:
    name: str = "zero"
    bucket_mb: float = 25.0
    reduce_dtype: str = "fp32"
    gather_dtype: str | None = None
    quant_block: int = 256
    error_feedback: bool = False
    shard_group_size: int | None = None
    expert_parallel: int = 1
    offload: str | None = None
    offload_dir: str | None = None


@dataclass
class FsdpMode:
    name: str = "fsdp"
    reshard_after_forward: bool = True
    unit_classes: list[str] = field(default_factory=list)
    min_unit_params: int = 100000
    repeated_children: bool = True
    bucket_mb: float = 25.0
    reduce_dtype: str = "fp32"
    gather_dtype: str | None = None
    quant_block: int = 256
    error_feedback: bool = False
    shard_group_size: int | None = None
    expert_parallel: int = 1
    offload: str | None = None
    offload_dir: str | None = None


# optim/: the trainer's options, whose values conf/config.yaml sets for every choice,
# then the optimizer's arguments: those of its arithmetic, and its implementation
# (`foreach`, `fused`; null: not passed, torch's choice, or fp16's fused one).


@dataclass
class TrainerOptim:
    clip_grad_norm: float = 0.0
    schedule: str = "constant"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1
    no_decay_bias_norm: bool = False


@dataclass
class AdamWOptim(TrainerOptim):
    _target_: str = "torch.optim.AdamW"
    _partial_: bool = True
    lr: float = 1e-3
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    weight_decay: float = 0.01
    amsgrad: bool = False
    foreach: bool | None = None
    fused: bool | None = None


@dataclass
class SGDOptim(TrainerOptim):
    _target_: str = "torch.optim.SGD"
    _partial_: bool = True
    lr: float = 0.05
    momentum: float = 0.0
    dampening: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False
    foreach: bool | None = None
    fused: bool | None = None


cs = ConfigStore.instance()
cs.store(name="schema", node=Config)
for group, choice, node in [
    ("mode", "ddp", DdpMode),
    ("mode", "zero", ZeroMode),
    ("mode", "fsdp", FsdpMode),
    ("optim", "adamw", AdamWOptim),
    ("optim", "sgd", SGDOptim),
]:
    cs.store(group=group, name=f"{choice}_schema", node=node)

# The run directory's name ends in the replica group under ft (`..._p2_g1`): groups
# started in the same second would otherwise share a directory (conf/config.yaml).
OmegaConf.register_new_resolver(
    "ft_group", lambda enabled, group: f"_g{group}" if enabled else "", replace=True
)
