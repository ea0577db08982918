"""IntervalMetrics.reduce packs device tensors and Python floats on one device.

No GPU is needed: the 'meta' device stands in for CUDA. Like a CUDA tensor, a meta
tensor cannot be stacked with CPU tensors (torch.stack raises), so a reduce() that left
the Python-float fields on the CPU fails here exactly as it failed at the first log
step of every NCCL run. The collective is replaced by a fake that records what it was
given: this proves the packing, not that NCCL accepts the result.
"""

from __future__ import annotations

import pytest
import torch

from trainer import comm
from trainer.observe.metrics import FIELDS, IntervalMetrics


class _DoneHandle:
    def wait(self) -> None:
        pass


@pytest.fixture
def fake_reduce(monkeypatch):
    """comm.reduce, rank and world size without a process group; returns what was reduced."""
    reduced: list[torch.Tensor] = []

    def reduce(tensor, dst=0, *, tag="", group=None):
        reduced.append(tensor)
        return _DoneHandle()

    monkeypatch.setattr(comm, "reduce", reduce)
    monkeypatch.setattr(comm, "world_size", lambda group=None: 1)
    comm.stats.reset()
    return reduced


def test_reduce_packs_every_field_on_the_metric_device(fake_reduce, monkeypatch):
    monkeypatch.setattr(comm, "rank", lambda group=None: 1)  # not rank 0: nothing is read back
    meta = torch.device("meta")
    m = IntervalMetrics(meta)
    loss, correct, norm = (torch.ones((), device=meta) for _ in range(3))
    m.start_step()
    m.add(loss, correct, 64, samples=8, grad_norm=norm)
    assert m.reduce() is None
    (packed,) = fake_reduce
    assert packed.device == meta
    assert packed.shape == (len(FIELDS),) and packed.dtype == torch.float64


def test_reduce_values_on_rank0(fake_reduce, monkeypatch):
    monkeypatch.setattr(comm, "rank", lambda group=None: 0)
    m = IntervalMetrics(torch.device("cpu"), clock=iter([0.0, 2.0]).__next__)  # a 2 s interval
    m.start_step()
    m.add(torch.tensor(1.0), torch.tensor(32.0), 64, samples=8, grad_norm=torch.tensor(2.0))
    m.start_step()
    m.add(torch.tensor(3.0), torch.tensor(16.0), 64, samples=8, grad_norm=torch.tensor(4.0))
    out = m.reduce()
    (packed,) = fake_reduce
    sums = dict(zip(FIELDS, packed.tolist(), strict=True))
    assert sums["loss_sum"] == 256.0 and sums["correct"] == 48.0 and sums["steps"] == 2
    assert out["train/loss"] == 2.0
    assert out["train/accuracy"] == 48 / 128
    assert out["train/grad_norm"] == 3.0
    assert out["perf/step_time_s"] == 1.0
    assert out["perf/samples_per_s"] == 16 / 2.0


class _Timeline:
    """A fake clock and a fake device synchronize, in one list of events: which of them
    happened, in order, and what the clock said."""

    def __init__(self, times: list[float]):
        self.times = iter(times)
        self.events: list[str] = []

    def clock(self) -> float:
        t = next(self.times)
        self.events.append(f"clock {t:g}")
        return t

    def synchronize(self, device, why: str) -> None:
        self.events.append("sync")

    def take(self) -> list[str]:
        events, self.events = self.events, []
        return events


def _step(m: IntervalMetrics, taken: bool = True) -> None:
    m.start_step()  # the top of train_step
    if taken:  # a step skipped for a non-finite loss adds nothing
        m.add(torch.tensor(1.0), torch.tensor(4.0), 64, samples=8)


