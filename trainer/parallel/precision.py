"""Mixed precision: which dtype computes and which one communicates gradients
(`Precision`, [Note: master weights] beside it) and the casts in and out of the module.

    precision = Precision.of("bf16", reduce_dtype="fp32")
    engine = build_engine(model, mode, optimizer, precision="bf16", reduce_dtype="fp32")
    Precision.of("fp32", reduce_dtype="int8", gather_dtype="int8")   # int8 on the wire

fp16's dynamic loss scaling is scaling.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from trainer.errors import ConfigError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
QUANTIZED = "int8"  # a wire format: blocks of int8 values with fp32 scales (comm/quantized.py)


def dtype_of(name: str, key: str = "precision") -> torch.dtype:
    if name not in DTYPES:
        raise ConfigError(f"{key}={name!r} is not one of {', '.join(DTYPES)}")
    return DTYPES[name]


# [Note: master weights]
# With `param_dtype` bf16 or fp16 the module's parameters (and floating buffers) are cast
# to it, so forward and backward run in that dtype and produce gradients in it. Each mode
# keeps fp32 master copies of the parameters it owns (ddp all of them, zero and fsdp their
# shard) and builds the optimizer over those, so its state is fp32 too and small updates
# are not rounded away. After a step the masters are cast back: ddp copies them into the
# module, zero casts its shard into the flat parameter buffer and AllGathers that (half
# the bytes of fp32), fsdp casts its shard right before each AllGather of a unit. Gradients
# are reduced in `reduce_dtype` (fp32 by default: summing P low-precision values loses
# bits) and land in fp32 next to the masters. Inputs that are floating point are cast to
# `param_dtype` on the way in and floating outputs back to fp32 on the way out, so the loss
# is computed in fp32.
#
# [Note: int8 on the wire]
# `reduce_dtype=int8` and `gather_dtype=int8` change what travels, not what is held or
# summed: gradient buffers stay fp32 (`reduce_dtype` is then torch.float32 and
# `reduce_int8` True) and are quantized block by block only inside the collective
# (comm/quantized.py, [Note: int8 blocks]); an int8 AllGather quantizes the fp32 master
# shard (never in place) and every rank, the owner included, computes with the
# dequantized values in `param_dtype`. `wire_bytes` is what one element costs on the
# wire, scales included: what the expected traffic and the estimate count.
# `error_feedback` keeps, per gradient buffer and rank, the fp32 error of its last
# quantization and adds it to the next gradient before quantizing (a non-finite error,
# from an fp16 overflow, is dropped); the errors are in the gradients' units, loss-scaled
# in fp16, and follow a change of the scale (engine.py `step`). Its memory: one fp32
# copy of every gradient buffer's full (unsharded) input per rank, 4Ψ bytes, in every
# mode: in fsdp that is a full model's worth next to its 16Ψ/P. It cannot be sharded at
# the same bytes on the wire: each rank sends an int8 contribution to every rank's
# slice, so it rounds its whole gradient each step, and only that rank knows what it
# rounded away until it sends again. Saved by every rank in checkpoints and resumed
# exactly in the same layout ([Note: error feedback in a checkpoint] in state.py).
# In ddp both of its AllReduce's roundings are fed back, the senders' and the owner's
# of the mean it AllGathers: the owner keeps a (chunk,) fp32 error too, 4Ψ/P more
# ([Note: error feedback on both roundings] in comm/quantized.py). The int8 AllReduce
# across groups of `mode.shard_group_size` has no error feedback.


@dataclass(frozen=True)
class Precision:
    param_dtype: torch.dtype = torch.float32  # forward/backward, AllGathered parameters
    reduce_dtype: torch.dtype = torch.float32  # gradient buffers and their reduction
    reduce_int8: bool = False  # gradients travel as int8 blocks ([Note: int8 on the wire])
    gather_int8: bool = False  # AllGathered parameters travel as int8 blocks
    quant_block: int = 256  # values per fp32 scale
    error_feedback: bool = False  # a rank's quantization error joins its next gradient

    @classmethod
    def of(
        cls,
        precision: str = "fp32",
        reduce_dtype: str = "fp32",
        gather_dtype: str | None = None,
        quant_block: int = 256,
        error_feedback: bool = False,
    ) -> Precision:
        if gather_dtype not in (None, QUANTIZED):
            raise ConfigError(
                f"mode.gather_dtype={gather_dtype!r} is not one of null (the parameters' "
                f"dtype), {QUANTIZED}"
            )
        if (
            not isinstance(quant_block, int)
            or isinstance(quant_block, bool)
            or not (4 <= quant_block <= 2**20 and quant_block % 4 == 0)
        ):
            raise ConfigError(
                f"mode.quant_block={quant_block!r} must be a multiple of 4 from 4 to {2**20}"
            )
        reduce_int8 = reduce_dtype == QUANTIZED
        if not reduce_int8 and reduce_dtype not in DTYPES:
            names = ", ".join([*DTYPES, QUANTIZED])
            raise ConfigError(f"mode.reduce_dtype={reduce_dtype!r} is not one of {names}")
        if error_feedback and not reduce_int8:
            raise ConfigError(
                f"mode.error_feedback=true feeds back int8 rounding errors: it needs "
                f"mode.reduce_dtype=int8, not {reduce_dtype}"
            )
        reduce = torch.float32 if reduce_int8 else DTYPES[reduce_dtype]
        gather_int8 = gather_dtype == QUANTIZED
        return cls(
            dtype_of(precision), reduce, reduce_int8, gather_int8, quant_block, error_feedback
        )

    def wire_bytes(self, kind: str) -> float:
        """Bytes one element costs on the wire, scales included: "grads" (reduced) or
        "params" (AllGathered)."""
        if self.reduce_int8 if kind == "grads" else self.gather_int8:
            return 1 + 4 / self.quant_block
        return (self.reduce_dtype if kind == "grads" else self.param_dtype).itemsize

    @property
    def mixed(self) -> bool:
        """True when the module computes in a lower precision than its fp32 masters."""
        return self.param_dtype != torch.float32

    def cast_in(self, x: Any) -> Any:
        """Floating tensors to `param_dtype` (integer token ids stay as they are)."""
        return _cast(x, self.param_dtype) if self.mixed else x

    def cast_out(self, x: Any) -> Any:
        """Floating tensors to fp32, so that the loss is computed in fp32."""
        return _cast(x, torch.float32) if self.mixed else x


def _cast(x: Any, dtype: torch.dtype) -> Any:
    if isinstance(x, torch.Tensor):
        return x.to(dtype) if x.is_floating_point() else x
    if isinstance(x, tuple | list):
        return type(x)(_cast(v, dtype) for v in x)
    if isinstance(x, dict):
        return {k: _cast(v, dtype) for k, v in x.items()}
    return x


class FrozenMasters:
    """fp32 values of the frozen parameters a mixed-precision module computes with in a
    lower dtype. They have no master in any mode (nothing steps them), so their fp32
    values are kept here: a saved model must not come back rounded to bf16."""

    def __init__(self) -> None:
        self._by_id: dict[int, torch.Tensor] = {}

    def cast(self, module: torch.nn.Module, dtype: torch.dtype) -> None:
        """Keep the frozen parameters' fp32 values, then cast the module (after the mode
        built the masters of its trainable parameters)."""
        for p in module.parameters():
            if not p.requires_grad and p.is_floating_point():
                self._by_id[id(p)] = p.detach().clone()
        cast_module(module, dtype)

    def value(self, v: torch.Tensor) -> torch.Tensor:
        """What to save of a tensor every rank keeps whole (buffer, frozen parameter),
        not copied: its fp32 value where the module holds a cast copy, else itself."""
        return self._by_id.get(id(v), v).detach()

    def copy(self, v: torch.Tensor) -> torch.Tensor:
        """`value(v)` as a CPU copy, floating tensors in fp32."""
        c = self.value(v).cpu().clone()
        return c.float() if c.is_floating_point() else c

    @torch.no_grad()
    def load(self, v: torch.Tensor, value: torch.Tensor) -> None:
        """`value` into a tensor every rank keeps whole, and into its fp32 value if cast."""
        v.copy_(value)
        if id(v) in self._by_id:
            self._by_id[id(v)].copy_(value)

    def tensors(self) -> list[torch.Tensor]:
        return list(self._by_id.values())


@torch.no_grad()
def cast_module(module: torch.nn.Module, dtype: torch.dtype) -> None:
    """Cast floating parameters and buffers in place, keeping the Parameter objects (the
    engines registered hooks on them)."""
    for t in list(module.parameters()) + list(module.buffers()):
        if t.is_floating_point() and t.dtype != dtype:
            t.data = t.data.to(dtype)
