"""Checks on the composed config, and the mapping from config groups to constructors."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from trainer.config import schema  # registers the types conf/config.yaml names, too
from trainer.errors import ConfigError

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"  # what train.py composes


def _show(value: Any) -> str:
    """A value as the user probably typed it: a float key (trainer/config/schema.py) turns
    `optim.lr=-1` into -1.0, shown as -1."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return repr(value)


def _positive(name: str, value: Any) -> None:
    # `not value > 0` rather than `value <= 0`: NaN compares false either way
    if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
        raise ConfigError(f"{name}={_show(value)} must be a positive number")
    if math.isinf(value):
        raise ConfigError(f"{name}={_show(value)} must be a finite positive number")


# Sizes of the models' layers: 0 or less builds a model that cannot learn, or fails
# deep inside torch.
_MODEL_SIZES = ("hidden", "depth", "width", "n_layer", "n_head", "n_embd", "in_dim")
SEED_MAX = 2**32 - 1  # numpy's limit; torch's is larger


def _validate_ranges(cfg: DictConfig) -> None:
    if not 0 <= cfg.seed <= SEED_MAX:
        raise ConfigError(f"seed={cfg.seed} must be a whole number from 0 to {SEED_MAX}")
    _positive("dist.timeout_s", cfg.dist.timeout_s)
    _whole("launcher.nproc", cfg.launcher.nproc, minimum=1)
    wd = cfg.optim.get("weight_decay", 0.0)
    if not isinstance(wd, int | float) or isinstance(wd, bool) or not 0 <= wd < math.inf:
        raise ConfigError(f"optim.weight_decay={_show(wd)} must be a number >= 0")
    if "min_unit_params" in cfg.mode:
        _whole("mode.min_unit_params", cfg.mode.min_unit_params, minimum=0)
    for key in _MODEL_SIZES:
        if key in cfg.model:
            _whole(f"model.{key}", cfg.model[key], minimum=1)


def validate(cfg: DictConfig, world_size: int) -> None:
    _positive("train.steps", cfg.train.steps)
    _positive("train.batch_size", cfg.train.batch_size)
    _positive("train.log_every", cfg.train.log_every)
    _positive("train.peak_every", cfg.train.peak_every)
    if "lr" in cfg.optim:
        _positive("optim.lr", cfg.optim.lr)
    if "bucket_mb" in cfg.mode:
        _positive("mode.bucket_mb", cfg.mode.bucket_mb)
    k = cfg.train.get("grad_accum_steps", 1)
    _whole("train.grad_accum_steps", k, minimum=1)
    groups = 1  # replica groups under ft: the global batch is cut over all their ranks
    if cfg.get("ft") and cfg.ft.enabled:
        _whole("ft.replica_groups", cfg.ft.replica_groups, minimum=1)
        groups = cfg.ft.replica_groups
    if cfg.train.batch_size % (world_size * groups * k):
        # Every rank takes batch_size / P samples and cuts them into k equal micro-batches.
        accum = f" x train.grad_accum_steps={k}" if k > 1 else ""
        across = f" x ft.replica_groups={groups}" if groups > 1 else ""
        raise ConfigError(
            f"train.batch_size={cfg.train.batch_size} is not divisible by world size "
            f"{world_size}{across}{accum}; use a multiple of {world_size * groups * k}"
        )
    _validate_ft(cfg, world_size)
    if cfg.mode.get("shard_group_size") is not None:
        from trainer.comm.groups import check_shard_group_size

        check_shard_group_size(cfg.mode.shard_group_size, world_size)
    if cfg.mode.get("expert_parallel", 1) != 1:
        from trainer.comm.groups import check_expert_parallel

        check_expert_parallel(cfg.mode.expert_parallel, world_size, cfg.model.get("n_experts"))
    _whole("train.eval_every", cfg.train.get("eval_every", 0), minimum=0)
    if cfg.train.get("eval_batches") is not None:
        _whole("train.eval_batches", cfg.train.eval_batches, minimum=1)
    _validate_optim(cfg.optim)
    link = cfg.get("comm") or {}
    if link.get("link_gbps") is not None:
        _positive("comm.link_gbps", link.link_gbps)
    latency = link.get("latency_us", 0.0)
    if (
        not isinstance(latency, int | float)
        or isinstance(latency, bool)
        or not 0 <= latency < math.inf
    ):
        raise ConfigError(f"comm.latency_us={_show(latency)} must be a number >= 0")
    _validate_precision(cfg)
    _validate_ranges(cfg)
    _validate_mix(cfg)
    _validate_doc_mask(cfg)
    if cfg.mode.get("offload") is not None and cfg.ckpt.get("async"):
        where = (
            "which offload=disk keeps it out of; use ckpt.async=false (the save streams the "
            "offloaded state from its file)"
            if cfg.mode.offload == "disk"
            else "beside the state offload=host keeps there; use ckpt.async=false (the save "
            "reads the host state where it is)"
        )
        raise ConfigError(
            f"ckpt.async=true with mode.offload={cfg.mode.offload}: an async save copies the "
            f"whole state into host memory, {where}"
        )