def test_step_time_is_the_interval_wall_time_over_its_steps(fake_reduce, monkeypatch):
    from trainer.observe import host

    monkeypatch.setattr(comm, "rank", lambda group=None: 0)
    line = _Timeline([100.0, 106.0, 200.0, 201.0, 251.0, 252.0, 300.0, 304.0])
    monkeypatch.setattr(host, "synchronize", line.synchronize)
    m = IntervalMetrics(torch.device("cpu"), clock=line.clock)
    assert line.take() == []  # set-up is in no interval: the first starts at the first step

    # Three steps queued without waiting: the device is synchronised when the first
    # starts and at the log point, and the clock read right after each wait.
    for _ in range(3):
        _step(m)
    assert line.take() == ["sync", "clock 100"]  # no wait, no clock in the later steps
    out = m.reduce()
    assert line.take() == ["sync", "clock 106"]
    assert out["perf/step_time_s"] == 2.0  # (106 - 100) s / 3 steps
    assert out["perf/samples_per_s"] == 24 / 6.0 and out["perf/tokens_per_s"] == 192 / 6.0

    # An eval between log points (50 s) is left out; the log point's own work, between
    # the reduce and the next step, too.
    _step(m)
    with m.untimed():
        pass
    _step(m)
    out = m.reduce()
    assert line.take() == [
        *("sync", "clock 200"),  # the first step starts
        *("sync", "clock 201", "sync", "clock 251"),  # the eval
        *("sync", "clock 252"),  # the log point
    ]
    assert out["perf/step_time_s"] == 1.0  # (252 - 200 - 50) s / 2 steps

    # A skipped step took its time but brought no samples.
    _step(m)
    _step(m, taken=False)
    out = m.reduce()
    assert out["perf/step_time_s"] == 2.0 and out["perf/samples_per_s"] == 8 / 4.0
    assert line.take() == ["sync", "clock 300", "sync", "clock 304"]

    # Right after a log point nothing is timed: untimed() and reduce() wait for nothing.
    with m.untimed():
        pass
    m.reduce()
    assert line.take() == []


def test_host_synchronize_waits_for_a_cuda_device_only(monkeypatch):
    from trainer.observe import host

    waited = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: waited.append(device))
    with host.counting() as reads:
        host.synchronize(torch.device("cpu"), "step clock")  # CPU ops are done on return
        assert waited == []
        host.synchronize(torch.device("cuda", 0), "step clock")
    assert waited == [torch.device("cuda", 0)]
    assert reads.where == ["step clock"] * 2  # counted like the reads


def test_writer_lays_out_only_the_charts_a_run_logs(tmp_path):
    from tb_events import layout

    from trainer.observe.metrics import Rank0Writer

    w = Rank0Writer(tmp_path, enabled=True)
    w.scalars({"train/loss": 1.0, "train/accuracy": 0.5, "memory/params_MiB/max": 2.0}, 10)
    w.scalars({"eval/loss": 1.0, "comm/busbw_GBps": 3.0}, 20)  # the layout is already out
    w.close()
    assert layout(tmp_path) == [  # one rank: no communication category
        (
            "training",
            [
                ("loss (train, eval)", [r"^train/loss$", r"^eval/loss$"]),
                ("accuracy (train, eval)", [r"^train/accuracy$", r"^eval/accuracy$"]),
            ],
        ),
        (
            "memory per rank, MiB",
            [("parameters per rank, MiB (max over ranks)", [r"^memory/params_MiB/max$"])],
        ),
    ]


@pytest.mark.parametrize(
    "name, key",
    [
        ("NVIDIA H100 80GB HBM3", "H100"),
        ("NVIDIA H100 PCIe", "H100 PCIe"),
        ("NVIDIA H100 NVL", "H100 NVL"),
        ("NVIDIA H200", "H200"),
        ("NVIDIA A100-SXM4-80GB", "A100"),
        ("NVIDIA A100 80GB PCIe", "A100"),
        ("NVIDIA L4", "L4"),
        ("NVIDIA L40S", "L40S"),
        ("NVIDIA L40", "L40"),
        ("NVIDIA A10G", "A10G"),
        ("Tesla V100-SXM2-32GB", "V100"),
        ("Tesla T4", "T4"),
        ("NVIDIA GeForce RTX 4090", None),
        ("NVIDIA A10", None),  # not an A10G
        ("Some Future GPU", None),
    ],
)
def test_peak_flops_names_the_whole_model(name, key, monkeypatch):
    from trainer.observe.metrics import PEAK_FLOPS, device_key, peak_flops

    assert device_key(name) == key
    # peak_flops reads the name from torch.cuda, here a stand-in
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    got = peak_flops(torch.device("cuda", 0), torch.bfloat16)
    assert got == (None if key is None else PEAK_FLOPS[key].get(torch.bfloat16))


def test_peak_flops_of_an_l40s_is_not_an_l4s():
    from trainer.observe.metrics import PEAK_FLOPS, device_key

    # an L4's peak for an L40S would put its MFU about 3x too high
    assert PEAK_FLOPS[device_key("NVIDIA L40S")][torch.bfloat16] == 362e12
    assert PEAK_FLOPS[device_key("NVIDIA L4")][torch.bfloat16] == 121e12
