"""The trainer's engine: each data-parallel mode written out in plain code (ddp, zero, fsdp).

- run/: the training run, from `python train.py ...` to the last checkpoint. Start here.
- parallel/: build_engine() and the mode files; comm/: every collective and its groups.
- config/: the composed Hydra config; data/: the batches; models/: where a model comes from.
- checkpoint/: sharded, atomic saves and resumes; offload/: state kept out of device memory.
- observe/: what a run reports; estimate/: memory, traffic and step time before a launch.
- rehearse/: the GPU rehearsal's fake CUDA and process group (nothing in training uses it).
- errors.py: the exceptions a run ends on, each printed as one line.
"""
