"""The loss and metric the trainer uses, one pair for classifiers (B, C)/(B,) and language
models (B, T, V)/(B, T), whatever the model."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def loss_fn(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean cross entropy over every prediction (every sample, or every token)."""
    return F.cross_entropy(logits.flatten(0, -2), targets.flatten())  # (N, C) vs (N,)


@torch.no_grad()
def accuracy(logits: Tensor, targets: Tensor) -> Tensor:
    """Fraction of predictions whose argmax is the target, as a 0-dim float tensor."""
    pred = logits.flatten(0, -2).argmax(dim=-1)  # (N,)
    return (pred == targets.flatten()).float().mean()
