"""Rehearse the GPU run without a GPU: the real engines for a few steps on fake CUDA
tensors, one rank of P = 8, 2 and 4 (the first and the last), through every CUDA branch,
with the stream order, buffer lifetimes and host reads checked (docs/gpu_check.md).

    .venv/bin/python scripts/gpu_rehearsal.py              # every combination
    .venv/bin/python scripts/gpu_rehearsal.py -k fsdp      # those whose name has "fsdp"
    .venv/bin/python scripts/gpu_rehearsal.py --coverage   # and count the CUDA-only lines run

One line per combination (`ok` or `FAILED: <why>`), then a verdict; exit status 0 only if
every combination ran. Nothing is allocated and no kernel runs ([Note: fake CUDA tensors]
in trainer/rehearse/cuda.py), so the whole table takes seconds; what it cannot see
(kernels, NCCL itself, real overlap and timing) is scripts/gpu_check.sh's.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import copy
import os
import re
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import yaml  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402
from torch.utils._python_dispatch import _disable_current_modes  # noqa: E402
from tqdm import tqdm  # noqa: E402

from trainer import checkpoint  # noqa: E402
from trainer.checkpoint import agree  # noqa: E402
from trainer.comm import collectives, groups  # noqa: E402
from trainer.config.checks import engine_options  # noqa: E402
from trainer.data.datasets import LoaderBatches  # noqa: E402
from trainer.models import builtin  # noqa: E402
from trainer.models.hooks import model_hooks  # noqa: E402
from trainer.models.materialize import SeededInit, empty_weights  # noqa: E402
from trainer.observe import memory  # noqa: E402
from trainer.observe.memory import MemoryMonitor  # noqa: E402
from trainer.observe.metrics import IntervalMetrics, Rank0Writer, peak_flops  # noqa: E402
from trainer.parallel import build_engine, experts  # noqa: E402
from trainer.rehearse import Checker, fake_cuda, fake_world  # noqa: E402
from trainer.run import dist as tdist  # noqa: E402
from trainer.run import loop  # noqa: E402
from trainer.run.guard import Guard  # noqa: E402
from trainer.run.optim import lr_scheduler, optimizer_factory, param_options  # noqa: E402

# (world size, rank): each world seen from its first and its last rank
WORLDS = [(8, 0), (8, 7), (2, 0), (2, 1), (4, 0), (4, 3)]


@dataclass(frozen=True)
class Combo:
    """One line of the table: Hydra overrides on top of BASE, and what the run does."""

    name: str
    overrides: tuple[str, ...]
    model: str = "gpt"  # gpt | gpt_moe
    steps: int = 2
    resume: bool = False  # save after the steps, build again, resume, one more step
    worlds: tuple[tuple[int, int], ...] = tuple(WORLDS)


BASE = (
    "model.n_layer=2", "model.n_head=2", "model.n_embd=32", "model.block_size=16",
    "train.batch_size=16", "train.steps=4", "train.log_every=2", "train.eval_every=0",
    "train.save_final=false", "ckpt.every=0", "data=tokens",
)  # fmt: skip


def combos() -> list[Combo]:
    out = []
    fsdp = {"fsdp": ("mode=fsdp",), "fsdp-keep": ("mode=fsdp", "mode.reshard_after_forward=false")}
    modes = {"ddp": ("mode=ddp",), "zero": ("mode=zero",), **fsdp}
    for mode, mode_over in modes.items():
        for precision in ("fp32", "bf16"):
            out.append(Combo(f"{mode} {precision}", (*mode_over, f"precision={precision}")))
        out.append(  # the loss scaler on the device, clipping, accumulation
            Combo(
                f"{mode} fp16 (reduced in fp16), clipping, accumulation",
                (
                    *mode_over,
                    "precision=fp16",
                    "optim.clip_grad_norm=1.0",
                    "train.grad_accum_steps=2",
                ),
            )  # fmt: skip
        )
    for mode, mode_over in modes.items():
        int8 = ("mode.reduce_dtype=int8",) + (() if mode == "ddp" else ("mode.gather_dtype=int8",))
        out.append(Combo(f"{mode} int8 communication", (*mode_over, *int8)))
    for mode in ("zero", "fsdp", "fsdp-keep"):
        out.append(
            Combo(
                f"{mode} hybrid sharding (S=2)",
                (*modes[mode], "mode.shard_group_size=2"),
                worlds=tuple(w for w in WORLDS if w[0] > 2),
            )
        )
    for mode, mode_over in modes.items():
        out.append(
            Combo(
                f"{mode} MoE expert parallelism (E=2)",
                (*mode_over, "model=gpt_moe", "mode.expert_parallel=2", "model.n_experts=4"),
                model="gpt_moe",
            )
        )
    for (mode, mode_over), background in zip(
        modes.items(), (False, True, False, True), strict=True
    ):
        what = "async (host copy) " if background else ""
        out.append(
            Combo(
                f"{mode} {what}checkpoint save and resume",
                (*mode_over, f"ckpt.async={str(background).lower()}"),
                resume=True,
                # rank 0 writes meta.pt and commits: a lone other rank has no checkpoint
                # to resume (its own file is written the same way, before the commit)
                worlds=tuple(w for w in WORLDS if w[1] == 0),
            )
        )
    # offload=host ([Note: host offload]): the step on the host, copies on their stream
    host = ("mode.offload=host",)
    for mode in ("zero", "fsdp", "fsdp-keep"):
        for precision in ("fp32", "bf16"):
            out.append(Combo(f"{mode} offload=host {precision}",
                             (*modes[mode], *host, f"precision={precision}")))  # fmt: skip
    out.append(
        Combo(
            "zero offload=host bf16, clipping, accumulation, hybrid sharding (S=2)",
            (
                "mode=zero",
                *host,
                "precision=bf16",
                "optim.clip_grad_norm=1.0",
                "train.grad_accum_steps=2",
                "mode.shard_group_size=2",
            ),
            worlds=tuple(w for w in WORLDS if w[0] > 2),
        )  # fmt: skip
    )
    out.append(
        Combo(
            "fsdp offload=host MoE expert parallelism (E=2)",
            ("mode=fsdp", *host, "model=gpt_moe", "mode.expert_parallel=2", "model.n_experts=4"),
            model="gpt_moe",
        )
    )
    for mode in ("zero", "fsdp"):
        out.append(
            Combo(
                f"{mode} offload=host checkpoint save and resume",
                (*modes[mode], *host, "precision=bf16"),
                resume=True,
                worlds=tuple(w for w in WORLDS if w[1] == 0),
            )
        )
    return out


def worlds_of(i: int, combo: Combo, every: bool) -> list[tuple[int, int]]:
    """Every world of the combination, or (the default, seconds instead of minutes) one,
    in turn down the table: each world and each end of it comes up in every mode."""
    if every:
        return list(combo.worlds)
    return [combo.worlds[i % len(combo.worlds)]]


_composed: dict[tuple[str, ...], Any] = {}


def config(overrides: tuple[str, ...]):
    """Hydra's config for `overrides`: composed once per choice of groups (0.5 s each),
    the other values set on a copy."""
    chosen = tuple(o for o in overrides if o.split("=")[0] in ("mode", "model"))
    chosen = chosen if any(o.startswith("model=") for o in chosen) else ("model=gpt", *chosen)
    if chosen not in _composed:
        with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
            _composed[chosen] = compose("config", overrides=[*chosen, *BASE])
    cfg = copy.deepcopy(_composed[chosen])
    for o in overrides:
        key, value = o.split("=", 1)
        if key not in ("mode", "model"):
            OmegaConf.update(cfg, key, yaml.safe_load(value), force_add=False)
    return cfg


def reset() -> None:
    """What the trainer keeps per process: each combination starts from none of it. The
    bound on unread timing events is lowered so that a few steps pass it (its settle
    without a host sync, [Note: communication streams])."""
    collectives.MAX_PENDING = 8
    collectives._streams.clear()
    collectives.pending_timings.clear()
    collectives.stats.reset()
    for cache in (groups._meshes, groups._second, groups._partition, groups._expert_groups):
        cache.clear()
    groups._across.clear()
    checkpoint.drop_save()


def build(cfg, device: torch.device):
    """The model on meta, the engine as train.py builds it ([Note: building on meta])."""
    torch.manual_seed(cfg.seed)
    with empty_weights():
        if cfg.model._target_.endswith("GPTMoE"):
            model = builtin.GPTMoE(**_sizes(cfg), n_experts=cfg.model.n_experts, top_k=2)
        else:
            model = builtin.GPT(**_sizes(cfg))
    engine = build_engine(
        model,
        cfg.mode.name,
        optimizer_factory(cfg.optim),
        precision=cfg.precision,
        loss_scale=dict(cfg.loss_scale),
        param_options=param_options(cfg.optim),
        source=SeededInit(cfg.seed),
        device=device,
        **engine_options(cfg),
    )
    return engine


def _sizes(cfg) -> dict[str, int]:
    m = cfg.model
    return dict(
        vocab_size=64, block_size=m.block_size, n_layer=m.n_layer, n_head=m.n_head,
        n_embd=m.n_embd,
    )  # fmt: skip


def joined(rank: int, p: int, cfg) -> tdist.DistEnv:
    """trainer/run/dist.py's init as torchrun would have it run on a node of min(P, 8)
    GPUs: the backend resolved to NCCL, this rank's GPU chosen and made current (the
    group itself is the fake world's)."""
    per_node = min(p, 8)
    current = [0]
    saved_env = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", NCCL_ENV)}
    saved = (torch.cuda.is_available, torch.cuda.device_count, torch.cuda.set_device)
    saved_current, tf32 = torch.cuda.current_device, torch.backends.cudnn.allow_tf32
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(p), LOCAL_RANK=str(rank % per_node))
    torch.cuda.is_available, torch.cuda.device_count = (lambda: True), (lambda: per_node)
    torch.cuda.set_device = lambda d: current.__setitem__(0, torch.device(d).index)
    try:
        env = tdist.init(cfg.dist.backend, cfg.dist.timeout_s)
    finally:
        torch.cuda.is_available, torch.cuda.device_count, torch.cuda.set_device = saved
        torch.backends.cudnn.allow_tf32 = tf32
        for k, v in saved_env.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    # "cuda" from now on means this rank's GPU, as after torch.cuda.set_device (the fake
    # mode's cache of op results keys "cuda" without its index: emptied)
    torch.cuda.current_device = lambda: current[0]
    FakeTensorMode.cache_clear()
    _restore.append(lambda: setattr(torch.cuda, "current_device", saved_current))
    return env


