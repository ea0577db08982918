"""The estimate of one run, per mode: model state, working set, activations, traffic and
step time, against a device's memory. The pieces are in layout.py (model state, working
set), activations.py and traffic.py; report.py prints the result."""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig

from trainer.comm.groups import check_shard_group_size
from trainer.config.checks import engine_options
from trainer.errors import ConfigError
from trainer.estimate import layout, replica_groups
from trainer.estimate.activations import Activations, measure_passes
from trainer.estimate.traffic import EXPOSED, Cluster, Sent, collectives, split, step_time
from trainer.observe.metrics import PEAK_FLOPS
from trainer.parallel import calls, experts
from trainer.parallel.precision import Precision
from trainer.run.optim import optimizer_factory, param_options

# The node the defaults describe: 8 H100 SXM GPUs per node on NVLink (450 GB/s each way
# per GPU), one 400 Gb/s InfiniBand NIC per GPU (50 GB/s), 80 GB each.
DEFAULT_GPU = "H100"


def estimate(
    cfgs: dict[str, DictConfig],
    cluster: Cluster,
    device_bytes: float,
    shard_group_size: int | None = None,
    params: float | None = None,
    alternative: bool = True,
) -> dict[str, dict[str, Any]]:
    """{mode: figures} for each composed config (one per mode, compose.py). `params`
    gives a bare parameter count instead of the model: model state and traffic only.
    `alternative`: also with `model.activation_checkpointing` switched, where the model
    has the option (figures under "alternative")."""
    first = next(iter(cfgs.values()))
    world, k = cluster.world_size, first.train.grad_accum_steps
    if shard_group_size is not None and set(cfgs) == {"ddp"}:
        raise ConfigError("a shard group size applies to mode=zero and mode=fsdp, not ddp")
    groups = replica_groups.groups_of(first)  # the batch is cut over N x P ranks
    micro = first.train.batch_size // (world * groups * k)
    opt = layout.optimizer_state(optimizer_factory(first.optim))
    if params is not None:
        psi = int(params)
        if psi < 1 or psi != params:
            raise ConfigError(f"--params {params!r} must be a whole number of parameters >= 1")
        model = passes = None
        buffers = 0
        built = (0, 0)  # buffer bytes and the largest module's, as built (fp32)
        # A bare count has no tensors: state per element only (no AdamW `step` counters).
        opt = layout.OptimizerState(opt.per_element, 0)
    else:
        model = build_meta(first)
        # GPT-MoE routes as if balanced in the pass ([Note: routing in a pass without
        # values] in parallel/experts.py); transformers' experts cannot run in fake
        # tensors: model states, traffic and the experts' figures only
        ok = experts.routes_in_fake_tensors(model)
        passes = _passes(first, micro, alternative) if ok else None
        buffers = _buffer_bytes(model, Precision.of(first.precision))
        built = _built_bytes(model)
    # DiLoCo's outer tensors ride in the optimizer's state, per value it steps
    opt = layout.OptimizerState(
        opt.per_element + replica_groups.outer_bytes_per_value(first), opt.per_tensor
    )
    out = {}
    for mode, cfg in cfgs.items():
        options = cfg.mode
        precision = Precision.of(
            cfg.precision,
            options.get("reduce_dtype", "fp32"),
            options.get("gather_dtype"),
            options.get("quant_block", 256),
            bool(options.get("error_feedback", False)),
        )
        s = shard_size(mode, cfg, world, shard_group_size)
        e = cfg.mode.get("expert_parallel", 1)
        if e != 1 and mode != "ddp" and s != world:  # as the engines refuse it (experts.plan)
            raise ConfigError(
                f"mode.expert_parallel={e} with a shard group size of {s}: hybrid sharding "
                "with expert parallelism is not supported; set one of them to null/1"
            )
        if model is None:
            plan = layout.bare(mode, psi, s, engine_options(cfg))
        else:
            plan = mode_plan(cfg, model, s)
            if passes is not None and mode == "fsdp":  # units called again after others
                forward = next(iter(passes.values()))[0].calls
                gathers = {f.unit for f in plan.flat_buffers}
                plan.again = calls.gathered_again(forward, plan.units, gathers)
                plan.again_backward = calls.gathered_again_in_backward(forward, plan.units, gathers)
        # a token's forward multiplies by these: an MoE's top-k experts, not all of them
        flop_params = plan.psi if model is None else experts.active_params(model, plan.psi)
        if cfg.mode.get("offload") is not None and mode == "ddp":  # as build_engine refuses
            out[mode] = {"refused": "mode.offload: ddp replicates every state (use zero, fsdp)"}
            continue
        state = layout.max_model_state(plan, precision, opt, world)
        offload = None
        if cfg.mode.get("offload") == "disk":  # [Note: offloaded state]: out of memory
            offload = layout.offload(plan, precision, opt)
            state = {
                **state,
                "optimizer": state["optimizer"] - offload["optimizer_in_file_bytes"],
                "master": state["master"] - offload["master_in_file_bytes"],
            }
            read_s = offload["io_bytes_per_step"] / 2 / cluster.disk_read_Bps
            offload["io_s"] = read_s + offload["io_bytes_per_step"] / 2 / cluster.disk_write_Bps
        elif cfg.mode.get("offload") == "host":  # [Note: host offload]: on the host
            offload = layout.host_offload(plan, precision, opt)
            kind = "params" if mode == "fsdp" else "master"  # fsdp's master is its params
            state = {
                **state,
                "optimizer": state["optimizer"] - offload["optimizer_on_host_bytes"],
                kind: state[kind] - offload["master_off_device_bytes"],
            }
            # the copies overlap the host's step, buffer by buffer: the longer of the two
            offload["io_s"] = max(
                offload["bus_bytes_per_step"] / cluster.host_link_Bps,
                offload["stepped_params"] * cluster.host_step_s_per_param,
            )
            offload["stepping_bytes"] = 0  # its state is on the host the whole time
        sent = collectives(plan, precision, world, k, buffers)
        sync = replica_groups.schedule_of(cfg)
        across = None  # [Note: traffic across replica groups]
        if sync is not None:
            try:
                where = replica_groups.fragments(cfg, model, plan)
                across = replica_groups.figures(
                    plan, sync, where, cfg.train.steps, cluster.across_Bps, world
                )
            except ConfigError as e:  # fragments the run refuses for this mode's layout
                out[mode] = {"refused": str(e)}
                continue
        fig: dict[str, Any] = {
            "params": plan.psi,
            # forward and backward per prediction ([Note: step time model] in traffic.py)
            "flops_per_prediction": 6 * flop_params,
            "world_size": world,
            "model_state_bytes_per_rank": sum(state.values()),
            "model_state_by_kind": state,
            "traffic_bytes_per_step": split(sent, cluster.ranks_per_node),
            "device_bytes": int(device_bytes),
        }
        if mode != "ddp":
            fig["shard_group_size"] = s
        if across is not None:
            fig["replica_groups"] = across
        if offload is not None:
            fig["offload"] = offload
        if model is not None and experts.moe_shape(model) is not None:
            fig["experts"] = _experts(cfg, model, mode, world, precision)
        # a save's extra host memory per rank: the staging buffer, and with ckpt.async a
        # host copy of the rank's data file besides ([Note: async save])
        staging = int(cfg.ckpt.buffer_mb * 2**20)
        data = layout.checkpoint_data_bytes(plan, opt, precision, world)
        fig["checkpoint_save_bytes"] = {"sync": staging, "async": staging + data}
        # [Note: the build peak] in layout.py: to the first step, ordinary and meta build
        fig["build_peak_bytes"] = layout.build_peak(plan, precision, world, *built)
        # with offload a step holds up to three buffers' state beside the rest
        stepping = offload["stepping_bytes"] if offload is not None else 0
        if passes is None:  # model states only
            fig["fits"] = fig["model_state_bytes_per_rank"] <= device_bytes
            if model is not None:  # an MoE: no activations, but the mode's buffers
                fig["working_set_bytes"] = layout.working_set(plan, precision, k) + stepping
        else:
            fig["working_set_bytes"] = layout.working_set(plan, precision, k) + stepping
            fig["micro_batch"], fig["grad_accum_steps"] = micro, k
            timing = Cluster(**{**cluster.__dict__, "peak_flops": peak_flops(cluster, precision)})
            for ac, (one, two) in passes.items():
                fits = _fit(fig, one, two, micro, device_bytes)
                dispatch = _dispatch(cfg, model, world, precision, bool(ac))
                fits.update(
                    step_time(
                        plan, sent + dispatch, timing, one.predictions, k, bool(ac), flop_params
                    )
                )
                if offload is not None:  # the file's I/O (or the host step) after backward
                    fits["step_s"] += offload["io_s"]
                if across is not None:  # what the link between groups does not hide
                    wait = replica_groups.exposed_s_per_step(
                        across["bytes_per_sync"], sync, cluster.across_Bps, fits["step_s"]
                    )
                    fits["across_groups_s"] = wait
                    fits["step_s"] += wait
                if ac is None or ac == bool(first.model.activation_checkpointing):
                    fig["activation_checkpointing"] = ac
                    fig.update(fits)
                    if across is not None:
                        across["exposed_s_per_step"] = fits["across_groups_s"]
                else:
                    fig["alternative"] = {"activation_checkpointing": ac, **fits}
        out[mode] = fig
    if all("refused" in f for f in out.values()):  # nothing to show
        mode, fig = next(iter(out.items()))
        raise ConfigError(f"mode={mode}: {fig['refused']}")
    return out


