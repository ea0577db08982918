"""Generate text from a trained run, on one process, whatever mode and world size it was
saved from.

    python scripts/sample.py runs/<run> --prompt "def " --tokens 200 --temperature 0.8

Loads the run's newest checkpoint (else its final model: final_model.pt, or model=hf's
final_model/), rebuilds the model from <run>/model/config.json and decodes with the
tokenizer the data was prepared with (<run>/model/meta.json, tokenizer.json; token ids
are printed where none is known).
The same --seed gives the same text.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.data.text import codec_from_meta  # noqa: E402
from trainer.data.tokens import read_meta  # noqa: E402
from trainer.errors import ConfigError, StorageError  # noqa: E402
from trainer.models.lm import generate, run_model  # noqa: E402


def sample(
    run: Path,
    prompt: str = "\n",
    tokens: int = 200,
    temperature: float = 0.8,
    top_k: int | None = 200,
    seed: int = 0,
) -> str:
    model, model_dir, _ = run_model(run)
    codec = codec_from_meta(read_meta(model_dir), model_dir)
    if codec is None:  # ids in, ids out
        try:
            ids = [int(t) for t in prompt.split()] or [0]
        except ValueError:
            raise ConfigError(
                f"--prompt {prompt!r}: the run's data names no tokenizer ({model_dir} has no "
                "meta.json or meta.pkl that tells one), so the prompt is token ids separated "
                "by spaces, e.g. --prompt '0 5 7'"
            ) from None
    else:
        try:
            ids = codec.encode(prompt).tolist() or [0]
        except ConfigError as e:
            raise ConfigError(f"--prompt {prompt!r}: {e}") from None
    out = generate(model, ids, tokens, temperature, top_k, torch.Generator().manual_seed(seed))
    return " ".join(map(str, out)) if codec is None else prompt + codec.decode(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="a run directory (or one checkpoint)")
    parser.add_argument("--prompt", default="\n")
    parser.add_argument("--tokens", type=int, default=200, help="new tokens to generate")
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-k", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        text = sample(args.run, args.prompt, args.tokens, args.temperature, args.top_k, args.seed)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except StorageError as e:  # a checkpoint the storage does not let us read: try again
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
