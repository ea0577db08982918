"""Each rank's random number generator states, saved in its file and restored on resume
so that a resumed run draws what an uninterrupted one would."""

from __future__ import annotations

import random
from typing import Any

import torch


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    try:
        import numpy as np

        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        state["numpy"] = [kind, torch.from_numpy(keys.astype("int64")), pos, has_gauss, gauss]
    except ImportError:
        pass
    # This rank's device generator only: get_rng_state_all() would create a CUDA context
    # on every visible GPU in every rank, and its list would not fit a resume on another
    # GPU count. A process that never used CUDA has no generator state worth keeping.
    if torch.cuda.is_initialized():
        state["cuda_device"] = torch.cuda.get_rng_state(torch.cuda.current_device())
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, gauss))
    if not torch.cuda.is_initialized():
        return
    device = torch.cuda.current_device()
    if "cuda_device" in state:
        torch.cuda.set_rng_state(state["cuda_device"], device)
    elif "cuda" in state and device < len(state["cuda"]):
        # Checkpoints written before "cuda_device": every visible GPU's state, by index.
        torch.cuda.set_rng_state(state["cuda"][device], device)
