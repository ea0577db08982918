"""Turns the training run into a process exit: one line for bad input, no traceback."""

from __future__ import annotations

import os
import sys

from omegaconf import DictConfig

from trainer.errors import ConfigError


def run_and_exit(cfg: DictConfig) -> None:
    from trainer.loop import train

    try:
        train(cfg)
    except ConfigError as e:
        # Every rank sees the same bad input; one line from rank 0 is enough.
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