def _validate_ft(cfg: DictConfig, world_size: int) -> None:
    """`ft` ([Note: fault-tolerant replica groups] in trainer/comm/replicas.py): sizes, and
    what a heal cannot carry, one line each."""
    ft = cfg.get("ft")
    if not ft:
        return
    if not ft.enabled:
        _refuse_ft_keys_without_ft(ft)
        return
    _whole("ft.replica_groups", ft.replica_groups, minimum=1)
    if not isinstance(ft.replica_group, int) or not 0 <= ft.replica_group < ft.replica_groups:
        raise ConfigError(
            f"ft.replica_group={_show(ft.replica_group)} must be one of 0..{ft.replica_groups - 1} "
            f"(ft.replica_groups={ft.replica_groups})"
        )
    _whole("ft.min_groups", ft.min_groups, minimum=1)
    if ft.min_groups > ft.replica_groups:
        raise ConfigError(
            f"ft.min_groups={ft.min_groups} is more than ft.replica_groups={ft.replica_groups}"
        )
    for key in ("timeout_s", "quorum_timeout_s", "join_timeout_s", "connect_timeout_s",
                "stall_timeout_s"):  # fmt: skip
        _positive(f"ft.{key}", ft[key])
    _whole("ft.heartbeat_ms", ft.heartbeat_ms, minimum=1)
    if cfg.mode.get("offload") is not None:
        raise ConfigError(
            f"ft.enabled=true with mode.offload={cfg.mode.offload}: a replica group heals from "
            "its peer's state in memory, which offload keeps out of it; use mode.offload=null"
        )
    speed = cfg.model.get("bias_update_speed") or 0
    if speed > 0:
        raise ConfigError(
            f"ft.enabled=true with model.bias_update_speed={speed}: the routing bias moves "
            "by the expert counts of its own replica group, so the groups' models would "
            "drift apart; use the aux loss (model.bias_update_speed=0) under ft"
        )
    _validate_semi_sync(ft)
    if not ft.lighthouse and not os.environ.get("TORCHFT_LIGHTHOUSE"):
        raise ConfigError(
            "ft.enabled=true needs a Lighthouse: set ft.lighthouse=http://HOST:PORT or "
            "TORCHFT_LIGHTHOUSE (start one with `torchft_lighthouse --min_replicas 1`)"
        )


# [Note: ft keys without ft.enabled]
# `ft.replica_groups=2 ft.replica_group=1` without `ft.enabled=true` would train a lone run:
# two such launches, meant as one run of two groups, train two unrelated models without a
# word. So with ft off, every key of the ft schema (trainer/config/schema.py, `Ft`: keys
# added there later are covered as they come) must hold its default there. A value that
# conf/config.yaml itself writes is no setting of the user's either: TORCHFT_LIGHTHOUSE in
# the environment (as docs/fault_tolerance.md has one export it) reaches ft.lighthouse
# through the file's ${oc.env:...}, and plain runs in that shell are not refused for it.


