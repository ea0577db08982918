"""What a run reports, and how it is measured: the numbers in TensorBoard and in the logs.

- metrics.py: local sums reduced to rank 0 once per interval; rank 0 alone writes them. Start here.
- memory.py: what each rank holds (live tensors) next to what the mode's formulas predict.
- heap.py: a step's peak on CPU; tb_layout.py: the Custom Scalars layout every run writes.
- host.py: the one way trainer code reads a device value on the host (counted in tests).
"""
