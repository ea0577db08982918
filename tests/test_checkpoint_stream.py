"""Checkpoints streamed within one bounded buffer: what a save costs in memory, a kill in
the middle of a streamed write, a full disk found before writing, a flipped byte in a
range that a re-cut reads, and an older format refused in one line."""

from __future__ import annotations

import errno
import functools
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
import warm_cli
from dist_harness import run_distributed
from test_checkpoint_safety import TINY, _error_lines
from test_cli import ROOT, run_cli

from trainer.observe import heap

# ---------------------------------------------------------------------------------------
# Memory: a save's extra memory is the staging buffer, not the model


def _save_heap(env, mode: str, width: int, directory: Path, precision: str = "fp32") -> dict:
    """The C heap's growth during a save of a trained MLP (one rank), sampled at every
    write of the data files and after every tensor op of the save."""
    from torch import nn

    from trainer import checkpoint
    from trainer.checkpoint import files
    from trainer.parallel import build_engine

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width), nn.Linear(width, width))
    model[1].requires_grad_(False)  # a frozen parameter: written by rank 0 from itself
    adamw = functools.partial(torch.optim.AdamW, lr=1e-3, eps=1e-3)
    engine = build_engine(model, mode, adamw, precision=precision)
    x = torch.randn(4, width)
    engine.backward(engine(x).square().mean())
    engine.step()
    held = sum(t.numel() * t.element_size() for ts in engine.state_tensors().values() for t in ts)
    peak = [0]
    original = files.Sink.write

    def write(self, data):
        peak[0] = max(peak[0], heap.heap_bytes())
        return original(self, data)

    files.Sink.write = write
    try:
        with heap.HeapPeak() as sampler:
            start = sampler.start
            checkpoint.save(directory, 1, engine, buffer_mb=1)
    finally:
        files.Sink.write = original
    growth = max(peak[0], sampler.peak) - start
    return {"growth": growth, "held": held}


def _save_heaps(env, mode: str, root: Path, precision: str) -> list[dict]:
    return [_save_heap(env, mode, w, root / f"{mode}{w}", precision) for w in (256, 1024)]


@pytest.mark.skipif(not heap.available(), reason="needs glibc's mallinfo2()")
@pytest.mark.parametrize("mode, precision", [("ddp", "fp32"), ("zero", "fp32"), ("fsdp", "bf16")])
def test_a_save_holds_one_staging_buffer_not_the_model(tmp_path, mode, precision):
    [(small, large)] = run_distributed(_save_heaps, 1, mode, tmp_path, precision)
    # 1024 wide: 2.1 M parameters, 8 MB of values, 25 MB of model state in all. What a
    # save adds is the 1 MiB staging buffer (bf16: the frozen LayerNorm is cast through
    # it), a 1 MiB read block of nothing, the index and pickling: well under 4 MiB
    # whatever the width, where a copy of the state (as before) grows with it by 12Ψ.
    assert large["held"] > 20 * 2**20
    assert large["growth"] < 4 * 2**20, large
    assert large["growth"] - small["growth"] < 2 * 2**20, (small, large)


# ---------------------------------------------------------------------------------------
# A kill -9 in the middle of a streamed write


def test_killed_while_streaming_a_checkpoint_leaves_the_previous_one(tmp_path):
    from trainer.checkpoint import find_checkpoints

    run_dir = tmp_path / "run"
    args = [*TINY, f"hydra.run.dir={run_dir}", "ckpt.every=1", "ckpt.keep=2"]
    killed = warm_cli.command(
        [sys.executable, str(ROOT / "train.py"), *args, "train.steps=3"],
        {"SHARDTRAIN_FAULT": "0:2:kill_in_save"},
        timeout=120,
    )
    assert killed.returncode == -9, killed.stderr[-2000:]  # SIGKILL halfway through rank0.bin
    ckpts = run_dir / "checkpoints"
    [partial] = ckpts.glob("step_000002.tmp-*")  # the unfinished save, under its own name
    assert not (partial / "rank0.pt").exists() and not (partial / "COMPLETE").exists()
    assert [p.name for p in find_checkpoints(ckpts)] == ["step_000001"]
    proc = run_cli([*args, "train.steps=3", "resume=auto"], nproc=None)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"resumed from {ckpts / 'step_000001'} at step 1" in proc.stdout
    # the leftover went with the next save
    assert sorted(p.name for p in ckpts.iterdir()) == ["lineage", "step_000002", "step_000003"]