def _ft_defaults() -> tuple[dict[str, Any], dict[str, Any]]:
    """The ft schema's defaults, and conf/config.yaml's ft values as written (unresolved)."""
    typed = OmegaConf.to_container(OmegaConf.structured(schema.Ft))
    written = OmegaConf.load(CONF_DIR / "config.yaml").get("ft") or {}
    return typed, OmegaConf.to_container(written, resolve=False)


def _typed_as_given(value: Any) -> str:
    """A value as it is written on the command line (true, null, a bare string)."""
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "null"}[value]
    return value if isinstance(value, str) else _show(value)


def _refuse_ft_keys_without_ft(ft: DictConfig) -> None:
    """[Note: ft keys without ft.enabled]: one line naming every ft key set."""
    typed, written = _ft_defaults()
    given = OmegaConf.to_container(ft, resolve=False)
    set_keys = []
    for key, default in typed.items():
        if key == "enabled" or key not in given:
            continue
        if key in written and given[key] == written[key]:
            continue  # conf/config.yaml's own value (its ${oc.env:...} included)
        value = ft[key]  # resolved
        if value != default:
            set_keys.append(f"ft.{key}={_typed_as_given(value)}")
    if set_keys:
        many = len(set_keys) > 1
        raise ConfigError(
            f"{' and '.join(set_keys)} {'have' if many else 'has'} no effect without "
            f"ft.enabled=true: set ft.enabled=true to join replica groups, or drop "
            f"{'them' if many else 'it'}"
        )


SEMI_SYNC = ("local_sgd", "diloco")  # ft.semi_sync: trainer/comm/diloco.py
PSEUDO_GRAD_DTYPES = ("fp32", "bf16", "int8")


def _validate_semi_sync(ft: DictConfig) -> None:
    """ft.semi_sync ([Note: the fragment schedule] in trainer/comm/diloco.py), one line
    each: the schedule's sizes, the outer step, the wire."""
    if ft.semi_sync is None:
        return
    if ft.semi_sync not in SEMI_SYNC:
        raise ConfigError(
            f"ft.semi_sync={ft.semi_sync} is not one of null (every step), {', '.join(SEMI_SYNC)}"
        )
    _whole("ft.sync_steps", ft.sync_steps, minimum=1)
    _whole("ft.fragments", ft.fragments, minimum=1)
    h, f = ft.sync_steps, ft.fragments
    if h % f:
        raise ConfigError(
            f"ft.sync_steps={h} is not a multiple of ft.fragments={f}: each fragment syncs "
            f"every ft.sync_steps steps, one fragment every sync_steps / fragments"
        )
    _whole("ft.fragment_sync_delay", ft.fragment_sync_delay, minimum=0)
    if ft.fragment_sync_delay >= h // f:
        raise ConfigError(
            f"ft.fragment_sync_delay={ft.fragment_sync_delay} must be below ft.sync_steps / "
            f"ft.fragments = {h // f}: a sync must be applied before the next one is sent"
        )
    alpha = ft.fragment_update_alpha
    if not isinstance(alpha, int | float) or isinstance(alpha, bool) or not 0 <= alpha <= 1:
        raise ConfigError(f"ft.fragment_update_alpha={_show(alpha)} must be in [0, 1]")
    if ft.pseudo_grad_dtype not in PSEUDO_GRAD_DTYPES:
        raise ConfigError(
            f"ft.pseudo_grad_dtype={ft.pseudo_grad_dtype} is not one of "
            f"{', '.join(PSEUDO_GRAD_DTYPES)}"
        )
    if ft.semi_sync == "local_sgd":  # the groups' parameters averaged: no outer optimizer
        typed = schema.Ft()
        for key in ("outer_lr", "outer_momentum"):
            if ft[key] != getattr(typed, key):
                raise ConfigError(
                    f"ft.{key}={_show(ft[key])} is diloco's outer step: ft.semi_sync=local_sgd "
                    "averages the groups' parameters (outer lr 1, no momentum); use "
                    "ft.semi_sync=diloco"
                )
        return
    _positive("ft.outer_lr", ft.outer_lr)
    m = ft.outer_momentum
    if not isinstance(m, int | float) or isinstance(m, bool) or not 0 <= m < 1:
        raise ConfigError(f"ft.outer_momentum={_show(m)} must be in [0, 1) (Nesterov)")


