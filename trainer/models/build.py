"""The model and the data of a run, which size each other: a language model takes its
vocabulary size from the data when `model.vocab_size` is null, and token data its window
from the model's positions when `data.block_size` is null."""

from __future__ import annotations

from pathlib import Path

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig
from torch import nn
from torch.utils.data import Dataset

from trainer.errors import ConfigError
from trainer.models.lm import positions


def model_and_data(
    cfg: DictConfig, names: tuple[str, str]
) -> tuple[nn.Module, Dataset, Dataset | None]:
    """(model, training set, held-out set or None when train.eval_every=0). `names`: the
    model and data choices, for messages. The model is built right after
    torch.manual_seed(cfg.seed): datasets draw from their own generators."""
    what = f"model={names[0]} does not fit data={names[1]}"
    dataset = instantiate(cfg.data.dataset)
    sizes = model_sizes(cfg, dataset, what)
    torch.manual_seed(cfg.seed)
    model = instantiate(cfg.model, **sizes)
    held_out = instantiate(cfg.data.dataset, train=False) if cfg.train.eval_every else None
    take_models_window(model, [dataset, held_out], what)
    top = positions(model)
    block = getattr(dataset, "block_size", None)
    if top is not None and block is not None and block > top:
        raise ConfigError(
            f"data.block_size={block} is beyond the model's {top} positions; use at most {top}"
        )
    return model, dataset, held_out


def take_models_window(model: nn.Module, datasets: list[Dataset | None], what: str) -> None:
    """Token data without a `data.block_size` takes the model's window (its positions).
    `what`: the model and data, for the refusal of a model that gives none."""
    if getattr(datasets[0], "block_size", 0) is not None:  # set, or not token data
        return
    block = positions(model)
    if block is None:
        raise ConfigError(f"{what}: the model gives no block size; set data.block_size")
    for ds in datasets:
        if ds is not None:
            ds.block_size = block


def model_sizes(cfg: DictConfig, dataset: Dataset | None = None, what: str = "") -> dict:
    """The arguments of `instantiate(cfg.model, ...)` that the data gives: vocab_size
    where the model's is null. `dataset`: the configured one (built with n=1 if not given)."""
    if "vocab_size" not in cfg.model or cfg.model.vocab_size is not None:
        return {}
    if dataset is None:
        dataset = instantiate(cfg.data.dataset, **({"n": 1} if "n" in cfg.data.dataset else {}))
    vocab = data_vocab_size(dataset)
    if vocab is None and "path" not in cfg.model and "config" not in cfg.model:
        what = what or f"model {cfg.model.get('_target_')} does not fit the data"
        raise ConfigError(f"{what}: the data gives no vocabulary size; set model.vocab_size")
    return {"vocab_size": vocab}


def data_vocab_size(dataset: Dataset) -> int | None:
    if hasattr(dataset, "data_vocab_size"):
        return dataset.data_vocab_size()
    return getattr(dataset, "vocab_size", None)


def data_dir(dataset: Dataset) -> Path | None:
    """Where token data keeps its meta.json and tokenizer, if it is token data."""
    files = getattr(dataset, "files", None)
    return Path(files[0]).parent if files else None