_restore: list[Callable[[], None]] = []
NCCL_ENV = "TORCH_NCCL_ASYNC_ERROR_HANDLING"


def make_run(cfg, engine, env, run_dir: Path):
    psi = sum(p.numel() for p in engine.module.parameters())
    scheduler = lr_scheduler(
        engine.optimizer, cfg.optim, cfg.train.steps, on_device=engine.skips_on_device
    )
    metrics = IntervalMetrics(
        env.device,
        memory=MemoryMonitor(engine, psi, cfg.train.peak_every),
        flops_per_token=6 * psi,
        peak_flops=peak_flops(env.device, engine.precision.param_dtype),
    )
    per_rank = cfg.train.batch_size // env.world_size
    block = cfg.model.block_size

    def batches():
        while True:  # on the host, moved by the step as the loader's batches are
            x = torch.randint(0, 64, (per_rank, block))
            yield x, torch.randint(0, 64, (per_rank, block))

    resumable = {"scheduler": scheduler, "loss_scaler": engine.scaler}
    writer = Rank0Writer(run_dir, enabled=False)
    bar = tqdm(total=cfg.train.steps, disable=True)
    return loop.Run(
        cfg, env, run_dir, None, engine, scheduler, LoaderBatches(batches()), None, writer,
        metrics, bar,
        resumable, scheduler.get_last_lr()[0], Guard(env.device), loop.Every.of(cfg),
        model_hooks(engine.module),
    )  # fmt: skip