def _validate_doc_mask(cfg: DictConfig) -> None:
    """data.doc_mask ([Note: document starts] in trainer/data/tokens.py): a bool, and a
    model whose forward takes the windows' documents (GPT's `takes_documents`), which
    would otherwise be ignored or fail at the first forward."""
    doc_mask = cfg.data.get("doc_mask", False)
    if not isinstance(doc_mask, bool):
        raise ConfigError(f"data.doc_mask={_typed_as_given(doc_mask)} must be true or false")
    if not doc_mask:
        return
    from hydra.utils import get_object

    target = cfg.model.get("_target_")
    try:
        model = get_object(target) if target else None
    except Exception:  # an unknown target: its build names it
        return
    if not getattr(model, "takes_documents", False):
        raise ConfigError(
            f"data.doc_mask=true needs a model that takes document boundaries: model=gpt, "
            f"nanogpt or gpt_moe ({target} does not); or set data.doc_mask=false"
        )


def _validate_mix(cfg: DictConfig) -> None:
    """data.mix (trainer/data/mix.py): a list of existing directories, each once, with
    positive weights, and no data.dir, data.path or data.val_path beside it; one line
    naming the first bad value."""
    if cfg.data.get("mix") is None:
        return
    from trainer.data.mix import check_mix

    check_mix(cfg.data.mix, {k: cfg.data.get(k) for k in ("dir", "path", "val_path")})


def _whole(name: str, value: Any, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"{name}={value!r} must be a whole number >= {minimum}")


def _validate_optim(optim: DictConfig) -> None:
    from trainer.run.optim import SCHEDULES

    clip = optim.get("clip_grad_norm") or 0
    if not isinstance(clip, int | float) or isinstance(clip, bool) or clip < 0:
        raise ConfigError(f"optim.clip_grad_norm={_show(clip)} must be >= 0 (0: no clipping)")
    if optim.get("schedule", "constant") not in SCHEDULES:
        raise ConfigError(f"optim.schedule={optim.schedule!r} is not one of {', '.join(SCHEDULES)}")
    _whole("optim.warmup_steps", optim.get("warmup_steps", 0), minimum=0)
    ratio = optim.get("min_lr_ratio", 0.0)
    if not isinstance(ratio, int | float) or isinstance(ratio, bool) or not 0 <= ratio <= 1:
        raise ConfigError(f"optim.min_lr_ratio={_show(ratio)} must be between 0 and 1")


def _validate_precision(cfg: DictConfig) -> None:
    from trainer.parallel.precision import Precision
    from trainer.parallel.scaling import LossScaler

    precision = cfg.get("precision", "fp32")
    mode = cfg.mode
    Precision.of(
        precision,
        mode.get("reduce_dtype", "fp32"),
        mode.get("gather_dtype"),
        mode.get("quant_block", 256),
        mode.get("error_feedback", False),
    )
    if cfg.model.get("bias_update_speed") and precision != "fp32":
        # [Note: aux-loss-free load balancing] in models/builtin.py: an fp32 buffer
        raise ConfigError(
            f"model.bias_update_speed={cfg.model.bias_update_speed} keeps its expert bias "
            f"in fp32, which precision={precision} would cast: use precision=fp32 or "
            "model.bias_update_speed=0"
        )
    options = OmegaConf.to_container(cfg.get("loss_scale") or {})
    known = ("init_scale", "growth_factor", "backoff_factor", "growth_interval")
    for key in options:
        if key not in known:
            raise ConfigError(f"loss_scale.{key} is not an option; use one of {', '.join(known)}")
    LossScaler(enabled=True, **options)


def engine_options(cfg: DictConfig, run_dir: Path | None = None) -> dict[str, Any]:
    """Everything under mode/ except its name goes to the engine's constructor; an
    offload file's directory defaults to `run_dir`/offload."""
    opts = OmegaConf.to_container(cfg.mode, resolve=True)
    opts.pop("name")
    if opts.get("offload") is not None and opts.get("offload_dir") is None and run_dir:
        opts["offload_dir"] = str(Path(run_dir) / "offload")
    return opts
