"""Shared pieces of the parity tests: tiny models, a fixed data stream, reference runs.

A parity test trains the same model on the same global batches three ways: one process
on the whole batch, our engine on P ranks (each on its slice), and torch's own DDP. The
functions here run inside each rank (see dist_harness) or in the test process.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

IN, OUT = 7, 5


class OddMLP(nn.Module):
    """Parameter shapes chosen so that no size divides evenly by 2, 3 or 4."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(IN, 13)
        self.fc2 = nn.Linear(13, 11)
        self.fc3 = nn.Linear(11, OUT)
        self.scale = nn.Parameter(torch.ones(3, 1, 1))  # odd shape, used via a broadcast

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        h = torch.relu(self.fc2(h))
        return self.fc3(h) * self.scale.mean()


class WithBuffer(OddMLP):
    """A registered buffer that forward reads (rank 0's value must win)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("shift", torch.randn(IN))

    def forward(self, x):
        return super().forward(x + self.shift)


class WithBatchNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(IN, 12)
        self.bn = nn.BatchNorm1d(12)
        self.fc2 = nn.Linear(12, OUT)

    def forward(self, x):
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


class Unused(OddMLP):
    """fc_unused never takes part in forward: it gets no gradient."""

    def __init__(self):
        super().__init__()
        self.fc_unused = nn.Linear(IN, 3)


MODELS = {"mlp": OddMLP, "buffer": WithBuffer, "bn": WithBatchNorm, "unused": Unused}

OPTIMIZERS = {
    # eps 1e-3, not AdamW's 1e-8: with 1e-8 a parameter whose true gradient is 0 (an
    # attention key bias: softmax ignores it) divides rounding noise by its own magnitude
    # and takes lr-sized steps of random sign, so another summation order (world size,
    # another CPU's SIMD kernels) moves it by ~lr. With 1e-3 that noise moves it by ~1e-5 lr.
    "adamw": functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.01, eps=1e-3),
    "sgd": functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9),
}


def make_model(kind: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return MODELS[kind]()


def global_batches(steps: int, batch: int, seed: int = 1234) -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(batch, IN, generator=g), torch.randint(0, OUT, (batch,), generator=g))
        for _ in range(steps)
    ]


def rank_slice(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    b = t.shape[0] // world
    return t[rank * b : (rank + 1) * b]


def assert_state_close(got: dict, want: dict, atol: float = 1e-5, rtol: float = 1e-4) -> None:
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(
            got[k], want[k], atol=atol, rtol=rtol, msg=lambda m, k=k: f"{k}: {m}"
        )


# ---------------------------------------------------------------------------------------
# Bigger model kinds for the sharded modes: a small GPT (several blocks, tied or not) on
# tokens and resnet18 on small images, each with its own data; MLP kinds keep theirs.

VOCAB, SEQ = 17, 8


def _gpt(tie: bool) -> nn.Module:
    from trainer.models.builtin import GPT

    return GPT(vocab_size=VOCAB, block_size=SEQ, n_layer=3, n_head=3, n_embd=15, tie_weights=tie)


def _resnet18() -> nn.Module:
    from trainer.models.builtin import resnet18

    return resnet18(num_classes=OUT)


MODELS.update(
    gpt=functools.partial(_gpt, False), gpt_tied=functools.partial(_gpt, True), resnet18=_resnet18
)


def batches(kind: str, steps: int, batch: int, seed: int = 1234) -> list[tuple[torch.Tensor, ...]]:
    """`global_batches` for the MLP kinds; tokens for the GPTs, 3x16x16 images for resnet."""
    g = torch.Generator().manual_seed(seed)
    if kind.startswith("gpt"):
        return [
            tuple(torch.randint(0, VOCAB, (batch, SEQ), generator=g) for _ in range(2))
            for _ in range(steps)
        ]
    if kind == "resnet18":
        return [
            (
                torch.randn(batch, 3, 16, 16, generator=g),
                torch.randint(0, OUT, (batch,), generator=g),
            )
            for _ in range(steps)
        ]
    return global_batches(steps, batch, seed)


def any_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross entropy over every prediction: (B, C) vs (B,) or (B, T, V) vs (B, T)."""
    return nn.functional.cross_entropy(logits.flatten(0, -2), targets.flatten())


