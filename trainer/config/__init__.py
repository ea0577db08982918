"""The composed Hydra config (conf/): its types, and the checks that refuse a bad one in one line.

- schema.py: the types of every key, registered with Hydra's ConfigStore. Start here.
- checks.py: checks across keys (`validate`), and the mapping from config groups to the
  engine's options (`engine_options`).

The run (trainer/run/) and the estimator (trainer/estimate/) read the same config.
"""