def rehearse(combo: Combo, p: int, rank: int, tmp: Path) -> str:
    """One combination at one (world size, rank); raises on any violation."""
    cfg = config(combo.overrides)
    max_pending = collectives.MAX_PENDING
    reset()
    try:
        with fake_world(rank, p) as world, fake_cuda() as c, counting_routed():
            values(c, cfg, p)
            env = joined(rank, p, cfg)
            # The rank's GPU, as the loop passes it; MoE rows pass "cuda" (the current
            # device), as a caller of build_engine may
            engine = build(cfg, torch.device("cuda") if combo.model == "gpt_moe" else env.device)
            run = make_run(cfg, engine, env, tmp)
            engine.train()
            for step in range(1, combo.steps + 1):
                with c.step():
                    loop.train_step(run, step)
                if run.every.check(step):
                    loop.check_step(run, step)
                if run.every.log(step):
                    loop.log_metrics(run, step)
            if combo.resume:  # a save, then a load into the same engine and one more step
                path = checkpoint.save(
                    tmp / "ckpt",
                    combo.steps,
                    engine,
                    in_background=bool(cfg.ckpt.get("async")),
                    **run.resumable,
                )
                checkpoint.finish_save()
                start = checkpoint.load(path, engine, **run.resumable)
                with c.step():
                    loop.train_step(run, start + 1)
            memory.measure(engine)  # the memory figures a run reports
            engine.full_state_dict(rank0_only=True)  # the final model a run writes
            c.check()
            return f"{c.ops} ops, {len(world.calls)} collectives"
    finally:
        collectives.MAX_PENDING = max_pending
        while _restore:
            _restore.pop()()