def train_single(kind: str, optim: str, steps: int, batch: int, accum: int = 1) -> dict:
    """One process, whole global batch: the ground truth."""
    model = make_model(kind, seed=0)
    opt = OPTIMIZERS[optim](model.parameters())
    for x, y in batches(kind, steps, batch):
        for xs, ys in zip(x.chunk(accum), y.chunk(accum), strict=True):
            (any_loss(model(xs), ys) / accum).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train_rank(env, kind, steps, batch, accum, forward, backward, no_sync, step) -> None:
    for x, y in batches(kind, steps, batch):
        xr, yr = rank_slice(x, env.rank, env.world_size), rank_slice(y, env.rank, env.world_size)
        micro = list(zip(xr.chunk(accum), yr.chunk(accum), strict=True))
        for i, (xs, ys) in enumerate(micro):
            if i < accum - 1:
                with no_sync():
                    backward(any_loss(forward(xs), ys) / accum)
            else:
                backward(any_loss(forward(xs), ys) / accum)
        step()


def train_engine(
    env, mode: str, kind: str, optim: str, steps: int, batch: int, accum: int = 1, **options
) -> dict:
    """Our engine on this rank's slice. The model is built with a rank-dependent seed, so
    that the build-time broadcast is exercised."""
    from trainer.parallel import build_engine

    engine = build_engine(
        make_model(kind, seed=env.rank), mode=mode, optimizer=OPTIMIZERS[optim], **options
    )
    _train_rank(
        env, kind, steps, batch, accum, engine, engine.backward, engine.no_sync, engine.step
    )
    return engine.full_state_dict()


def train_torch_ddp(env, kind: str, optim: str, steps: int, batch: int, accum: int = 1) -> dict:
    """torch's own DistributedDataParallel on the same slices."""
    ddp = nn.parallel.DistributedDataParallel(make_model(kind, seed=env.rank))
    opt = OPTIMIZERS[optim](ddp.parameters())

    def ddp_step() -> None:
        opt.step()
        opt.zero_grad()

    _train_rank(
        env, kind, steps, batch, accum, ddp, lambda loss: loss.backward(), ddp.no_sync, ddp_step
    )
    return {k: v.detach().clone() for k, v in ddp.module.state_dict().items()}


def train_engine_and_torch_ddp(
    env, mode: str, kind: str, optim: str, steps: int, batch: int, accum: int = 1, **options
) -> tuple[dict, dict]:
    """Our engine, then torch DDP, in one process group; returns both final state_dicts."""
    ours = train_engine(env, mode, kind, optim, steps, batch, accum, **options)
    return ours, train_torch_ddp(env, kind, optim, steps, batch, accum)


def local_checkpoint_data(engine) -> tuple[dict[str, torch.Tensor], list]:
    """What this rank's checkpoint file would hold (state.data_to_write: `params/i`,
    `optim/i/k`, rank 0's `replicated/KEY`), as CPU tensors by entry name, and the
    optimizer's other state (step counters) per group; no communication. For comparing
    two engines' states without writing files."""
    from trainer.parallel.state import data_to_write

    entries, scalars = data_to_write(engine)
    out = {}
    for name, dtype, shape, segments in entries:
        # an int segment is a run of zeros (no optimizer state there)
        parts = [
            torch.zeros(s, dtype=dtype) if isinstance(s, int) else s.reshape(-1).to("cpu", dtype)
            for s in segments
        ]
        out[name] = torch.cat(parts).reshape(shape)
    return out, scalars
