"""checkpoint.rng.rng_state / set_rng_state keep this rank's CUDA generator only; the
CUDA calls are stood in for by fakes, so this checks the bookkeeping, not a GPU."""

from __future__ import annotations

import pytest
import torch

from trainer.checkpoint import rng


@pytest.fixture
def fake_cuda_rng(monkeypatch):
    """A process on GPU 2 of 4: per-device generator states 'dev0'..'dev3' as tensors."""
    states = {i: torch.tensor([i], dtype=torch.uint8) for i in range(4)}
    calls = []

    def forbidden(*args, **kwargs):
        raise AssertionError("touches every visible GPU")

    def get_rng_state(device):
        calls.append(("get", device))
        return states[device].clone()

    def set_rng_state(state, device):
        calls.append(("set", device, int(state[0])))

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_rng_state", get_rng_state)
    monkeypatch.setattr(torch.cuda, "set_rng_state", set_rng_state)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", forbidden)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", forbidden)
    return calls


def test_saves_and_restores_this_ranks_generator_only(fake_cuda_rng):
    state = rng.rng_state()
    assert "cuda" not in state and state["cuda_device"].tolist() == [2]
    rng.set_rng_state(state)
    assert fake_cuda_rng == [("get", 2), ("set", 2, 2)]


def test_reads_the_old_all_devices_key(fake_cuda_rng):
    state = rng.rng_state()
    del state["cuda_device"]
    state["cuda"] = [torch.tensor([10 + i], dtype=torch.uint8) for i in range(4)]
    rng.set_rng_state(state)
    assert fake_cuda_rng[-1] == ("set", 2, 12)


def test_old_key_from_fewer_gpus_is_skipped(fake_cuda_rng):
    state = rng.rng_state()
    del state["cuda_device"]
    state["cuda"] = [torch.tensor([10], dtype=torch.uint8)]  # saved where one GPU was seen
    rng.set_rng_state(state)
    assert [c for c in fake_cuda_rng if c[0] == "set"] == []


def test_a_process_without_cuda_saves_no_cuda_state(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    state = rng.rng_state()
    assert "cuda" not in state and "cuda_device" not in state
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    saved = rng.rng_state()
    torch.rand(3)
    rng.set_rng_state(saved)  # CPU generator back where it was
    assert torch.equal(torch.rand(3), expected)
