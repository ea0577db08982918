"""mode.offload=disk: the offload file, and zero and fsdp with their optimizer state in it,
bitwise against offload=null ([Note: offloaded state] in trainer/offload/state.py); and
mode.offload=host's bookkeeping, run on CPU tensors ([Note: host offload] in
trainer/offload/host.py), bitwise against offload=null too.

One group per world size (P = 1, 2, 4) trains every case twice, without and with offload,
in one set of worker processes; the tests compare what each run returned. Bitwise: the
offloaded step runs the same kernels on the same tensors, only one buffer at a time, and
the state goes through the file byte for byte, so no tolerance applies."""

from __future__ import annotations

import errno
import functools
import os
import shutil
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
from dist_harness import run_distributed

from trainer.errors import ConfigError, StorageError
from trainer.offload.disk import OffloadFile, aligned

# -- the file --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_regions_round_trip_bit_for_bit(tmp_path, dtype):
    f = OffloadFile(tmp_path / "rank0.offload", 3 * 4096)
    try:
        values = torch.randn(1000).to(dtype)
        f.write(values, 4096)  # a page-aligned region, a whole number of pages
        back = torch.empty_like(values)
        f.read(back, 4096)
        assert f.direct  # past the page cache ([Note: the offload file])
        part = torch.empty(10, dtype=dtype)  # any bytes of it, as a checkpoint reads them
        f.read(part, 4096 + 20 * values.element_size())
        assert torch.equal(part.view(torch.uint8), values[20:30].view(torch.uint8))
        assert torch.equal(back.view(torch.uint8), values.view(torch.uint8))
        assert os.stat(f.path).st_size == 3 * 4096  # reserved in full at start
    finally:
        f.close()
    assert not f.path.exists()  # removed when the run ends


def test_a_full_disk_is_refused_at_start_in_one_line(tmp_path):
    free = shutil.disk_usage(tmp_path).free
    path = tmp_path / "rank0.offload"
    with pytest.raises(StorageError) as e:
        OffloadFile(path, free + 2**30)  # a real ENOSPC from posix_fallocate
    line = str(e.value)
    assert "\n" not in line and str(path) in line and "free" in line and str(free + 2**30) in line
    assert not path.exists()  # nothing left behind


def test_a_file_left_by_a_killed_run_is_replaced_not_grown(tmp_path):
    path = tmp_path / "rank0.offload"
    path.write_bytes(b"x" * 3 * 4096)
    f = OffloadFile(path, 4096)
    try:
        assert os.stat(path).st_size == 4096
    finally:
        f.close()


def test_a_truncated_file_is_an_error_naming_it(tmp_path):
    f = OffloadFile(tmp_path / "rank0.offload", 2 * 4096)
    try:
        f.write(torch.ones(1024), 4096)
        os.truncate(f.path, 4096 + 100)
        with pytest.raises(StorageError, match="truncated") as e:
            f.check()
        assert str(f.path) in str(e.value)
        with pytest.raises(StorageError, match="ends at byte 4196") as e:
            f.read(torch.empty(1024), 4096)
        assert str(f.path) in str(e.value) and "\n" not in str(e.value)
    finally:
        f.close()


def test_a_removed_or_replaced_file_is_an_error_naming_it(tmp_path):
    f = OffloadFile(tmp_path / "rank0.offload", 4096)
    try:
        f.path.unlink()
        with pytest.raises(StorageError, match="was removed") as e:
            f.check()
        assert str(f.path) in str(e.value)
        f.path.write_bytes(bytes(4096))  # another file under the name
        with pytest.raises(StorageError, match="replaced"):
            f.check()
    finally:
        f.close()
    assert f.path.exists()  # not ours: left alone


def test_a_failed_write_behind_surfaces_at_its_wait(tmp_path, monkeypatch):
    f = OffloadFile(tmp_path / "rank0.offload", 4096)

    def eio(*args):
        raise OSError(errno.EIO, "Input/output error")

    try:
        monkeypatch.setattr(os, "pwrite", eio)
        pending = f.write_async([(0, 4096, [(torch.ones(8), 0)])])
        with pytest.raises(StorageError, match=r"write of bytes \[0, 4096\).*EIO"):
            pending.result()
    finally:
        monkeypatch.undo()
        f.close()