def _experts(cfg: DictConfig, model, mode: str, world: int, precision: Precision) -> dict:
    """Expert parallelism's figures ([Note: expert parameters in every mode] in
    parallel/experts.py): expert parameters in all, those each rank holds (ddp, zero:
    n/E experts whole; fsdp: 1/P of them) and steps (ddp: n/E; zero, fsdp: 1/P), and the
    AllToAll bytes a rank sends per step. The model-state columns count the same way
    (layout.py lays out a rank's experts only)."""
    shape = experts.moe_shape(model)
    e = int(cfg.mode.get("expert_parallel", 1))
    held = shape.expert_params // (world if mode == "fsdp" else e)
    stepped = shape.expert_params // (e if mode == "ddp" else world)
    checkpointing = bool(cfg.model.get("activation_checkpointing"))
    return {
        "expert_parallel": e,
        "expert_params": shape.expert_params,
        "expert_params_held_per_rank": held,
        "expert_params_stepped_per_rank": stepped,
        "all_to_all_bytes_per_step": _all_to_all_bytes(cfg, model, world, precision, checkpointing),
    }


def _all_to_all_bytes(
    cfg: DictConfig, model, world: int, precision: Precision, checkpointing: bool
) -> float:
    """What a rank sends in token dispatch AllToAlls per step (experts.all_to_all_bytes):
    per MoE layer and pass (forward, backward, with activation checkpointing the forward
    again) the rows out and their results back."""
    shape = experts.moe_shape(model)
    e = int(cfg.mode.get("expert_parallel", 1))
    ranks = world * replica_groups.groups_of(cfg)  # the batch is cut over every group's
    tokens = cfg.train.batch_size // ranks * getattr(model, "block_size", 0)
    element = precision.param_dtype.itemsize
    return experts.all_to_all_bytes(shape, e, tokens, element, 3 if checkpointing else 2)


