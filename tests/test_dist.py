"""Device choice and NCCL error handling in trainer/run/dist.py, checked without a GPU."""

from __future__ import annotations

import pytest
import torch

from trainer.errors import ConfigError, PeerError
from trainer.parallel import calls
from trainer.run import dist as tdist


@pytest.mark.parametrize(
    "local_rank, count, visible, index",
    [
        (0, 4, None, 0),  # torchrun: every rank sees the node's GPUs
        (3, 4, None, 3),
        (2, 4, "0,1,2,3", 2),
        (0, 1, "5", 0),  # one GPU bound to each rank (SLURM --gpus-per-task=1, Ray, ...)
        (3, 1, "5", 0),
        (7, 1, "GPU-8a1b", 0),  # bound by UUID
    ],
)
def test_cuda_device_index(local_rank, count, visible, index):
    assert tdist.cuda_device_index(local_rank, count, visible) == index


@pytest.mark.parametrize(
    "local_rank, count, visible, needle",
    [
        (2, 2, None, "LOCAL_RANK=2 but only 2 GPU(s) are visible; start at most one"),
        (1, 1, None, "LOCAL_RANK=1 but only 1 GPU(s) are visible; start"),
        (3, 2, "0,1", "LOCAL_RANK=3 but only 2 GPU(s) are visible (CUDA_VISIBLE_DEVICES=0,1)"),
        (1, 0, "", "LOCAL_RANK=1 but only 0 GPU(s)"),
    ],
)
def test_more_ranks_than_gpus_is_refused(local_rank, count, visible, needle):
    with pytest.raises(ConfigError) as e:
        tdist.cuda_device_index(local_rank, count, visible)
    assert needle in str(e.value) and "\n" not in str(e.value)


@pytest.fixture
def fake_gpu(monkeypatch):
    """One visible GPU and a process group that already exists: init only picks."""
    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setattr(tdist.dist, "is_initialized", lambda: True)
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", True)  # torch's default
    return chosen


def test_nccl_init_uses_the_bound_gpu_and_sets_error_handling(fake_gpu):
    import os

    env = tdist.init("nccl")
    assert env.device == torch.device("cuda", 0) and fake_gpu == [env.device]
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == tdist.NCCL_ERROR_HANDLING == "2"
    assert torch.backends.cudnn.allow_tf32 is False  # fp32 convolutions, as on CPU


def test_nccl_init_keeps_the_users_error_handling(fake_gpu, monkeypatch):
    import os

    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    tdist.init("nccl")
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"


# What each backend raises when a peer stops answering ([Note: NCCL timeouts]): NCCL's
# main thread after the watchdog aborted the communicator (TORCH_NCCL_ASYNC_ERROR_HANDLING=2),
# the watchdog's own text, and Gloo's wait.
NCCL_ABORTED = (
    "NCCL communicator was aborted on rank 1. Original reason for failure was: [Rank 1] "
    "Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9, OpType=ALLREDUCE, "
    "NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600021 milliseconds before timing out."
)
NCCL_WATCHDOG = "[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9, ...)"
GLOO_TIMEOUT = "[../gloo/transport/tcp/pair.cc:534] Timed out waiting 600000ms for recv"


@pytest.mark.parametrize("text", [NCCL_ABORTED, NCCL_WATCHDOG, GLOO_TIMEOUT])
def test_peer_timeouts_become_one_line(text):
    failure = tdist.peer_failure(RuntimeError(text), 600)
    assert isinstance(failure, PeerError) and "\n" not in str(failure)
    assert "no answer from the other ranks within dist.timeout_s=600 s" in str(failure)
    assert "a rank has stopped responding" in str(failure)
    # NCCL's line says what NCCL did (its watchdog, not the waiting call, timed out)
    nccl = "NCCL's watchdog timed out a collective and aborted the communicator"
    assert (nccl in str(failure)) == (text != GLOO_TIMEOUT), str(failure)


@pytest.mark.parametrize("text", [NCCL_WATCHDOG, GLOO_TIMEOUT])
def test_fsdp_names_the_unit_gathered_again_on_either_backends_timeout(text):
    # fsdp's explanation of a hang after a unit gathered again (parallel/calls.py) must
    # recognise NCCL's watchdog text ("... timeout", no "timed out") as well as Gloo's
    record = calls.CallRecord.__new__(calls.CallRecord)  # no group: only its timeout path
    record.regathered, record._rank = [("layers.1", "forward call 2")], 0
    with pytest.raises(PeerError, match="gathered unit 'layers.1' again"):
        with record.timeouts():
            raise RuntimeError(text)
    with pytest.raises(RuntimeError, match="CUDA out of memory"):  # other errors pass
        with record.timeouts():
            raise RuntimeError("CUDA out of memory")


def test_an_nccl_abort_for_another_reason_is_not_called_a_timeout():
    text = (
        "NCCL communicator was aborted on rank 0. Original reason for failure was: NCCL "
        "error: remote process exited or there was a network error\nLast error: ..."
    )
    failure = tdist.peer_failure(RuntimeError(text), 600)
    assert isinstance(failure, PeerError) and "\n" not in str(failure)
    assert "dist.timeout_s" not in str(failure)
    assert str(failure).startswith("rank 0: NCCL aborted the communicator after an error (")
    assert "remote process exited" in str(failure)


def test_other_errors_are_not_peer_failures():
    assert tdist.peer_failure(RuntimeError("CUDA out of memory"), 600) is None