# -- refusals, before anything is built --------------------------------------------------------


@pytest.mark.parametrize(
    "mode, offload, needle",
    [
        ("ddp", "disk", "ddp replicates every state on every rank; use mode=zero"),
        ("zero", "host", "use mode.offload=disk"),
        ("fsdp", "nvme", "mode.offload='nvme' is not one of null, host, disk"),
    ],
)
def test_what_offload_cannot_do_is_refused_in_one_line(tmp_path, mode, offload, needle):
    from trainer.parallel import build_engine

    model = torch.nn.Linear(4, 4)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ConfigError) as e:
        build_engine(model, mode, torch.optim.SGD, offload=offload, offload_dir=tmp_path)
    assert needle in str(e.value) and "\n" not in str(e.value)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    "offload, options, needle",
    [
        ("host", {"precision": "fp16"}, "mode.offload=host with precision=fp16 is not built"),
        ("host", {"gather_dtype": "int8"}, "quantizes the fp32 master on the device"),
        ("disk", {}, "mode.offload=disk on CUDA is not built: use mode.offload=host"),
    ],
)
def test_what_offload_cannot_do_on_cuda_is_refused_in_one_line(tmp_path, offload, options, needle):
    from trainer.parallel import build_engine

    model = torch.nn.Linear(4, 4)  # refused on what it is asked, before any CUDA call
    with pytest.raises(ConfigError) as e:
        build_engine(model, "zero", torch.optim.SGD, offload=offload, offload_dir=tmp_path,
                     device="cuda", **options)  # fmt: skip
    assert needle in str(e.value) and "\n" not in str(e.value)
    assert not list(tmp_path.iterdir())


# -- training: every case without and with offload -------------------------------------------

STEPS = 3


def _model(variant: str = "mlp") -> torch.nn.Module:
    torch.manual_seed(0)
    if variant == "moe":  # experts spread over 2 ranks (expert parallelism)
        from trainer.models.builtin import GPTMoE

        return GPTMoE(vocab_size=16, block_size=8, n_layer=2, n_head=2, n_embd=16, n_experts=4,
                      top_k=2)  # fmt: skip
    # repeated Linears: several fsdp units; a LayerNorm; zero cuts it into several buckets
    nn = torch.nn
    return nn.Sequential(
        nn.Linear(12, 24), nn.LayerNorm(24), nn.Linear(24, 24), nn.ReLU(), nn.Linear(24, 6)
    )


# what each variant adds to the engine's options
VARIANTS = {"mlp": {}, "hybrid": {"shard_group_size": 2}, "moe": {"expert_parallel": 2}}


def _loss(engine, variant: str, g: torch.Generator, accum: int) -> torch.Tensor:
    if variant == "moe":
        tokens = torch.randint(0, 16, (2, 9), generator=g)
        logits = engine(tokens[:, :-1]).float()
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    x, y = torch.randn(4, 12, generator=g), torch.randn(4, 6, generator=g)
    return (engine(x).float() - y).square().mean() / accum


def _optimizer(name: str):
    # AdamW with eps=1e-3: rounding noise on a gradient near zero stays far below lr
    if name == "adamw":
        return functools.partial(torch.optim.AdamW, lr=1e-2, eps=1e-3, weight_decay=0.1)
    return functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9)


def _no_decay(name: str, p: torch.nn.Parameter) -> dict:
    return {"weight_decay": 0.0} if p.dim() == 1 else {}  # two param groups


