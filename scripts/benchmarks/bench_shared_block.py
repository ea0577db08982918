"""Peak memory of a weight-shared block called again after other blocks: mode=fsdp
(reshard_after_forward=true) against torch FSDP2, side by side in one run: the table of
docs/control_flow.md, "A unit called again after another".

    python scripts/benchmarks/bench_shared_block.py --nproc 2 --others 3,8,16 \
        --pattern between,before_each --registered first,last --md shared.md
    torchrun --standalone --nproc-per-node=2 scripts/benchmarks/bench_shared_block.py ...  # same

The model: N other residual blocks and `shared`, then a linear head; each block is two
Linear(width, width). `--pattern between`: `shared`, the N others, `shared` again (`x =
shared(x); for o in others: x = o(x); x = shared(x)`); `before_each`: `shared` before
each other block, N calls (`for o in others: x = o(shared(x))`, ALBERT's). `--registered
first` assigns `shared` before the others in `__init__`, `last` after them (the order of
the module's parameters and of fsdp's units). Ours: `build_engine(model, "fsdp", ...)`,
every block a unit. FSDP2: `fully_shard` on every block, then on the root,
reshard_after_forward=True, as its own tests do. Both step AdamW.

What is measured: the live memory of each rank, the C heap in use (every tensor's
storage on CPU comes from malloc: [Note: the CPU step peak] in trainer/observe/heap.py),
sampled before and after every block's forward and at the start and the end of every
block's backward (hooks on its output's and its input's gradient). A step's peak above
its steady state is the highest sample minus the heap in use when its forward starts
(model state and optimizer state then live; from the second step on, AdamW's moments
exist), in units of one block's fp32 parameters; the table gives the highest over the
measured steps and the ranks, and the first step's apart (`first`: its forward comes
before any call order is known). Activations count too (the same in both: a batch of
`--batch-per-rank` rows is small against a block), and so does the summed gradient of
the shared block, which autograd keeps between its calls' backwards in both.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from scripts.benchmarks.bench import launch, report, without_nproc  # noqa: E402
from trainer import comm  # noqa: E402
from trainer.observe.heap import heap_bytes  # noqa: E402

CONTENDERS = ("fsdp", "torch_fsdp2")
PATTERNS = ("between", "before_each")
REGISTERED = ("first", "last")  # `shared` assigned before the other blocks, or after them


class Block(nn.Module):
    """A residual block of two Linear(width, width); its class name makes it an fsdp unit
    (trainer.parallel.units.DEFAULT_UNIT_CLASSES)."""

    def __init__(self, width: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(x)))


class SharedBlock(nn.Module):
    """N other blocks and `shared`, registered in the order `registered` says, called in
    `pattern`'s, then a head."""

    def __init__(self, n: int, width: int, pattern: str = "between", registered: str = "first"):
        super().__init__()
        if pattern not in PATTERNS or registered not in REGISTERED:
            raise ValueError(
                f"pattern {pattern!r} of {PATTERNS}, registered {registered!r} of {REGISTERED}"
            )
        self.pattern = pattern
        if registered == "first":
            self.shared = Block(width)
        self.others = nn.ModuleList(Block(width) for _ in range(n))
        if registered == "last":
            self.shared = Block(width)
        self.head = nn.Linear(width, 1)

    def blocks(self) -> list[nn.Module]:
        return [self.shared, *self.others]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pattern == "before_each":
            for other in self.others:
                x = other(self.shared(x))
            return self.head(x)
        x = self.shared(x)
        for other in self.others:
            x = other(x)
        return self.head(self.shared(x))


class _Samples:
    """The highest heap in use since `start()`, above the heap at `start()`."""

    def __init__(self) -> None:
        self.base = self.high = heap_bytes()

    def start(self) -> None:
        self.base = self.high = heap_bytes()

    def sample(self, *_: object) -> None:
        self.high = max(self.high, heap_bytes())

    def watch(self, block: nn.Module) -> None:
        """Sample before and after its forward, and at the start (its output's gradient)
        and the end (its input's gradient) of its backward. Registered after the engine's
        hooks: a sample sees what the engine gathered for the block."""

        def before(module: nn.Module, args: tuple) -> None:
            self.sample()
            for t in args:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(lambda g: self.sample())

        def after(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
            self.sample()
            if out.requires_grad:
                out.register_hook(lambda g: self.sample())

        block.register_forward_pre_hook(before)
        block.register_forward_hook(after)


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    return sum(
        {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values()
    )


def _ours(model: nn.Module, lr: float) -> tuple[Callable, Callable, Callable]:
    from functools import partial

    from trainer.parallel import build_engine

    engine = build_engine(
        model, "fsdp", partial(torch.optim.AdamW, lr=lr), reshard_after_forward=True
    )

    def step() -> None:
        engine.step()
        engine.zero_grad()  # set to None, as FSDP2's below and the training loop

    return engine, step, lambda: _storage_bytes(engine.grad_tensors()[0])


def _torch_fsdp2(model: nn.Module, lr: float) -> tuple[Callable, Callable, Callable]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (comm.world_size(),))
    for block in model.blocks():
        fully_shard(block, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, reshard_after_forward=True)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)

    def step() -> None:
        opt.step()
        opt.zero_grad(set_to_none=True)

    def slices() -> int:  # DTensor gradients: this rank's shards
        return _storage_bytes([p.grad.to_local() for p in model.parameters() if p.grad is not None])

    return model, step, slices


