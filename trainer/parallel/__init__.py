"""build_engine(): one entry point for every data-parallel mode.

Each mode is one file read top to bottom (ddp.py, zero.py, fsdp.py) over engine.py, what every
mode shares; zero and fsdp keep their state in sharded.py's buffers. Below them: flat.py
(layouts), buckets.py, units.py, schedule.py, pieces.py, used.py, local_grads.py (no_sync),
state.py, broadcast.py, clipping.py, and precision.py and scaling.py (bf16/fp16 compute,
frozen parameters' fp32 values, fp16 loss scaling and its step). Start with zero.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainer import comm
from trainer.errors import ConfigError
from trainer.models.materialize import Request, Source, has_meta, materialize, swap_into
from trainer.parallel import experts
from trainer.parallel.broadcast import broadcast_tensors
from trainer.parallel.ddp import DDPEngine
from trainer.parallel.engine import Engine, OptimizerFactory, ParamGroupFn
from trainer.parallel.fsdp import FSDPEngine
from trainer.parallel.precision import Precision
from trainer.parallel.scaling import LossScaler, fused_for_scaling
from trainer.parallel.zero import ZeroEngine

ENGINES: dict[str, type[Engine]] = {"ddp": DDPEngine, "zero": ZeroEngine, "fsdp": FSDPEngine}


def build_engine(
    model: nn.Module,
    mode: str,
    optimizer: OptimizerFactory,
    precision: str = "fp32",
    reduce_dtype: str = "fp32",
    gather_dtype: str | None = None,
    quant_block: int = 256,
    error_feedback: bool = False,
    loss_scale: dict[str, Any] | None = None,
    param_options: ParamGroupFn | None = None,
    source: Source | None = None,
    device: torch.device | str | None = None,
    expert_parallel: int = 1,
    offload: str | None = None,
    offload_dir: str | Path | None = None,
    **options: Any,
) -> Engine:
    """Wrap `model` (fp32) for `mode`; `optimizer` is called with the parameters it should
    step. `precision` (fp32 | bf16 | fp16) is the dtype forward and backward run in, with
    fp32 masters for the optimizer; `reduce_dtype` the dtype gradients are reduced in
    (or int8: blocks of `quant_block` values with an fp32 scale each, summed in fp32;
    `error_feedback` adds a rank's quantization error to its next gradient);
    `gather_dtype` (zero, fsdp) None for AllGathers in the parameters' dtype, or int8
    ([Note: int8 on the wire] in precision.py);
    `loss_scale` the options of fp16's dynamic loss scaling (trainer/parallel/scaling.py); in
    fp16 Adam, AdamW and SGD partials build torch's fused variant where it exists, which
    skips an overflowed step on the device ([Note: dynamic loss scaling]).
    `param_options(name, param)` gives a parameter's optimizer options (e.g.
    {"weight_decay": 0.0}); the optimizer gets one param group per distinct options.
    `options` are the mode's own (bucket_mb, reshard_after_forward, ...);
    `expert_parallel=E` spreads each MoE layer's experts over groups of E ranks
    (trainer/parallel/experts.py).
    `offload="disk"` (zero, fsdp; CPU) keeps this rank's optimizer state, and zero's
    separate fp32 masters, in `offload_dir/rank<r>.offload` between steps
    ([Note: offloaded state] in trainer/offload/state.py); call `engine.close()` after
    the run to remove the file. `offload="host"` (zero, fsdp; CUDA) keeps them in host
    memory and steps them there ([Note: host offload] in trainer/offload/host.py).

    A model whose parameters are on the meta device (built under
    `materialize.empty_weights()`) takes its values from `source`: `SeededInit(seed)`
    for a fresh init, `Pretrained(dir)` for safetensors weights ([Note: building on
    meta]); `device` is where its state goes (default: its buffers' device, else CPU)."""
    _check_offload(offload, offload_dir, mode, model, device, precision, gather_dtype)
    ep = experts.plan(model, expert_parallel, options.get("shard_group_size"))
    mp = Precision.of(precision, reduce_dtype, gather_dtype, quant_block, error_feedback)
    if gather_dtype is not None and mode == "ddp":
        raise ConfigError(
            f"mode.gather_dtype={gather_dtype} applies to zero and fsdp; ddp gathers no "
            "parameters (mode.reduce_dtype=int8 quantizes its AllReduce both ways)"
        )
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
    if has_meta(model):
        device = _state_device(model, device)
        _refuse_hooks_on_meta(model)
        if source is None:
            raise ConfigError(
                "the model's parameters are on the meta device: give build_engine a "
                "source=SeededInit(seed) (a fresh init) or source=Pretrained(dir) (weights)"
            )
        if ep is not None:  # this rank's experts only, read or drawn first
            experts.shard(model, ep, source, device)
        if engine_cls.builds_from_meta:
            _materialize_whole_parts(model, source, device)
            options.update(source=source, device=device)
        else:  # ddp and zero keep the full parameters anyway
            materialize(model, source, device, only_meta=ep is not None)
        # Every rank drew or read the same values; what the constructor made for real
        # (buffers) follows rank 0, as in an ordinary build.
        broadcast_tensors(list(model.buffers()))
    elif source is not None:
        raise ConfigError(
            "source= gives values to a model built on the meta device; this model's "
            "parameters already have values (build it under materialize.empty_weights())"
        )
    else:  # ranks may have built the model with different seeds: rank 0's values win
        broadcast_tensors(list(model.parameters()) + list(model.buffers()))
        if ep is not None:  # then each rank keeps its experts' rows
            experts.shard(model, ep, None, device or next(model.parameters()).device)
    if fp16:
        device = next((p.device for p in model.parameters() if not p.is_meta), device)
        optimizer = fused_for_scaling(optimizer, device or torch.device("cpu"))
    if offload == "host":  # the step runs on the host: torch's fused CPU kernels
        optimizer = fused_for_scaling(optimizer, torch.device("cpu"))
    if ep is not None:
        options["experts"] = ep
        experts.scale_gradients(ep)  # [Note: expert gradient scale] in experts.py
    engine = engine_cls(
        model, optimizer, precision=mp, scaler=scaler, param_options=param_options, **options
    )
    if offload == "host":
        engine.offload_to_host()
    elif offload is not None:
        engine.offload_state(Path(offload_dir) / f"rank{comm.rank()}.offload")
    return engine


def _check_offload(
    offload: str | None,
    offload_dir: str | Path | None,
    mode: str,
    model: nn.Module,
    device: torch.device | str | None,
    precision: str = "fp32",
    gather_dtype: str | None = None,
) -> None:
    """Refuse in one line an offload this build cannot do, before anything is built."""
    if offload is None:
        return
    if offload not in ("host", "disk"):
        raise ConfigError(f"mode.offload={offload!r} is not one of null, host, disk")
    if mode == "ddp":
        raise ConfigError(
            f"mode.offload={offload} applies to zero and fsdp: ddp replicates every state on "
            "every rank; use mode=zero (or fsdp) with mode.offload"
        )
    where = torch.device(device) if device is not None else None
    if where is None:
        where = next((p.device for p in model.parameters() if not p.is_meta), None)
    on_cuda = where is not None and where.type == "cuda"
    if offload == "host" and not on_cuda:
        raise ConfigError(
            "mode.offload=host moves state from the GPU to host memory, where a CPU run "
            "keeps it already: use mode.offload=disk to move it out of memory"
        )
    if offload == "host":
        if precision == "fp16":
            raise ConfigError(
                "mode.offload=host with precision=fp16 is not built: the host step would read "
                "the device's overflow flag and its device-side lr; use precision=bf16"
            )
        if gather_dtype == "int8":
            raise ConfigError(
                "mode.offload=host with mode.gather_dtype=int8: the AllGather quantizes the "
                "fp32 master on the device, which host offload keeps on the host; unset one"
            )
        return
    if on_cuda:
        raise ConfigError(
            "mode.offload=disk on CUDA is not built: use mode.offload=host (the state in "
            "host memory, stepped there), or run on CPU (docs/offload.md)"
        )
    if offload_dir is None:
        raise ConfigError("mode.offload=disk needs mode.offload_dir, the directory of its file")


def _grad_hooks(p: torch.Tensor) -> bool:
    """Whether `p` has hooks from `register_hook` or `register_post_accumulate_grad_hook`
    (torch keeps them in these dicts; removed ones leave them empty)."""
    return bool(getattr(p, "_backward_hooks", None)) or bool(
        getattr(p, "_post_accumulate_grad_hooks", None)
    )


def _refuse_hooks_on_meta(model: nn.Module) -> None:
    """A meta parameter gets its values by `swap_into` (a new tensor under the same
    Parameter object), and a tensor's gradient hooks do not follow a swap: registered
    before the build, they would never run. Hooks registered after build_engine, or on a
    model built with values, are kept."""
    hooked = [n for n, p in model.named_parameters() if p.is_meta and _grad_hooks(p)]
    if hooked:
        others = f" (and {len(hooked) - 1} other(s))" if len(hooked) > 1 else ""
        raise ConfigError(
            f"parameter {hooked[0]}{others} has a gradient hook registered on the meta "
            "device; building gives it a new tensor, which would drop the hook: register "
            "hooks after build_engine"
        )


# [Note: building on meta]
# A model built under `empty_weights()` has its parameters on the meta device: shapes, no
# memory. Each mode allocates what it keeps and no more: ddp and zero the full
# parameters (`materialize`), fsdp only this rank's slice of each unit, unit by unit
# (fsdp.py), the values written straight into it by the source. What every rank keeps
# whole is given its values first: buffers left on meta (a model built entirely under
# `torch.device("meta")`) and frozen parameters. SeededInit seeds each module from the
# seed and its name ([Note: initialising by module] in materialize.py), so the initial
# model is bitwise the same in every mode and at every world size.
def _materialize_whole_parts(model: nn.Module, source: Source, device: torch.device) -> None:
    frozen = [(n, p) for n, p in model.named_parameters() if not p.requires_grad and p.is_meta]
    values = [torch.empty(p.shape, dtype=p.dtype, device=device) for _, p in frozen]
    requests = [
        Request(n, p, 0, p.numel(), v.view(-1)) for (n, p), v in zip(frozen, values, strict=True)
    ]
    with_meta_buffers = [
        (n, m) for n, m in model.named_modules() if any(b.is_meta for b in m.buffers(False))
    ]
    if requests or with_meta_buffers:
        source.fill(model, with_meta_buffers, requests, device)
    for (_, p), v in zip(frozen, values, strict=True):
        swap_into(p, v)
    for b in model.buffers():  # built with real buffers elsewhere (the CPU)
        if b.device != device:
            b.data = b.data.to(device)


def _state_device(model: nn.Module, device: torch.device | str | None) -> torch.device:
    if device is not None:
        return torch.device(device)
    return next((b.device for b in model.buffers() if not b.is_meta), torch.device("cpu"))


__all__ = ["ENGINES", "Engine", "build_engine"]