def _train(env, mode, precision, optim, accum, variant, offload, directory, save=None, resume=None):
    """STEPS steps (accumulation, clipping, an lr schedule) of `mode`; returns the whole
    final state, the resident optimizer (and master) bytes after each step, the largest
    resident while a step ran and the largest buffer's state."""
    from trainer import checkpoint
    from trainer.parallel import build_engine

    on_host = offload == "host"
    engine = build_engine(
        _model(variant), mode, _optimizer(optim), precision=precision, param_options=_no_decay,
        bucket_mb=0.002, offload=None if on_host else offload, offload_dir=directory,
        **VARIANTS[variant],
    )  # fmt: skip
    if on_host:  # the GPU path on CPU tensors: copies are plain copies, no streams
        engine.offload_to_host()
    from trainer.run.optim import lr_scheduler

    optim_cfg = {"schedule": "cosine", "warmup_steps": 1, "min_lr_ratio": 0.1}
    schedule = lr_scheduler(engine.optimizer, optim_cfg, STEPS, engine.skips_on_device)

    def resident(kind: str) -> int:
        # per-element tensors: not the step counters (0-d, kept in memory)
        tensors = engine.state_tensors().get(kind, [])
        return sum(t.untyped_storage().nbytes() for t in tensors if t.dim() > 0)

    saved = None  # the whole state at the save, or as loaded when nothing was left to train
    in_step: list[int] = []  # before each call of the optimizer's step: one per buffer
    engine.optimizer.register_step_pre_hook(lambda *a: in_step.append(resident("optimizer")))
    start = 0
    if resume is not None:
        cfg = {"ckpt": {"every": 1, "dir": str(resume), "keep": 2}, "resume": "auto"}
        from omegaconf import OmegaConf

        cfg = OmegaConf.create({**cfg, "train": {"steps": STEPS}})
        start = checkpoint.maybe_resume(cfg, engine, Path("unused"), scheduler=schedule)
    after: list[tuple[int, int]] = []
    for step in range(start + 1, STEPS + 1):
        g = torch.Generator().manual_seed(100 * step + env.rank)
        for micro in range(accum):
            with engine.no_sync() if micro < accum - 1 else nullcontext():
                engine.backward(_loss(engine, variant, g, accum))
        engine.clip_grad_norm_(0.5)
        schedule.step(engine.step())
        after.append((resident("optimizer"), resident("master")))
        if save is not None and step == save[1]:
            checkpoint.save(save[0], step, engine, scheduler=schedule)
            saved = engine.full_state_dict()
    if start and not after:  # resumed at the last step: what was loaded
        saved = engine.full_state_dict()
    largest, estimated, measured = 0, None, None
    if on_host:  # where the optimizer's tensors are: the arena, sized to the byte
        arena = engine.offload.arena
        regions = sum(aligned(b.shard_numel * 4) for b in engine.offload.buffers)
        steps = [p for g in engine.optimizer.param_groups for p in g["params"] if p.numel()]
        at = arena.bytes.untyped_storage().data_ptr()
        measured = {
            "arena": arena.nbytes,
            "regions": 2 * regions,  # a master and a gradient per buffer
            "stepped_in_arena": all(p.untyped_storage().data_ptr() == at for p in steps),
            "host_bytes": engine.offload.host_bytes(),
            "estimated": _estimate(mode, precision, optim, env.world_size, "host")
            if variant == "mlp"
            else None,
            "state_bytes": sum(
                v.untyped_storage().nbytes()
                for st in engine.optimizer.state.values()
                for v in st.values()
                if torch.is_tensor(v) and v.dim() > 0
            ),
        }
    elif engine.offload is not None:  # one buffer's state, as the file lays it out
        largest = max(len(engine.offload.keys) * b.shard_numel * 4 for b in engine.offload.buffers)
        if variant == "mlp":
            estimated = _estimate(mode, precision, optim, env.world_size)
        per_element = [
            v.numel() * v.element_size()
            for st in engine.optimizer.state.values()
            for k, v in st.items()
            if k != "step" and torch.is_tensor(v)
        ]
        measured = {"file_bytes": engine.offload.nbytes, "optimizer_in_file": sum(per_element)}
    state = engine.full_state_dict()
    path = engine.offload.file.path if engine.offload is not None and not on_host else None
    engine.close()
    return {
        "state": state,
        "saved": saved,
        "after": after,
        "in_step": in_step,
        "largest": largest,
        "estimated": estimated,
        "measured": measured,
        "file_left": path is not None and path.exists(),
    }


