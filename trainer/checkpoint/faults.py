"""Fault injection for tests: kill or stall a rank at a chosen point of training or of a
checkpoint save.

[Note: fault injection]
Tests kill or stall a rank at a chosen point through the environment:
SHARDTRAIN_FAULT="RANK:STEP:ACTION" with ACTION `kill` (SIGKILL after that step),
`hang` (stop answering after that step) or `kill_in_save` (SIGKILL halfway through
streaming its data file of that step's checkpoint) or `kill_in_prune` (SIGKILL halfway through
removing the checkpoint that step's save prunes) or `fail_in_save` (the write of its data
file fails there with an OSError, as a broken disk would). With SHARDTRAIN_FAULT_ONCE=PATH it fires
only while PATH does not exist (creating it), so a restarted group runs on undisturbed.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from trainer import comm

FAULT_ENV, FAULT_ONCE_ENV = "SHARDTRAIN_FAULT", "SHARDTRAIN_FAULT_ONCE"


def fault(where: str, step: int, path: Path | None = None) -> None:
    """[Note: fault injection]. Free unless SHARDTRAIN_FAULT is set."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    rank, at, action = spec.split(":")
    points = {"kill_in_save": "save", "fail_in_save": "save", "kill_in_prune": "prune"}
    point = points.get(action, "step")
    if (int(rank), int(at), point) != (comm.rank(), step, where):
        return
    once = os.environ.get(FAULT_ONCE_ENV)
    if once:
        if os.path.exists(once):
            return
        Path(once).touch()
    if action == "hang":
        while True:
            time.sleep(60)
    if action == "fail_in_save":
        raise OSError(f"injected write failure (SHARDTRAIN_FAULT={spec})")
    if action == "kill_in_prune" and path is not None:
        (path / "meta.pt").unlink()  # as if killed in the middle of deleting it
    os.kill(os.getpid(), signal.SIGKILL)
