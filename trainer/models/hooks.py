"""What a model may add to a training step, found on the model once ([Note: model hooks]).

hooks = model_hooks(model)     # when the run is built
loss = loss_fn(logits, y)
extra = hooks.extra_loss()     # after each micro-batch's forward
...
hooks.after_step(stepped)      # once per step, on every rank
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

# [Note: model hooks]
# The loop knows no model family, as it knows no mode. A model (the module handed to the
# engine) may define any of these methods; `model_hooks` finds them on the model's class
# once, when the run is built, and the loop calls what it found (a model that defines
# none costs nothing per step):
#
#   extra_loss() -> Tensor | None
#       after each micro-batch's forward: a term of that forward to add to its loss,
#       before the division by the number of micro-batches (GPT-MoE's load-balancing
#       loss; a Hugging Face MoE's router loss times its coefficient). None: nothing.
#   after_step(stepped: bool | Tensor) -> None
#       once per step, on every rank alike, after engine.step(): True where the update
#       was made; in fp16 the device flag engine.step() returned (False where the
#       gradients overflowed and no update was made): use it without reading it, as a
#       factor or in torch.where, or the step waits for the device. False for a step
#       skipped for a non-finite loss (train.on_nonfinite=skip: engine.step() did not
#       run). Every rank calls it at the same point, so it may run a collective
#       (GPT-MoE's routing-bias update sums its counts over the ranks).
#   figures() -> dict[str, Tensor | float]
#       at log steps, on every rank: this rank's values for TensorBoard, which writes
#       their mean over the ranks (one transfer with the step's other metrics).
#   figures_to_log(means: dict[str, float]) -> dict[str, float]
#       on rank 0: what is written of those means (without it: the means as they are).
#
# Looked up on the class, so that a submodule or a tensor attribute of the same name is
# never taken for one; a model wrapping another (trainer.models.lm.CausalLM) defines
# them itself.

HOOKS = ("extra_loss", "after_step", "figures", "figures_to_log")


def _no_extra_loss() -> None:
    return None


def _nothing_after_step(stepped: bool | Tensor) -> None:
    pass


def _no_figures() -> dict[str, Any]:
    return {}


def _as_they_are(means: dict[str, float]) -> dict[str, float]:
    return means


@dataclass(frozen=True)
class ModelHooks:
    """The model's hooks, or what stands for one it does not define ([Note: model hooks])."""

    extra_loss: Callable[[], Tensor | None] = _no_extra_loss
    after_step: Callable[[bool | Tensor], None] = _nothing_after_step
    figures: Callable[[], dict[str, Any]] = _no_figures
    figures_to_log: Callable[[dict[str, float]], dict[str, float]] = _as_they_are


def model_hooks(model: nn.Module) -> ModelHooks:
    """The hooks `model` defines, bound to it ([Note: model hooks])."""
    defined = [name for name in HOOKS if callable(getattr(type(model), name, None))]
    return ModelHooks(**{name: getattr(model, name) for name in defined})