def _estimate(mode: str, precision: str, optim: str, world: int, kind: str = "disk") -> dict:
    """What the estimator (trainer/estimate/layout.py) says of this rank 0's offload."""
    from trainer.estimate import layout
    from trainer.parallel.precision import Precision

    with torch.device("meta"):
        model = _model()
    options = {"bucket_mb": 0.002}
    plan = layout.plan(mode, model, options, _no_decay, world)
    opt = layout.optimizer_state(_optimizer(optim))
    of = layout.host_offload if kind == "host" else layout.offload
    return of(plan, Precision.of(precision), opt)


CASES = [
    (mode, precision, optim, accum, "mlp")
    for mode in ("zero", "fsdp")
    for precision in ("fp32", "bf16", "fp16")
    for optim, accum in (("adamw", 2), ("sgd", 1))
]
# hybrid sharding (2 shard groups of 2) at P = 4; experts over 2 ranks at P = 2
MORE = [(m, p, "adamw", 1, v) for v in ("hybrid", "moe") for m, p in (("zero", "bf16"),
        ("fsdp", "fp32"))]  # fmt: skip


def _all_cases(env, root: str, cases: list) -> dict:
    out = {}
    for case in cases:
        directory = Path(root) / "-".join(map(str, case))
        offloads = (None, "disk", "host") if _host_too(env.world_size, case) else (None, "disk")
        out[case] = [_train(env, *case, off, directory) for off in offloads]
    return out


def _host_too(world: int, case: tuple) -> bool:
    """offload=host runs beside: at P = 2, and hybrid sharding at P = 4; not fp16, which
    host offload refuses (build_engine)."""
    return case[1] != "fp16" and (world == 2 or case[4] == "hybrid")


# P = 2 runs every case; P = 1 and 4 the AdamW ones (accumulation, both precisions' paths)
WORLD_CASES = [(w, c) for w in (1, 2, 4) for c in CASES if w == 2 or c[2] == "adamw"]
WORLD_CASES += [(4 if c[4] == "hybrid" else 2, c) for c in MORE]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """world size -> every rank's results of its cases, one group per world size."""
    cache: dict[int, list] = {}

    def of(world: int) -> list:
        if world not in cache:
            root = tmp_path_factory.mktemp(f"offload{world}")
            cases = [c for w, c in WORLD_CASES if w == world]
            cache[world] = run_distributed(_all_cases, world, str(root), cases, timeout=600)
        return cache[world]

    return of


def _case_id(wc) -> str:
    return f"P{wc[0]}-" + "-".join(map(str, wc[1]))


@pytest.mark.parametrize("world_case", WORLD_CASES, ids=_case_id)
def test_offload_disk_is_bitwise_offload_null(runs, world_case):
    world, case = world_case
    for rank, got in enumerate(runs(world)):
        plain, offloaded = got[case][:2]
        assert plain["state"].keys() == offloaded["state"].keys()
        for k, v in plain["state"].items():
            assert torch.equal(v, offloaded["state"][k]), f"P={world} rank {rank}: {k} differs"


HOST_CASES = [wc for wc in WORLD_CASES if _host_too(*wc)]


@pytest.mark.parametrize("world_case", HOST_CASES, ids=_case_id)
def test_offload_host_is_bitwise_offload_null(runs, world_case):
    world, case = world_case
    for rank, got in enumerate(runs(world)):
        plain, on_host = got[case][0], got[case][2]
        assert plain["state"].keys() == on_host["state"].keys()
        for k, v in plain["state"].items():
            assert torch.equal(v, on_host["state"][k]), f"P={world} rank {rank}: {k} differs"


