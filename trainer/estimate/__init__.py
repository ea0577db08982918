"""Plan before you launch: memory, traffic and step time of a run, per mode and rank,
without allocating the model (scripts/estimate.py is its command line).

    cfgs = compose_modes(["model=gpt", "precision=bf16"], world_size=16)
    result = estimate(cfgs, Cluster(16, 8, 450e9, 50e9, None, 0.4), device_bytes=80e9)

layout.py      the flat buffers of each mode, model state per rank, working set
activations.py one forward and backward in fake tensors: peak activation bytes
traffic.py     bytes per collective inside and across nodes; the step-time model
replica_groups.py  bytes and seconds across replica groups (ft), per step or per sync
compose.py     the Hydra config per mode; run.py puts it together; report.py prints it
"""

from trainer.estimate.compose import compose_modes
from trainer.estimate.run import estimate
from trainer.estimate.traffic import Cluster

__all__ = ["Cluster", "compose_modes", "estimate"]