def _dispatch(cfg: DictConfig, model, world: int, precision: Precision, checkpointing: bool):
    """Token dispatch for the step time: one exposed entry of the AllToAll bytes over rank
    0's EP group, ranks 0 .. E-1 (each AllToAll is waited for before the experts run);
    none without expert parallelism."""
    e = int(cfg.mode.get("expert_parallel", 1))
    if model is None or e == 1 or experts.moe_shape(model) is None:
        return []
    nbytes = _all_to_all_bytes(cfg, model, world, precision, checkpointing)
    return [Sent("all_to_all", nbytes, list(range(e)), EXPOSED)]


def peak_flops(cluster: Cluster, precision: Precision) -> float:
    """The cluster's peak FLOP/s, else the default GPU's for the compute dtype."""
    return cluster.peak_flops or PEAK_FLOPS[DEFAULT_GPU][precision.param_dtype]


def mode_plan(cfg: DictConfig, model: torch.nn.Module, shard: int) -> layout.Plan:
    """The flat buffers of `cfg.mode` for `model` (fp32, on meta), cut over `shard` ranks."""
    options = engine_options(cfg)
    return layout.plan(cfg.mode.name, model, options, param_options(cfg.optim), shard)


def build_meta(cfg: DictConfig) -> torch.nn.Module:
    """The configured model on the meta device: shapes only."""
    with torch.device("meta"):
        return _build(cfg)