@pytest.mark.parametrize("world_case", HOST_CASES, ids=_case_id)
def test_offload_host_steps_host_masters_in_an_arena_sized_to_the_byte(runs, world_case):
    world, case = world_case
    for got in runs(world):
        m = got[case][2]["measured"]
        assert m["stepped_in_arena"]  # the optimizer steps the host masters, nothing else
        assert m["arena"] == m["regions"]  # no rounding up beyond each region's page
        assert m["state_bytes"] > 0  # the moments exist, on the host, beside the arena
        assert m["host_bytes"] == m["arena"] + m["state_bytes"]
    est = runs(world)[0][case][2]["measured"]["estimated"]  # rank 0's, as the estimator
    if est is not None:
        m = runs(world)[0][case][2]["measured"]
        assert (est["arena_bytes"], est["host_bytes"]) == (m["arena"], m["host_bytes"])


@pytest.mark.parametrize("world_case", WORLD_CASES, ids=_case_id)
def test_offloaded_state_is_out_of_memory_between_steps(runs, world_case):
    world, case = world_case
    mode, precision = case[0], case[1]
    for got in runs(world):
        plain, offloaded = got[case][:2]
        # Live storages: the optimizer's state and (zero in bf16/fp16) the masters
        assert all(opt > 0 for opt, _ in plain["after"])
        assert all(opt == 0 for opt, _ in offloaded["after"])
        masters_move = mode == "zero" and precision != "fp32"
        if masters_move:
            assert all(m > 0 for _, m in plain["after"])
            assert all(m == 0 for _, m in offloaded["after"])
        # While a step runs: at most three buffers' state (the one written behind, the
        # one stepping, the one read ahead), never the whole state
        assert max(offloaded["in_step"]) <= 3 * offloaded["largest"]
        assert max(offloaded["in_step"]) < max(plain["in_step"])
        assert not offloaded["file_left"]


# (the plans of MoE and hybrid runs are tests/test_estimate.py's)
@pytest.mark.parametrize(
    "world_case", [wc for wc in WORLD_CASES if wc[1][4] == "mlp"], ids=_case_id
)
def test_the_estimate_of_the_offload_file_is_exact(runs, world_case):
    world, case = world_case
    got = runs(world)[0][case][1]  # rank 0, offloaded: the rank the estimate describes
    est, measured = got["estimated"], got["measured"]
    assert est["file_bytes"] == measured["file_bytes"]
    assert est["optimizer_in_file_bytes"] == measured["optimizer_in_file"]


def _file_goes_away(env, root: str) -> dict:
    """One step with offload, then the file removed or truncated under the run: the next
    step's error, and whether the parameters moved."""
    from trainer.parallel import build_engine

    out = {}
    for damage in ("removed", "truncated"):
        engine = build_engine(
            _model(), "zero", _optimizer("adamw"), precision="bf16", bucket_mb=0.002,
            offload="disk", offload_dir=Path(root) / damage,
        )  # fmt: skip
        g = torch.Generator().manual_seed(0)
        engine.backward(_loss(engine, "mlp", g, 1))
        engine.step()
        engine.backward(_loss(engine, "mlp", g, 1))
        before = {k: v.clone() for k, v in engine.module.state_dict().items()}
        path = engine.offload.file.path
        path.unlink() if damage == "removed" else os.truncate(path, 4096)
        try:
            engine.step()
            error = None
        except StorageError as e:
            error = str(e)
        after = engine.module.state_dict()
        out[damage] = (error, str(path), all(torch.equal(v, after[k]) for k, v in before.items()))
        engine.close()
    return out


@pytest.fixture(scope="module")
def lost(tmp_path_factory):
    [got] = run_distributed(_file_goes_away, 1, str(tmp_path_factory.mktemp("lost")))
    return got


@pytest.mark.parametrize("damage", ["removed", "truncated"])
def test_an_offload_file_lost_mid_run_stops_the_step_in_one_line(lost, damage):
    error, path, unchanged = lost[damage]
    assert error is not None and damage in error and path in error and "\n" not in error
    assert unchanged  # stopped before any buffer stepped


# -- checkpoints: saved with offload, resumed without, and the other way round ------------------


