"""The GPU rehearsal's stand-ins (scripts/gpu_rehearsal.py, docs/gpu_check.md): fake CUDA
tensors, streams and events that check the order the code promises (cuda.py), and a
process group in Python that completes each collective on them (world.py); patches.py
puts back, at the block's end, what both replaced.

Nothing in training imports this package: only the rehearsal installs it, for the
duration of a `with rehearsal(...)` block.
"""

from trainer.rehearse.cuda import Checker, Violation, fake_cuda
from trainer.rehearse.world import fake_world

__all__ = ["Checker", "Violation", "fake_cuda", "fake_world"]