def values(c: Checker, cfg, p: int) -> None:
    """The made-up answers of the host reads the code means to make."""
    c.values["check step"] = lambda t: [0.0] * t.numel()  # no bad step, no stop
    c.values["fp16 found_inf"] = lambda t: 0.0
    c.values["loss scaler"] = lambda t: (
        [float(cfg.loss_scale.init_scale), 0.0, 0.0] if t.numel() == 3 else 0.0
    )
    c.values["async save"] = lambda t: [0.0, 0.0]  # every rank done writing, none failed
    c.values["fsdp gather check"] = lambda t: True
    c.values["lr schedule"] = lambda t: 1 if t.numel() == 1 else [1] * t.numel()
    c.values["checkpoint errors"] = lambda t: [0.0] * t.numel()  # no rank failed
    c.values["checkpoint commit"] = lambda t: [0.0] * t.numel()  # rank 0 committed
    c.values["expert split sizes"] = expert_split_sizes


_routed = [0]  # rows the last MoE layer routed (T * k): balanced split sizes need it


def expert_split_sizes(t: torch.Tensor) -> list[int]:
    """A balanced routing's sizes: each of the n experts (counts: t.numel() == n) gets
    T*k/n rows; under expert parallelism (counts and received, 2n) each source sends the
    same ([Note: routing in a pass without values] in trainer/parallel/experts.py)."""
    n = t.numel()
    if n == 2 * _experts[0]:
        half = experts._balanced_sizes(_routed[0], n // 2)
        return half + half
    return experts._balanced_sizes(_routed[0], n)


_experts = [0]


@contextlib.contextmanager
def counting_routed() -> Iterator[None]:
    counts = experts.expert_counts

    def expert_counts(ids: torch.Tensor, n: int) -> torch.Tensor:
        _routed[0], _experts[0] = ids.numel(), n
        return counts(ids, n)

    # Host arithmetic on the split sizes read already (Python ints): real, as on a GPU
    # machine, where fake tensors could not hold its data-dependent shapes
    major = experts._expert_major

    def expert_major(recv: list[int], e: int, nl: int) -> torch.Tensor:
        with _disable_current_modes():
            return major(recv, e, nl)

    # Every simulated rank does what this one does: a failure here is every rank's
    first_error = agree.first_error

    def own_first_error(error: Any, device: torch.device, *what: str) -> Any:
        agreed = first_error(error, device, *what)
        return agreed if error is None else error

    experts.expert_counts, experts._expert_major = expert_counts, expert_major
    agree.first_error = own_first_error
    try:
        yield
    finally:
        experts.expert_counts, experts._expert_major = counts, major
        agree.first_error = first_error


# ---------------------------------------------------------------------------------------
# Coverage: the lines of trainer/ that run only on CUDA, and which of them the table ran

# A branch taken on CUDA only: its test asks for a CUDA tensor or device, or NCCL
CUDA_TEST = re.compile(
    r'is_cuda|_is_cuda\(|type == "cuda"|cuda\.is_initialized\(\)|cuda\.is_available\(\)|== "nccl"'
)
NO_CUDA = "not torch.cuda.is_available()"  # the refusal of nccl where CUDA is absent
NOT_CUDA_TEST = re.compile(
    r'not _is_cuda\(|not [\w.]+\.is_cuda\b|type != "cuda"|not torch\.cuda\.is_initialized\(\)'
)
# Functions that only CUDA calls (file, name)
CUDA_FUNCTIONS = {
    ("comm/collectives.py", "_wait_cuda"),
    ("comm/collectives.py", "_comm_stream"),
    ("comm/collectives.py", "_timing_event"),
    ("comm/collectives.py", "_add_timing"),
    ("comm/collectives.py", "union_s"),
    ("comm/collectives.py", "_finish_on_comm_stream"),
    ("observe/memory.py", "CudaStepPeak"),
    ("offload/host.py", "_register"),
    ("offload/host.py", "_unregister"),
}
# Why the rehearsal does not reach a CUDA-only line: (file, first line of its branch)
NOT_REACHED = {
    "run/dist.py": "NCCL's own set-up (init_process_group, set_device): the rehearsal "
    "stands a Python process group in for it; scripts/gpu_check.sh runs it",
    "run/profiling.py": "torch.profiler's CUDA activity: kernels only a GPU runs",
    "checkpoint/rng.py": "",
    "offload/host.py": "cudaHostRegister and its unregister: the driver's, patched out here; "
    "scripts/gpu_check.sh runs them (mode.offload=host)",
}


def cuda_only_lines() -> dict[str, set[int]]:
    """file (under trainer/) -> its lines that run on CUDA only."""
    out: dict[str, set[int]] = {}
    for path in sorted((ROOT / "trainer").rglob("*.py")):
        rel = str(path.relative_to(ROOT / "trainer"))
        if rel.startswith("rehearse/"):
            continue
        text = path.read_text()
        tree = ast.parse(text)
        lines: set[int] = set()

        def span(nodes) -> set[int]:
            return {n for node in nodes for n in range(node.lineno, node.end_lineno + 1)}

        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and (rel, node.name) in CUDA_FUNCTIONS:
                lines |= span(node.body)
            if isinstance(node, ast.ClassDef) and (rel, node.name) in CUDA_FUNCTIONS:
                # its methods' bodies: the def lines ran when the module was imported
                defs = [f for f in node.body if isinstance(f, ast.FunctionDef)]
                lines |= span([stmt for f in defs for stmt in f.body])
            for field_name in ("body", "orelse", "finalbody"):
                block = getattr(node, field_name, None)
                if not isinstance(block, list):
                    continue
                for i, stmt in enumerate(block):
                    if not isinstance(stmt, ast.If):
                        continue
                    test = ast.get_source_segment(text, stmt.test) or ""
                    if NOT_CUDA_TEST.search(test):
                        # `if not cuda: ...; return` - what follows runs on CUDA only
                        if stmt.body and isinstance(stmt.body[-1], (ast.Return, ast.Raise)):
                            lines |= span(block[i + 1 :])
                        lines |= span(stmt.orelse)
                    elif CUDA_TEST.search(test) and NO_CUDA not in test:
                        lines |= span(stmt.body)
        if lines:
            out[rel] = lines
    return out


def coverage_table(cov) -> tuple[int, int, list[str]]:
    """(CUDA-only statements, of them run, one line per file)."""
    total = run = 0
    rows = []
    for rel, lines in cuda_only_lines().items():
        _, statements, _, missing, _ = cov.analysis2(str(ROOT / "trainer" / rel))
        mine = sorted(lines & set(statements))
        if not mine:
            continue
        missed = [n for n in mine if n in set(missing)]
        total, run = total + len(mine), run + len(mine) - len(missed)
        rows.append(
            f"trainer/{rel}: {len(mine) - len(missed)} of {len(mine)}"
            + (f" (not run: lines {_ranges(missed)})" if missed else "")
        )
    return total, run, rows


def _ranges(ns: list[int]) -> str:
    out, start = [], None
    for i, n in enumerate(ns):
        if start is None:
            start = n
        if i + 1 == len(ns) or ns[i + 1] != n + 1:
            out.append(str(start) if start == n else f"{start}-{n}")
            start = None
    return ", ".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-k", default="", help="only the combinations whose name contains this")
    ap.add_argument("-v", "--verbose", action="store_true", help="tracebacks of failures")
    ap.add_argument("--coverage", action="store_true", help="count the CUDA-only lines run")
    ap.add_argument(
        "--all-worlds",
        action="store_true",
        help="every combination at P=8, 2, 4, first and last rank",
    )
    args = ap.parse_args(argv)
    chosen = [c for c in combos() if args.k in c.name]
    cov = None
    if args.coverage:
        import coverage

        cov = coverage.Coverage(data_file=None, include=[str(ROOT / "trainer" / "*")])
        cov.start()
    failed = 0
    t0 = time.perf_counter()
    for i, combo in enumerate(chosen):
        t = time.perf_counter()
        problems = []
        worlds = worlds_of(i, combo, args.all_worlds)
        for p, rank in worlds:
            with tempfile.TemporaryDirectory() as tmp:
                try:
                    rehearse(combo, p, rank, Path(tmp))
                except Exception as e:  # every failure is a line of the table
                    first = str(e).splitlines()[0] if str(e) else type(e).__name__
                    problems.append(f"P={p} rank {rank}: {type(e).__name__}: {first}")
                    if args.verbose:
                        traceback.print_exc()
        seen = ", ".join(f"P={p} rank {r}" for p, r in worlds)
        if problems:
            failed += 1
            print(f"{combo.name}: FAILED ({problems[0]})", flush=True)
        else:
            print(f"{combo.name}: ok ({seen}, {time.perf_counter() - t:.1f} s)", flush=True)
    if cov is not None:
        cov.stop()
        total, run, rows = coverage_table(cov)
        print("\n".join(rows))
        share = 100 * run / max(total, 1)
        print(f"CUDA-only lines of trainer/ run: {run} of {total} ({share:.0f}%)")
    print(
        f"gpu_rehearsal: {'PASS' if not failed else 'FAIL'} ({len(chosen) - failed} of "
        f"{len(chosen)} combinations, {time.perf_counter() - t0:.0f} s)"
    )
    return 0 if not failed and chosen else 1


if __name__ == "__main__":
    sys.exit(main())