def _checkpoint_cases(env, root: str) -> dict:
    from trainer import comm

    out = {}
    for mode, precision in (("zero", "bf16"), ("fsdp", "fp32")):
        case = (mode, precision, "adamw", 1, "mlp")
        whole = _train(env, *case, None, Path(root) / "ref")
        for saved_with, resumed_with in (
            ("disk", None),
            (None, "disk"),
            ("host", None),
            (None, "host"),
        ):
            tag = f"{mode}-{saved_with}-{resumed_with}"
            ckpt = Path(root) / tag / "ckpt"
            _train(env, *case, saved_with, Path(root) / tag, save=(ckpt, 1))
            if env.rank == 0:  # for the re-cut, unclaimed
                shutil.copytree(ckpt, Path(root) / f"{tag}-kept")
            comm.barrier().wait()
            resumed = _train(env, *case, resumed_with, Path(root) / tag, resume=ckpt)
            out[tag] = (whole["state"], resumed["state"])
    return out


def _recut_cases(env, root: str) -> dict:
    """The P = 2 checkpoints re-cut into one rank, with and without offload: what is
    loaded, and two more steps from there."""
    out = {}
    for mode, precision in (("zero", "bf16"), ("fsdp", "fp32")):
        case = (mode, precision, "adamw", 1, "mlp")
        runs = []
        for off in (None, "disk"):  # each its own copy: a resume claims its checkpoint
            ckpt = Path(root) / f"recut-{mode}-{off}"
            shutil.copytree(Path(root) / f"{mode}-disk-None-kept", ckpt)
            runs.append(_train(env, *case, off, Path(root) / "recut", resume=ckpt)["state"])
        out[mode] = runs
    return out


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    root = tmp_path_factory.mktemp("offload_ckpt")
    two = run_distributed(_checkpoint_cases, 2, str(root), timeout=600)
    one = run_distributed(_recut_cases, 1, str(root), timeout=600)
    return two, one


@pytest.mark.parametrize(
    "tag",
    [
        f"{m}-{a}-{b}"
        for m in ("zero", "fsdp")
        for a, b in (("disk", None), (None, "disk"), ("host", None), (None, "host"))
    ],  # fmt: skip
)
def test_a_checkpoint_resumes_bitwise_across_offload_settings(resumed, tag):
    for rank, got in enumerate(resumed[0]):
        whole, again = got[tag]
        for k, v in whole.items():
            assert torch.equal(v, again[k]), f"rank {rank}: {k} differs after {tag}"


@pytest.mark.parametrize("mode", ["zero", "fsdp"])
def test_a_checkpoint_saved_with_offload_recuts_into_one_rank_with_or_without(resumed, mode):
    plain, offloaded = resumed[1][0][mode]
    for k, v in plain.items():  # the same values and moments loaded, the same two steps
        assert torch.equal(v, offloaded[k]), f"{mode}: {k} differs"


# -- the command line: a run with offload, its figures, its checkpoint, its file -----------------


def test_a_run_with_offload_logs_its_disk_and_leaves_no_file(tmp_path):
    from test_cli import run_cli, scalars

    run_dir = tmp_path / "run"
    args = [
        "mode=zero", "mode.offload=disk", "precision=bf16", "model.hidden=16", "model.depth=2",
        "train.batch_size=16", "train.steps=4", "train.log_every=2", "ckpt.every=2",
        f"hydra.run.dir={run_dir}",
    ]  # fmt: skip
    proc = run_cli(args, nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    tags = scalars(run_dir)
    assert tags["memory/disk_MiB/max"][-1] > 0
    assert tags["memory/expected/disk_MiB"][-1] <= tags["memory/disk_MiB/max"][-1]
    # after a step the optimizer's state in memory is its step counters (4 bytes a piece),
    # a few dozen bytes beside the moments' kilobytes in the file
    assert tags["memory/optimizer_MiB/max"][-1] < tags["memory/expected/disk_MiB"][-1] / 100
    assert all(v >= 0 for v in tags["offload/wait_ms_per_step/max"])
    assert (run_dir / "offload").is_dir() and not list((run_dir / "offload").iterdir())
    # the checkpoint resumes without offload, and continues as the run did
    again = run_cli([*args[:1], *args[3:], "resume=auto", "train.steps=6"], nproc=2)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "at step 4" in again.stdout
