"""The loss and metric the trainer uses, one pair for classifiers (B, C)/(B,) and language
models (B, T, V)/(B, T), whatever the model. A target equal to IGNORE_INDEX is no
prediction to train or count ([Note: what the loss is averaged over])."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

IGNORE_INDEX = -100  # F.cross_entropy's default ignore_index

# [Note: what the loss is averaged over]
# A target of IGNORE_INDEX (-100) is left out: no loss, no gradient, not counted right or
# wrong. Token data under `data.doc_mask=true` sets it where the next token starts a
# document (trainer/data/tokens.py), so nothing learns to guess an unrelated document's
# first token. `loss_fn` is the mean over the trained positions of the batch it is given,
# as F.cross_entropy(ignore_index=-100) computes it (nanoGPT's and torchtitan's way): in
# training, over each micro-batch of each rank. The step's loss is the mean of those
# means over the micro-batches and the ranks (each is divided by their number, and the
# ranks' gradients are averaged), so a micro-batch weighs the same whatever number of its
# targets are ignored: a run at P ranks equals one process with P x train.grad_accum_steps
# micro-batches of the same windows, not one with fewer, larger micro-batches (those
# weigh positions differently where ignored counts differ). `train/loss` and
# `train/accuracy` are means of the same kind: each micro-batch's figure over its
# trained positions, micro-batches weighing alike (`accuracy` times the micro-batch's
# size is the loop's "correct" count: exact counts where nothing is ignored).
# `eval/loss`, `eval/accuracy` and `eval/perplexity` are exact per trained position:
# sums over them divided by their count (trainer/observe/metrics.py `evaluate`). A
# micro-batch with no trained position at all (every target the start of a document:
# documents of one token) adds 0 to the loss and nothing to the gradient, where a plain
# mean would be 0/0 = NaN.


def trained_count(targets: Tensor) -> Tensor:
    """How many targets are trained (not IGNORE_INDEX), as a 0-dim int64 tensor."""
    return (targets != IGNORE_INDEX).sum()


def loss_fn(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean cross entropy over the trained predictions (every sample, or every token whose
    target is not IGNORE_INDEX; [Note: what the loss is averaged over]). The sum over the
    count is F.cross_entropy's mean bit for bit, 0 where nothing is trained."""
    total = F.cross_entropy(logits.flatten(0, -2), targets.flatten(), reduction="sum")
    return total / trained_count(targets).clamp(min=1)  # (N, C) vs (N,)


@torch.no_grad()
def correct_count(logits: Tensor, targets: Tensor) -> Tensor:
    """Trained predictions whose argmax is the target, as a 0-dim int64 tensor (an argmax
    is never IGNORE_INDEX, so an ignored target is never counted)."""
    pred = logits.flatten(0, -2).argmax(dim=-1)  # (N,)
    return (pred == targets.flatten()).sum()


@torch.no_grad()
def accuracy(logits: Tensor, targets: Tensor) -> Tensor:
    """Fraction of the trained predictions whose argmax is the target, as a 0-dim float
    tensor (0 where nothing is trained)."""
    trained = trained_count(targets).clamp(min=1)
    return correct_count(logits, targets).float() / trained
