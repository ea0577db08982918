"""Datasets and the per-rank batch sampler.

Synthetic datasets are generated in memory (no download), deterministically from a seed
and from local torch.Generators, so every rank builds the identical dataset without
touching the global RNG. `train=False` draws a fresh sample of the same distribution
for evaluation.

MNIST and CIFAR-10 are the real torchvision datasets; with `download=False` a missing
copy is a one-line ConfigError rather than torchvision's traceback.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler, Subset, TensorDataset

from trainer.errors import ConfigError

# The distribution's parameters (cluster centres, patterns, bigram table) come from
# `seed`; the samples come from a second generator, offset per split, so train and eval
# share the distribution but not the samples.
_SPLIT_OFFSET = {True: 1_000_003, False: 2_000_006}


def _generators(seed: int, train: bool) -> tuple[torch.Generator, torch.Generator]:
    dist = torch.Generator().manual_seed(seed)
    sample = torch.Generator().manual_seed(seed + _SPLIT_OFFSET[train])
    return dist, sample


def synthetic_classification(
    n: int = 8192, in_dim: int = 32, num_classes: int = 10, seed: int = 0, train: bool = True
) -> TensorDataset:
    """Gaussian class clusters in a random low-dimensional subspace, plus ambient noise.

    Returns TensorDataset(x (n, in_dim) float32, y (n,) int64). Clusters overlap a little
    (so the loss does not collapse to zero at once) yet the default MLP separates them
    well within ~100 AdamW steps.
    """
    dist, sample = _generators(seed, train)
    latent = min(8, in_dim)
    centres = 2.0 * torch.randn(num_classes, latent, generator=dist)  # (K, latent)
    proj = torch.randn(latent, in_dim, generator=dist) / math.sqrt(latent)  # (latent, D)
    y = torch.randint(num_classes, (n,), generator=sample)  # (n,)
    z = centres[y] + torch.randn(n, latent, generator=sample)  # (n, latent)
    x = z @ proj + 0.3 * torch.randn(n, in_dim, generator=sample)  # (n, D)
    return TensorDataset(x, y)


def synthetic_images(
    n: int = 2048,
    channels: int = 3,
    size: int = 32,
    num_classes: int = 10,
    seed: int = 0,
    train: bool = True,
) -> TensorDataset:
    """Coloured sinusoidal gratings, one orientation/frequency/colour per class, plus noise.

    Each sample has a random phase, so the class is in the texture rather than at fixed
    pixels: a conv net has to learn it. Returns TensorDataset(x (n, C, H, W), y (n,)).
    """
    dist, sample = _generators(seed, train)
    angle = math.pi * torch.arange(num_classes) / num_classes  # (K,) evenly spread
    freq = 2.0 + 4.0 * torch.rand(num_classes, generator=dist)  # (K,) cycles per image
    colour = torch.randn(num_classes, channels, generator=dist)  # (K, C)
    colour = colour / colour.norm(dim=1, keepdim=True) * math.sqrt(channels)

    y = torch.randint(num_classes, (n,), generator=sample)  # (n,)
    phase = 2 * math.pi * torch.rand(n, generator=sample)  # (n,)
    coords = torch.arange(size, dtype=torch.float32) / size  # (S,)
    rows, cols = coords.view(1, size, 1), coords.view(1, 1, size)
    sin, cos = torch.sin(angle[y]).view(n, 1, 1), torch.cos(angle[y]).view(n, 1, 1)
    u = rows * sin + cols * cos  # (n, S, S) position across the grating's stripes
    wave = torch.sin(2 * math.pi * freq[y].view(n, 1, 1) * u + phase.view(n, 1, 1))  # (n, S, S)
    x = colour[y].view(n, channels, 1, 1) * wave.unsqueeze(1)  # (n, C, S, S)
    x = x + 0.5 * torch.randn(n, channels, size, size, generator=sample)
    return TensorDataset(x, y)


def synthetic_tokens(
    n: int = 4096, block_size: int = 32, vocab_size: int = 64, seed: int = 0, train: bool = True
) -> TensorDataset:
    """Sequences from a fixed sparse bigram table: each token has 2 possible successors.

    The best achievable loss is ln 2 ~= 0.69 per token against ln(vocab_size) for a
    uniform guess, so learning shows clearly. Returns TensorDataset(inputs (n, T),
    targets (n, T)) with targets = inputs shifted left by one, T = block_size.
    """
    dist, sample = _generators(seed, train)
    successors = torch.randint(vocab_size, (vocab_size, 2), generator=dist)  # (V, 2)
    seq = torch.empty(n, block_size + 1, dtype=torch.long)  # (n, T+1)
    seq[:, 0] = torch.randint(vocab_size, (n,), generator=sample)
    for t in range(block_size):
        choice = torch.randint(2, (n,), generator=sample)  # (n,)
        seq[:, t + 1] = successors[seq[:, t], choice]
    data = TensorDataset(seq[:, :-1].clone(), seq[:, 1:].clone())
    data.vocab_size = vocab_size  # what model=gpt takes when its vocab_size is null
    return data


# --------------------------------------------------------------------------------------
# torchvision datasets


# torchvision is imported where it is used: importing it imports torch._dynamo, about
# 2.5 s of CPU at start-up that a run on token data never needs.


def _torchvision_dataset(
    cls_name: str, name: str, root: str, train: bool, download: bool, mean_std: tuple
) -> Dataset:
    import torchvision
    from torchvision import transforms

    cls = getattr(torchvision.datasets, cls_name)
    root = os.path.expanduser(os.fspath(root))
    tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize(*mean_std)])
    if download:
        return cls(root, train=train, download=True, transform=tf)
    try:
        return cls(root, train=train, download=False, transform=tf)
    except RuntimeError:
        # torchvision raises RuntimeError for missing or corrupted files; the user's fix
        # is the same either way, so say it in one line.
        raise ConfigError(
            f"{name} not found or incomplete under data root {root!r}; "
            "set data.download=true to download it (or point data.root at a copy)"
        ) from None


def mnist(root: str, train: bool = True, download: bool = False) -> Dataset:
    """torchvision MNIST: samples (1, 28, 28) float normalised, labels int."""
    norm = (0.1307,), (0.3081,)  # mean, std
    return _torchvision_dataset("MNIST", "MNIST", root, train, download, norm)


def cifar10(root: str, train: bool = True, download: bool = False) -> Dataset:
    """torchvision CIFAR-10: samples (3, 32, 32) float normalised, labels int."""
    norm = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)  # mean, std
    return _torchvision_dataset("CIFAR10", "CIFAR-10", root, train, download, norm)


# --------------------------------------------------------------------------------------
# Per-rank batches


class GlobalBatchSampler(Sampler[list[int]]):
    """Yields this rank's share of each global batch, forever, epoch after epoch.

    Epoch e shuffles with `torch.Generator().manual_seed(seed + e)` and cuts the
    permutation into global batches of `global_batch` indices; rank r takes the contiguous
    slice [r*b, (r+1)*b) with b = global_batch // world_size. So the ranks' batches of a
    step, concatenated in rank order, are exactly the batch one process would draw with
    world_size=1: losses and gradients match a single-process run.

    The position (`epoch`, `batch_in_epoch`: the next global batch to hand out) is counted
    in global batches, so a saved state resumes exactly, even under another world size.

    drop_last=True drops the tail of the permutation that does not fill a global batch.
    drop_last=False fills that last batch from the start of the same permutation, so
    every rank still gets b indices (uneven batches would skew the gradient average).
    """

    def __init__(
        self,
        dataset_len: int,
        global_batch: int,
        rank: int,
        world_size: int,
        seed: int,
        drop_last: bool = True,
    ) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ConfigError(f"rank {rank} is not valid for world size {world_size}")
        if global_batch < 1 or global_batch % world_size != 0:
            raise ConfigError(
                f"global batch {global_batch} is not divisible by world size {world_size}"
            )
        if global_batch > dataset_len:
            raise ConfigError(
                f"global batch {global_batch} is larger than the dataset ({dataset_len} samples)"
            )
        self.dataset_len = dataset_len
        self.global_batch = global_batch
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.drop_last = drop_last
        self.local_batch = global_batch // world_size
        if drop_last:
            self.batches_per_epoch = dataset_len // global_batch
        else:
            self.batches_per_epoch = math.ceil(dataset_len / global_batch)
        self.epoch = 0
        self.batch_in_epoch = 0
        self._cached: tuple[int, torch.Tensor] | None = None  # batch_of's epoch, permutation

    def _permutation(self, epoch: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed + epoch)
        perm = torch.randperm(self.dataset_len, generator=g)  # (N,)
        pad = self.batches_per_epoch * self.global_batch - self.dataset_len
        if pad > 0:  # drop_last=False: wrap around to fill the last global batch
            perm = torch.cat([perm, perm[:pad]])
        return perm

    def __iter__(self) -> Iterator[list[int]]:
        lo, hi = self.rank * self.local_batch, (self.rank + 1) * self.local_batch
        while True:
            perm = self._permutation(self.epoch)
            while self.batch_in_epoch < self.batches_per_epoch:
                start = self.batch_in_epoch * self.global_batch
                batch = perm[start : start + self.global_batch]  # (global_batch,)
                # Advance before yielding: the position always names the next batch.
                self.batch_in_epoch += 1
                yield batch[lo:hi].tolist()
            self.epoch += 1
            self.batch_in_epoch = 0

    def batch_of(self, position: int, ranks: Sequence[int]) -> list[int]:
        """The indices that `ranks` take of global batch `position` (counted from epoch 0,
        batch 0), concatenated in the order given: the same as `__iter__` yields to each
        of them, drawn from the position alone ([Note: constant global batch])."""
        epoch, b = divmod(position, self.batches_per_epoch)
        if self._cached is None or self._cached[0] != epoch:
            self._cached = (epoch, self._permutation(epoch))
        batch = self._cached[1][b * self.global_batch : (b + 1) * self.global_batch]
        n = self.local_batch
        return [i for r in ranks for i in batch[r * n : (r + 1) * n].tolist()]

    def seek(self, batches_done: int) -> None:
        """Position at global batch number `batches_done` counted from epoch 0, batch 0.

        A trainer that knows its step count can resume with `seek(step)`. Unlike
        state_dict(), this is exact even with num_workers > 0, where the DataLoader pulls
        indices from the sampler ahead of the batches the trainer has consumed.
        """
        self.epoch, self.batch_in_epoch = divmod(batches_done, self.batches_per_epoch)

    def state_dict(self) -> dict[str, int]:
        epoch, batch = self.epoch, self.batch_in_epoch
        if batch == self.batches_per_epoch:  # finished an epoch; report the next one
            epoch, batch = epoch + 1, 0
        return {
            "epoch": epoch,
            "batch_in_epoch": batch,
            "seed": self.seed,
            "global_batch": self.global_batch,
            "dataset_len": self.dataset_len,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        # The position is only meaningful for the same shuffling and batch cutting.
        for key in ("seed", "global_batch", "dataset_len"):
            if key in state and state[key] != getattr(self, key):
                raise ConfigError(
                    f"sampler state has {key}={state[key]} but this run has "
                    f"{key}={getattr(self, key)}; the data position cannot be resumed"
                )
        self.epoch = int(state["epoch"])
        self.batch_in_epoch = int(state["batch_in_epoch"])


def make_loader(
    dataset: Dataset,
    global_batch: int,
    rank: int,
    world_size: int,
    seed: int,
    num_workers: int = 0,
) -> DataLoader:
    """An endless DataLoader of this rank's batches; its sampler is `loader.batch_sampler`:
    the dataset's own where it has one (token files: trainer/data/tokens.py), else a
    GlobalBatchSampler over its samples."""
    if hasattr(dataset, "batch_sampler"):
        sampler = dataset.batch_sampler(global_batch, rank, world_size, seed)
    else:
        sampler = GlobalBatchSampler(len(dataset), global_batch, rank, world_size, seed)
    return DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=num_workers,
        persistent_workers=num_workers > 0,
        pin_memory=torch.cuda.is_available(),
    )


def make_eval_loader(
    dataset: Dataset,
    global_batch: int,
    rank: int,
    world_size: int,
    max_batches: int | None = None,
) -> DataLoader | EvalParts:
    """This rank's share of a held-out set, in order, once through.

    The set (or its first `max_batches` global batches) is cut into P equal contiguous
    slices, rank r taking the r-th, in batches of global_batch / P. Up to P-1 samples
    left over are not evaluated: every rank must run the same number of forwards, since
    in fsdp a forward is a collective. A dataset in weighted parts (`parts()`: a mix of
    token directories, trainer/data/mix.py) gives EvalParts, each part cut so.
    """
    if hasattr(dataset, "parts"):
        parts = []
        for name, weight, part in dataset.parts():
            try:
                loader = make_eval_loader(part, global_batch, rank, world_size, max_batches)
            except ConfigError as e:
                raise ConfigError(f"{name}: {e}") from None
            parts.append((name, weight, loader))
        return EvalParts(parts)
    local = global_batch // world_size
    per_rank = len(dataset) // world_size
    if max_batches is not None:
        per_rank = min(per_rank, max_batches * local)
    if per_rank == 0:
        raise ConfigError(
            f"the held-out set has {len(dataset)} samples, fewer than the {world_size} ranks"
        )
    indices = range(rank * per_rank, (rank + 1) * per_rank)
    return DataLoader(
        Subset(dataset, indices),
        batch_size=local,
        shuffle=False,
        pin_memory=torch.cuda.is_available(),
    )


class EvalParts:
    """A held-out set in named, weighted parts, each a loader of this rank's batches:
    `evaluate` (trainer/observe/metrics.py) reports each part and their weighted mean
    ([Note: held-out figures of a mix] in trainer/data/mix.py)."""

    def __init__(self, parts: list[tuple[str, float, DataLoader]]) -> None:
        self.parts = parts


def sampler_figures(sampler: Any, steps: int) -> dict[str, float]:
    """What the sampler tells of the first `steps` global batches (a mix: the tokens of
    each source, trainer/data/mix.py), to log; {} for a sampler that tells nothing."""
    figures = getattr(sampler, "figures", None)
    return figures(steps) if figures is not None else {}


class LoaderBatches:
    """A step's batch from the DataLoader (or any iterable of batches), in order: what a
    run of one replica group takes (its sampler's position is the step's)."""

    def __init__(self, loader: Iterable[list[torch.Tensor]]) -> None:
        self.iterator = iter(loader)  # draws from the RNG: before a resume restores it
        self.sampler = getattr(loader, "batch_sampler", None)

    def take(self, step: int, slots: Sequence[int]) -> list[torch.Tensor]:
        return next(self.iterator)

    def figures(self, steps: int) -> dict[str, float]:
        return sampler_figures(self.sampler, steps)


class SlotBatches:
    """A step's batch drawn from the step alone, for the data slots of the replica groups
    `slots` ([Note: constant global batch] in comm/replicas.py): rank r of group g takes
    the sampler's rank g * P + r, so `take(step, (g,))` is what the DataLoader would hand
    that rank, and more groups concatenate their slots in the order given."""

    def __init__(self, loader: DataLoader, rank: int, ranks_per_group: int) -> None:
        self.dataset, self.collate = loader.dataset, loader.collate_fn
        self.sampler = loader.batch_sampler
        self.rank, self.ranks_per_group = rank, ranks_per_group

    def take(self, step: int, slots: Sequence[int]) -> list[torch.Tensor]:
        ranks = [g * self.ranks_per_group + self.rank for g in slots]
        indices = self.sampler.batch_of(step - 1, ranks)  # step 1 takes batch 0
        self.sampler.seek(step)  # what a checkpoint saves: the next batch, as a loader's
        getitems = getattr(self.dataset, "__getitems__", None)
        samples = getitems(indices) if getitems else [self.dataset[i] for i in indices]
        return self.collate(samples)

    def figures(self, steps: int) -> dict[str, float]:
        return sampler_figures(self.sampler, steps)
