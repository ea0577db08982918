"""scripts/gpu_rehearsal.py: every combination of its table runs on fake CUDA tensors, and
the rehearsal fails on each kind of bug it claims to catch, planted here by monkeypatch
(trainer/ is not edited): an allocation without device=, a missing wait, a buffer freed
while its collective is in flight, a new host read in a step (docs/gpu_check.md)."""

from __future__ import annotations

import sys

import pytest
import torch
import warm_cli
from test_cli import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import gpu_rehearsal  # noqa: E402

from trainer import comm  # noqa: E402
from trainer.comm import collectives  # noqa: E402
from trainer.rehearse import Violation  # noqa: E402
from trainer.run.guard import Guard  # noqa: E402


@pytest.mark.slow  # ~1 minute on an idle 2-core machine: the whole table, 37 rows
def test_every_combination_runs():
    proc = warm_cli.command(
        [sys.executable, str(ROOT / "scripts" / "gpu_rehearsal.py")], timeout=600
    )
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [line for line in lines if ": ok (" in line]
    assert len(rows) == len(gpu_rehearsal.combos()), proc.stdout
    assert lines[-1].startswith("gpu_rehearsal: PASS"), proc.stdout
    # every world size, seen from its first and its last rank
    for p, r in gpu_rehearsal.WORLDS:
        assert any(f"P={p} rank {r}," in line for line in rows), (p, r)


def combo(name: str) -> gpu_rehearsal.Combo:
    return next(c for c in gpu_rehearsal.combos() if c.name == name)


def rehearse(name: str, tmp_path, p: int = 4, rank: int = 3) -> str:
    return gpu_rehearsal.rehearse(combo(name), p, rank, tmp_path)


def test_the_unplanted_combinations_pass(tmp_path):
    # the same calls as the planted cases below, without a plant
    rehearse("zero bf16", tmp_path)
    rehearse("ddp fp32", tmp_path, 8, 7)


def test_a_chained_collective_and_a_checkpoint_pass(tmp_path):
    # ddp int8 chains its AllGather behind its all-to-all, on CUDA in the caller's thread,
    # under the caller's dispatch modes (pushed again, FakeTensorMode refused them); a
    # checkpoint agrees twice, on the ranks' writes and on rank 0's commit
    rehearse("ddp int8 communication", tmp_path)
    rehearse("ddp checkpoint save and resume", tmp_path / "ckpt", 4, 0)  # rank 0 saves


def test_an_allocation_without_device_fails(tmp_path, monkeypatch):
    def check(self, stop):  # Guard.check with its flags left on the CPU
        p, r = comm.world_size(), comm.rank()
        flags = torch.zeros(p + 1)  # the plant: no device=self.device
        flags[r] = self._first_bad[0]
        flags[p] = float(stop)
        comm.all_reduce(flags, tag="check", account=False).wait()
        return None, False

    monkeypatch.setattr(Guard, "check", check)
    with pytest.raises(Violation, match=r"mixes devices|CUDA tensors only"):
        rehearse("ddp fp32", tmp_path)


def test_a_missing_wait_fails(tmp_path, monkeypatch):
    # The compute stream goes on without waiting for the collective's end event
    monkeypatch.setattr(collectives.Handle, "_wait_cuda", lambda self: None)
    with pytest.raises(Violation, match=r"before the compute stream waited") as e:
        rehearse("ddp fp32", tmp_path)
    assert "all_reduce" in str(e.value) and "trainer/" in str(e.value)


def test_a_buffer_freed_in_flight_fails(tmp_path, monkeypatch):
    reduce_scatter = comm.reduce_scatter

    def freeing(output, input, **kwargs):  # the send buffer freed right after the launch
        handle = reduce_scatter(output, input, **kwargs)
        collectives.free_storage(input)
        return handle

    monkeypatch.setattr(comm, "reduce_scatter", freeing)
    with pytest.raises(Violation, match=r"freed before the compute stream waited") as e:
        rehearse("zero bf16", tmp_path)
    assert "reduce_scatter" in str(e.value)


def test_a_new_host_read_in_a_step_fails(tmp_path, monkeypatch):
    note = Guard.note

    def reading(self, loss, step):  # a value read on the host, not through host.py
        note(self, loss, step)
        if float(loss) > 1e9:
            raise RuntimeError("loss too large")

    monkeypatch.setattr(Guard, "note", reading)
    with pytest.raises(Violation, match=r"host read of a CUDA value .* in a step") as e:
        rehearse("ddp fp32", tmp_path)
    assert "guard" in str(e.value) or "loop.py" in str(e.value)


# -- mode.offload=host ([Note: host offload]): the host's side of its copies ------------------


def test_offload_host_passes_unplanted(tmp_path):
    rehearse("fsdp offload=host bf16", tmp_path, 2, 1)


def test_offload_host_stepping_before_its_gradient_arrived_fails(tmp_path, monkeypatch):
    from trainer.observe import host

    monkeypatch.setattr(host, "wait_event", lambda event, why: None)  # the plant: no wait
    with pytest.raises(Violation, match=r"(reads|writes) host memory that host offload: gradients"):
        rehearse("zero offload=host bf16", tmp_path)


def test_offload_host_without_the_compute_stream_waiting_for_its_copies_fails(
    tmp_path, monkeypatch
):
    from trainer.offload.host import HostOffload

    monkeypatch.setattr(HostOffload, "_join", lambda self: None)  # the plant
    with pytest.raises(Violation, match=r"before .*waited for it"):
        rehearse("zero offload=host fp32", tmp_path)


def test_offload_host_reusing_a_buffer_a_copy_still_reads_fails(tmp_path, monkeypatch):
    from trainer.offload import host as offload_host

    copy_up = offload_host.HostOffload._copy_up

    def early(self, i):  # the plant: the host cast into the region after its copy
        copy_up(self, i)
        b = self.buffers[i]
        if self.targets[i].dtype != b.master.dtype:
            b.host_grad.view(torch.uint8)[:8].zero_()

    monkeypatch.setattr(offload_host.HostOffload, "_copy_up", early)
    with pytest.raises(Violation, match=r"writes host memory that aten.copy_"):
        rehearse("fsdp offload=host bf16", tmp_path, 2, 1)