def peak_units(
    contender: str,
    n: int,
    width: int = 256,
    batch: int = 8,
    steps: int = 3,
    pattern: str = "between",
    registered: str = "first",
) -> dict[str, float]:
    """This rank's highest peak above steady state over steps 2..`steps` (1-based) of a
    model with the shared block and `n` others (`SharedBlock`'s `pattern` and
    `registered`) (`peak`), the first step's peak above its start (`first`), and the
    gradient slices this rank holds after a backward (`grad_slices`: model state that
    appears during backward, the optimizer's gradients), all in units of one block's
    fp32 parameters. Needs a process group (every rank calls it alike)."""
    import gc

    gc.collect()  # the last case's engine (hooks make cycles) is not freed mid-measure
    torch.manual_seed(0)
    model = SharedBlock(n, width, pattern, registered)
    unit = sum(p.numel() for p in model.shared.parameters()) * 4
    run, step, slices = (_ours if contender == "fsdp" else _torch_fsdp2)(model, 1e-3)
    samples = _Samples()
    for block in model.blocks():
        samples.watch(block)
    g = torch.Generator().manual_seed(comm.rank())
    high = first = 0
    for i in range(steps):
        x = torch.randn(batch, width, generator=g)
        samples.start()
        run(x).square().mean().backward()
        grads = slices()
        step()
        if i:  # the first step builds AdamW's moments: no steady state before it
            high = max(high, samples.high - samples.base)
        else:
            first = samples.high - samples.base
    del run, step, model
    return {"peak": high / unit, "first": first / unit, "grad_slices": grads / unit}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--others", default="3,8,16", help="other blocks (N), comma-separated")
    ap.add_argument("--pattern", default=",".join(PATTERNS), help=f"of {PATTERNS}")
    ap.add_argument("--registered", default=",".join(REGISTERED), help=f"of {REGISTERED}")
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--batch-per-rank", type=int, default=8)
    ap.add_argument("--steps", type=int, default=4, help="steps each; the first unmeasured")
    ap.add_argument("--nproc", type=int, default=2, help="ranks, when not under torchrun")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--md", type=Path)
    args = ap.parse_args(argv)
    for flag, valid in (("pattern", PATTERNS), ("registered", REGISTERED)):
        if unknown := set(getattr(args, flag).split(",")) - set(valid):
            ap.error(f"--{flag}: {', '.join(sorted(unknown))} is none of {', '.join(valid)}")
    return args


def run(args: argparse.Namespace) -> dict | None:
    from trainer.run import dist as tdist

    env = tdist.init("gloo")
    rows = {}
    cases = [(p, r) for p in args.pattern.split(",") for r in args.registered.split(",")]
    # Unmeasured: the process's first collectives and ops allocate what it keeps (Gloo's
    # buffers, thread pools), which would count in the first case's first step.
    peak_units("fsdp", 1, args.width, args.batch_per_rank, 2)
    peak_units("torch_fsdp2", 1, args.width, args.batch_per_rank, 2)
    for pattern, registered in cases:
        for n in (int(v) for v in args.others.split(",")):
            for contender in CONTENDERS:
                mine = peak_units(
                    contender, n, args.width, args.batch_per_rank, args.steps, pattern, registered
                )
                rows[f"{pattern} {registered} {contender} N={n}"] = comm.all_gather_object(mine)
    tdist.shutdown()
    if env.rank != 0:
        return None
    return {"world_size": env.world_size, "width": args.width, "peaks": rows}


def markdown(result: dict) -> str:
    """Per pattern, registration order and contender, for each N: the highest peak over
    the ranks, that peak less the rank's gradient slices (in brackets), and the first
    step's peak."""
    ns = sorted({int(k.split("N=")[1]) for k in result["peaks"]})
    cases = list(dict.fromkeys(k.rsplit(" ", 2)[0] for k in result["peaks"]))
    head = "| pattern | shared registered | contender | " + " | ".join(f"N = {n}" for n in ns)
    lines = [head + " |", "|---" * (len(ns) + 3) + "|"]
    for case in cases:
        pattern, registered = case.split()
        for c in CONTENDERS:
            cells = []
            for n in ns:
                ranks = result["peaks"][f"{case} {c} N={n}"]
                peak = max(r["peak"] for r in ranks)
                beyond = max(r["peak"] - r["grad_slices"] for r in ranks)
                first = max(r["first"] for r in ranks)
                cells.append(f"{peak:.1f} ({beyond:.1f}); first {first:.1f}")
            lines.append(f"| {pattern} | {registered} | {c} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if "RANK" not in os.environ:  # not under torchrun: launch it, with these arguments
        sys.exit(launch(__file__, args.nproc, without_nproc(argv)))
    result = run(args)
    if result:
        report(result, markdown(result), args.out, args.md)


if __name__ == "__main__":
    main()
