"""Does the model take the dataset's samples? Checked on one sample before training, so a
model/data mismatch is one line naming both, not a traceback from deep inside forward."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from trainer.errors import ConfigError
from trainer.models.loss import loss_fn
from trainer.parallel import Engine


def _targets(dataset: Dataset) -> torch.Tensor | None:
    """Every target of the dataset, where it keeps them in one place."""
    if isinstance(dataset, TensorDataset):
        return dataset.tensors[-1]
    targets = getattr(dataset, "targets", None)  # torchvision's MNIST, CIFAR-10
    return torch.as_tensor(targets) if targets is not None else None


@torch.no_grad()
def check_fit(
    model: nn.Module | Engine,
    dataset: Dataset,
    model_name: str,
    data_name: str,
    device: torch.device | None = None,
) -> None:
    """One forward and loss of sample 0 in eval mode (no statistics updated), and every
    target within the model's outputs; ConfigError otherwise. `model` may be an engine
    (a model built on meta has no values before it): then every rank must call it."""
    what = f"model={model_name} does not fit data={data_name}"
    x, y, *extra = dataset[0]  # extra: what the model takes besides x (segments)
    device = device or next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        if hasattr(dataset, "max_token"):  # token files: every id, read a chunk at a time
            # the vocabulary from a forward of id 0, which every model takes
            size = model(torch.zeros_like(x).unsqueeze(0).to(device)).shape[-1]
            top, vocab = dataset.max_token(), dataset.data_vocab_size()
            if top >= size:
                raise ConfigError(
                    f"{what}: token id {top} is at or above the model's vocabulary size "
                    f"{size} (the data's vocabulary size: {vocab}); set model.vocab_size "
                    f"to at least {top + 1}"
                )
        out = model(*(t.unsqueeze(0).to(device) for t in (x, *extra)))  # (1, C) or (1, T, V)
        targets = _targets(dataset)
        top = int(targets.max()) if targets is not None else int(y.max())
        if top >= out.shape[-1]:
            raise ConfigError(
                f"{what}: targets go up to {top} but the model has {out.shape[-1]} outputs; "
                f"set its num_classes (or vocab_size) to at least {top + 1}"
            )
        loss_fn(out, torch.as_tensor(y).unsqueeze(0).to(device))
    except ConfigError:
        raise
    except Exception as e:  # a shape or dtype the model cannot take
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"{what}: {first}") from None
    finally:
        model.train(was_training)