# ---------------------------------------------------------------------------------------
# A full disk: found when the file is allocated, before a byte is written


def _save_with_allocation_failing(env, directory: Path):
    from torch import nn

    from trainer import checkpoint
    from trainer.errors import TrainingError
    from trainer.parallel import build_engine

    def no_room(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    os.posix_fallocate = no_room
    engine = build_engine(nn.Linear(512, 512), "ddp", functools.partial(torch.optim.SGD, lr=0.1))
    try:
        checkpoint.save(directory, 5, engine)
    except TrainingError as e:
        return str(e)
    return None


def test_full_disk_is_found_when_the_data_file_is_allocated(tmp_path):
    [message] = run_distributed(_save_with_allocation_failing, 1, tmp_path)
    want = (
        f"rank 0 could not write its part of checkpoint {tmp_path / 'step_000005'}: no space "
        f"left on device writing {tmp_path}/step_000005.tmp-"
    )
    assert message.startswith(want), message
    # 512 x 512 + 512 fp32 values: 1.0 MB (the line is cut at 200 characters: a long
    # temporary path leaves no room for the rest)
    assert "rank0.bin (it needs about 1.0 MB" in message
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------------
# A flipped byte in a range a re-cut reads; an older format


@pytest.fixture(scope="module")
def zero_run(tmp_path_factory) -> Path:
    """A zero x 2 run of 2 steps with a checkpoint at each."""
    run_dir = tmp_path_factory.mktemp("zero") / "run"
    proc = run_cli(
        [*TINY, "mode=zero", f"hydra.run.dir={run_dir}", "ckpt.every=1", "train.steps=2"]
    )
    assert proc.returncode == 0, proc.stderr[-8000:]
    return run_dir


def test_a_flipped_byte_in_a_range_a_recut_reads_is_one_line(zero_run, tmp_path):
    ckpt = Path(shutil.copytree(zero_run / "checkpoints" / "step_000002", tmp_path / "step_2"))
    index = torch.load(ckpt / "rank1.pt", weights_only=True)
    _, _, offset, nbytes = index["data"]["entries"]["params/0"]
    data = ckpt / "rank1.bin"
    with open(data, "r+b") as f:
        f.seek(offset + nbytes // 2)
        byte = f.read(1)[0]
        f.seek(offset + nbytes // 2)
        f.write(bytes([byte ^ 0x01]))
    block = (offset + nbytes // 2) // 2**20 * 2**20
    end = min(block + 2**20, data.stat().st_size)
    # fsdp on one process: a re-cut, which reads rank 1's slice of every group.
    proc = run_cli([*TINY, "mode=fsdp", f"run.root={tmp_path}", f"resume={ckpt}"], nproc=None)
    assert proc.returncode == 2, proc.stderr[-2000:]
    [line] = _error_lines(proc)
    assert line == (
        f"error: {data} is corrupted: bytes {block}..{end} do not match their checksum"
    ), line


def test_an_older_format_is_refused_naming_both(zero_run, tmp_path):
    ckpt = Path(shutil.copytree(zero_run / "checkpoints" / "step_000001", tmp_path / "step_1"))
    meta = torch.load(ckpt / "meta.pt", weights_only=True)
    meta["format"] = 2
    torch.save(meta, ckpt / "meta.pt")
    proc = run_cli([*TINY, "mode=zero", f"run.root={tmp_path}", f"resume={ckpt}"], nproc=None)
    assert proc.returncode != 0
    lines = [x for x in _error_lines(proc) if x.startswith("error:")]
    assert lines[0] == (
        f"error: {ckpt / 'meta.pt'} is of checkpoint format 2; this trainer reads format 3 "
        "only: resume or consolidate it with the version that wrote it"
    ), lines


# ---------------------------------------------------------------------------------------
# Exports: one tensor at a time


def _export_heap(env, directory: Path) -> dict:
    """Save a zero x 1 MLP of three 4 MiB weights, then the C heap's growth while its model
    is written as safetensors (sampled after every tensor op of the export)."""
    from torch import nn

    from trainer import checkpoint
    from trainer.checkpoint.export import write_model
    from trainer.parallel import build_engine

    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(1024, 1024) for _ in range(3)))
    adamw = functools.partial(torch.optim.AdamW, lr=1e-3, eps=1e-3)
    engine = build_engine(model, "zero", adamw)
    engine.backward(engine(torch.randn(4, 1024)).square().mean())
    engine.step()
    path = checkpoint.save(directory / "ckpt", 1, engine)
    want = engine.full_state_dict()
    del engine, model
    with heap.HeapPeak() as sampler:
        write_model(path, directory / "out", lambda k: k, list, max_shard_bytes=6 * 10**6)
    return {"growth": sampler.growth, "want": want}


@pytest.mark.skipif(not heap.available(), reason="needs glibc's mallinfo2()")
def test_export_holds_one_tensor_and_reads_no_optimizer_state(tmp_path):
    from safetensors.torch import load_file

    [got] = run_distributed(_export_heap, 1, tmp_path)
    out = tmp_path / "out"
    # 6 MB shards: each 4 MiB weight (and its bias) in a shard of its own
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert shards == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    values = {k: v for s in shards for k, v in load_file(out / s).items()}
    assert values.keys() == got["want"].keys()
    assert all(torch.equal(values[k], got["want"][k]) for k in values)
    # The model is 12 MiB, its optimizer state 24 MiB: the export holds the tensor being
    # written (4 MiB) and a 1 MiB read block.
    assert got["growth"] < 4 * 2**20 + 2 * 2**20, got["growth"]


def test_consolidate_writes_safetensors_with_every_key(zero_run, tmp_path):
    from safetensors.torch import load_file

    ckpt = zero_run / "checkpoints" / "step_000002"
    script = ROOT / "scripts" / "consolidate.py"
    for out in (tmp_path / "m.pt", tmp_path / "m.safetensors"):
        proc = warm_cli.command([sys.executable, str(script), str(ckpt), str(out)])
        assert proc.returncode == 0, proc.stderr[-2000:]
    pt = torch.load(tmp_path / "m.pt", weights_only=True)
    st = load_file(tmp_path / "m.safetensors")
    assert pt.keys() == st.keys() and all(torch.equal(pt[k], st[k]) for k in pt)


# ---------------------------------------------------------------------------------------
# The data file itself: segments, casts through a small staging buffer, ranged reads


def test_entries_round_trip_through_a_small_staging_buffer(tmp_path):
    from trainer.checkpoint import files, stream
    from trainer.errors import ConfigError

    torch.manual_seed(0)
    big = torch.randn(700_000)  # 2.8 MB: crosses block boundaries
    half = torch.randn(300, 7, dtype=torch.bfloat16).t()  # cast to fp32, not contiguous
    flags = torch.tensor([True, False, True])
    entries = [
        stream.Entry("flags", torch.bool, [3], [flags]),
        stream.Entry("big", torch.float32, [700_010], [3, big, 7]),  # zeros around it
        stream.Entry("half", torch.float32, [7, 300], [half]),
    ]
    path = tmp_path / "rank0.bin"
    index = files.write_data(path, entries, buffer_bytes=4096)
    assert path.stat().st_size == index["size"] == stream.planned_bytes(entries)
    assert len(index["crcs"]) == -(-index["size"] // stream.BLOCK)
    data = stream.DataFile(path, index)
    out = torch.empty(700_010)
    data.read("big", 0, out)
    assert torch.equal(out, torch.cat([torch.zeros(3), big, torch.zeros(7)]))
    part = torch.empty(5, dtype=torch.float64)  # a range, cast on the way in
    data.read("big", 262_140, part)
    assert torch.equal(part, big[262_137:262_142].double())
    got = torch.empty(2100)
    data.read("half", 0, got)
    assert torch.equal(got.view(7, 300), half.float())
    flags_out = torch.empty(3, dtype=torch.bool)
    data.read("flags", 0, flags_out)
    assert torch.equal(flags_out, flags)
    data.close()
    # A flipped byte is found by a read of any range in its block, and only there.
    _, _, offset, _ = index["entries"]["big"]
    with open(path, "r+b") as f:
        f.seek(offset + 4 * 600_000)
        f.write(b"\xff")
    data = stream.DataFile(path, index)
    data.read("big", 0, torch.empty(10))  # another block: fine
    end = min(3 * stream.BLOCK, index["size"])  # the file's third block
    with pytest.raises(ConfigError, match=rf"rank0.bin is corrupted: bytes 2097152\.\.{end} do"):
        data.read("big", 599_990, torch.empty(20))
    data.close()
