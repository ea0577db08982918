"""Which parameters got a gradient since the last step, on any rank.

[Note: used flags]
A parameter that takes no part in the forward on some rank gets no gradient there; its
slot in the flat gradient buffer is zero and the buffer is still reduced, since the
ranks' collectives must match. If no rank used it, torch DDP and FSDP2 leave its `.grad`
None, so the optimizer skips it: AdamW neither decays it nor moves it with stale
moments, and its step count stays. The engines here do the same. Every rank writes one
flag per trainable parameter, 1 when it produced a gradient for it since the last step
(several backwards and no_sync micro-batches included), into spare elements of the last
collective of the backward pass (ddp: its last bucket's AllReduce; zero: its last
bucket's ReduceScatter; fsdp: the root unit's ReduceScatter, each rank's row carrying a
copy). After that collective a flag is 0 exactly when no rank used the parameter.
No extra collective is needed, and the flags are read on the host only when this rank
itself left a parameter unused: a rank that used every parameter knows that every one
of them gets a gradient, so a steady step reads nothing back from the device.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from trainer.observe import host


class UsedFlags:
    def __init__(self, params: Sequence[nn.Parameter]):
        self.index = {id(p): i for i, p in enumerate(params)}  # flag position per parameter
        self.used: set[int] = set()  # flag positions used here since the last step

    def __len__(self) -> int:
        return len(self.index)

    def mark(self, p: torch.Tensor) -> None:
        self.used.add(self.index[id(p)])

    def fill(self, out: torch.Tensor) -> None:
        """Write this rank's flags into `out` (..., n), every row alike. Built on the host
        and copied once, rather than one tiny device write per parameter."""
        if len(self.used) == len(self):  # the common case: a device fill, no copy
            out.fill_(1)
            return
        flags = torch.zeros(len(self), dtype=out.dtype)
        flags[list(self.used)] = 1
        out.copy_(flags.to(out.device).expand_as(out))

    def unused_everywhere(self, reduced: torch.Tensor) -> set[int]:
        """Positions no rank used, from the reduced flags (n,). Empty without reading the
        device when this rank used every parameter."""
        if len(self.used) == len(self):
            return set()
        return set(host.tolist((reduced == 0).nonzero().flatten(), "unused parameters"))

    def clear(self) -> None:
        self.used.clear()


class Arrivals:
    """Parameters whose gradient arrived in the backward under way (by id).

    Autograd accumulates a leaf's gradient once per backward; a second arrival means a
    backward nested in this one (reentrant checkpointing recomputing a forward inside
    backward), which would end the step's communication early or leave the gradient
    behind. Every mode refuses it here, with the parameter's name."""

    def __init__(self, names: dict[int, str], mode: str):
        self._names, self._mode = names, mode
        self._ids: set[int] = set()

    def add(self, p: torch.Tensor) -> None:
        if id(p) in self._ids:
            raise RuntimeError(
                f"parameter {self._names[id(p)]!r} received its gradient twice in one "
                f"backward (reentrant checkpointing?); {self._mode} reduces each gradient "
                "once per backward and needs use_reentrant=False"
            )
        self._ids.add(id(p))

    def __contains__(self, p: torch.Tensor) -> bool:
        return id(p) in self._ids

    def clear(self) -> None:
        self._ids.clear()