def _fit(fig: dict[str, Any], one: Activations, two: Activations, micro: int, device: float):
    """Total against the device, and the largest micro-batch that fits: activations grow
    linearly with the micro-batch (measured at `micro` and 2 x `micro`)."""
    fixed = fig["model_state_bytes_per_rank"] + fig["working_set_bytes"]
    slope = (two.peak - one.peak) / micro
    base = one.peak - slope * micro
    room = device - fixed - base
    largest = max(0, math.floor(room / slope)) if slope > 0 else None
    return {
        "activation_bytes": one.peak,
        "activation_saved_bytes": one.saved,
        "total_bytes": fixed + one.peak,
        "fits": fixed + one.peak <= device,
        "max_micro_batch": largest,
    }


def shard_size(mode: str, cfg: DictConfig, world: int, flag: int | None) -> int:
    """S for zero and fsdp: `--shard-group-size`, else `mode.shard_group_size`, else all
    ranks ([Note: hybrid sharding] in comm/groups.py). ddp shards nothing: 1."""
    if mode == "ddp":
        return 1
    configured = cfg.mode.get("shard_group_size")
    if flag is not None and configured is not None and flag != configured:
        raise ConfigError(
            f"--shard-group-size {flag} differs from mode.shard_group_size={configured}"
        )
    s = flag if flag is not None else configured
    if s is None:
        return world
    check_shard_group_size(s, world)  # the engines' own check: one line naming valid sizes
    return s


def _build(cfg: DictConfig, **kwargs: Any) -> torch.nn.Module:
    from trainer.models.build import model_sizes

    with torch.device("cpu"):  # the data, where it sizes the model: real, even under meta
        sizes = model_sizes(cfg)  # the data's vocabulary where the model's is null
    try:
        return instantiate(cfg.model, **sizes, **kwargs)
    except InstantiationException as e:  # a ConfigError raised inside the model
        if isinstance(e.__cause__, ConfigError):
            raise e.__cause__ from None
        raise


def sample_of(cfg: DictConfig) -> tuple[torch.Tensor, ...]:
    """Sample 0 of the configured dataset, for its shapes (a synthetic one made with n=1):
    (x, y), and what else a sample holds for the model (data.doc_mask's segments)."""
    from trainer.models.build import take_models_window

    dataset = cfg.data.dataset
    try:
        data = instantiate(dataset, **({"n": 1} if "n" in dataset else {}))
    except InstantiationException as e:
        if isinstance(e.__cause__, ConfigError):  # files missing: one line from trainer/data/
            raise e.__cause__ from None
        raise
    if getattr(data, "block_size", 0) is None:  # token data: the model's window, as a run's
        take_models_window(build_meta(cfg), [data], f"model {cfg.model.get('_target_')}")
    return tuple(torch.as_tensor(t) for t in data[0])


def _passes(
    cfg: DictConfig, micro: int, alternative: bool
) -> dict[bool | None, tuple[Activations, Activations]]:
    """Activations at `micro` and 2 x `micro`, as configured and (`alternative`) with
    activation checkpointing switched, when the model has the option (key None when it
    has not)."""
    sample = sample_of(cfg)
    precision = Precision.of(cfg.precision)
    settings: list[bool | None] = [None]
    if "activation_checkpointing" in cfg.model:
        settings = [bool(cfg.model.activation_checkpointing)]
        settings += [not settings[0]] if alternative else []
    out = {}
    for ac in settings:
        kwargs = {} if ac is None else {"activation_checkpointing": ac}
        try:
            out[ac] = tuple(
                measure_passes(
                    partial(_build, cfg, **kwargs), sample, [micro, 2 * micro], precision
                )
            )
        except ConfigError:
            raise
        except Exception as e:  # a shape the model cannot take
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ConfigError(f"the model does not take the data's samples: {first}") from None
    return out


def _built_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """Bytes of the buffers as built, and of the parameters the largest module owns."""
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    own = [
        sum(p.numel() * 4 for p in m._parameters.values() if p is not None) for m in model.modules()
    ]
    return buffers, max(own, default=0)


def _buffer_bytes(model: torch.nn.Module, precision: Precision) -> int:
    """Bytes of the buffers broadcast before each training forward (floating ones cast)."""
    return sum(
        b.numel() * (precision.param_dtype.itemsize if b.is_floating_point() else b.element_size())
        for b in model.buffers()
    )
