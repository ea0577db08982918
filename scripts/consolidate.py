"""Write one full model state_dict from a sharded checkpoint, whatever its mode and world
size; no process group and no model are needed.

    python scripts/consolidate.py runs/<run>/checkpoints/step_000300 model.pt
    python scripts/consolidate.py runs/<run>/checkpoints model.pt     # the newest one

The output loads with plain `torch.load(path, weights_only=True)` into the model:
`model.load_state_dict(torch.load("model.pt", weights_only=True))`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer import checkpoint  # noqa: E402
from trainer.errors import ConfigError, TrainingError  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path, help="a step_* directory, or ckpt.dir")
    parser.add_argument("out", type=Path, help="where to write the state_dict (.pt)")
    args = parser.parse_args(argv)
    path = args.checkpoint
    if not (path / "meta.pt").exists() and path.is_dir():
        found = checkpoint.find_checkpoints(path)
        if found:
            path = found[0]
    try:
        state = checkpoint.consolidate(path)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        checkpoint.write_file(args.out, state)  # never a half-written file under the final name
    except OSError as e:
        print(f"error: cannot write {args.out}: {e.strerror}", file=sys.stderr)
        return 2
    except TrainingError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    numel = sum(t.numel() for t in state.values())
    print(f"{path} -> {args.out}: {len(state)} tensors, {numel} elements")
    return 0


if __name__ == "__main__":
    sys.exit(main())
