"""`train.py` with every collective's group recorded: each rank writes, to
$TRACE_DIR/rank<R>.json, its launcher (torchrun's GROUP_RANK) and the global ranks each
of its collectives ran between (`comm.membership()`). tests/test_launch.py checks with it
that hybrid sharding keeps AllGathers and ReduceScatters inside one launcher (node)."""

from __future__ import annotations

import json
import os
import runpy
import sys
from pathlib import Path

from trainer import comm

TRAIN = Path(__file__).resolve().parent.parent / "train.py"

if __name__ == "__main__":
    sys.argv[0] = str(TRAIN)
    with comm.membership() as members:
        try:
            runpy.run_path(str(TRAIN), run_name="__main__")
        finally:
            out = Path(os.environ["TRACE_DIR"]) / f"rank{os.environ['RANK']}.json"
            record = {"launcher": int(os.environ["GROUP_RANK"]), "members": members}
            out.write_text(json.dumps(record))
