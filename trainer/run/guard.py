"""Non-finite losses and stop requests, decided by all ranks together without reading the
device every step.

[Note: checking the loss without a host sync]
Every rank must agree to step or not, and to stop after the same step, or their
collectives stop matching; agreeing takes a reduction, and acting on it a host read,
which on a GPU stalls the CPU until the device has caught up. So by default
(`train.on_nonfinite=stop`) each step only notes, on the device, the first step whose
loss was not finite, and the ranks compare notes at check steps: every log step, every
checkpoint step and the last step, with one small AllReduce that also carries the stop
request of [Note: stopping on SIGTERM] (preempt.py). A NaN found there ends the run
naming the step where it began, before any checkpoint could save the damage; the steps
in between updated the parameters with it, which no longer matters. A SIGTERM stops
the run at the next check step. `train.on_nonfinite=skip` must decide before each
optimizer step, so it reads the agreement every step (one read per step, said in
docs/configuration.md).
"""

from __future__ import annotations

import torch

from trainer import comm
from trainer.observe import host


class Guard:
    def __init__(self, device: torch.device):
        self.device = device
        # first step with a non-finite loss here, 0 for none yet: (1,) on the device
        self._first_bad = torch.zeros(1, device=device)

    def note(self, loss: torch.Tensor, step: int) -> None:
        """Remember `step` if its loss is not finite (device ops only)."""
        bad = ~torch.isfinite(loss.detach()).reshape(1)
        self._first_bad = torch.where(bad & (self._first_bad == 0), float(step), self._first_bad)

    def finite_now(self, loss: torch.Tensor) -> bool:
        """Whether every rank's `loss` is finite: one AllReduce and one read, every step."""
        bad = (~torch.isfinite(loss.detach())).to(torch.float32).reshape(1)
        comm.all_reduce(bad, tag="nonfinite", account=False).wait()
        return host.item(bad, "on_nonfinite=skip") == 0

    def check(self, stop: bool) -> tuple[int | None, bool]:
        """At a check step, on every rank: (the earliest step any rank noted, or None;
        whether any rank asks to stop)."""
        p, r = comm.world_size(), comm.rank()
        flags = torch.zeros(p + 1, device=self.device)  # each rank's first bad step; stop
        flags[r] = self._first_bad[0]
        flags[p] = float(stop)
        comm.all_reduce(flags, tag="check", account=False).wait()
        values = host.tolist(flags, "check step")
        bad = [int(v) for v in values[:p] if v > 0]
        return (min(bad) if bad else None), values[p] > 0
