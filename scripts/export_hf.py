"""Write a trained run's model as a directory other tools load.

    python scripts/export_hf.py runs/<run> out/my_model                 # newest checkpoint
    python scripts/export_hf.py runs/<run>/checkpoints/step_000300 out/m --dtype bf16

model=hf: a Hugging Face directory (config.json, model.safetensors, split with
model.safetensors.index.json above --max-shard-size, tied weights stored once) that
`AutoModelForCausalLM.from_pretrained(OUT)` loads with no code of ours, and that is a
valid `model=hf model.path=OUT` for the next run. model=gpt: model.safetensors (tied
weights once) and our config.json, which `trainer.models.lm.load_exported(OUT)` and
scripts/sample.py read; it is not mapped onto transformers' GPT-2 layout. The data's
tokenizer files go beside the weights (a tokenizer.json also as a transformers fast
tokenizer). Weights are the run's, bitwise, in fp32 unless --dtype says otherwise.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.errors import ConfigError  # noqa: E402
from trainer.models.lm import CausalLM, run_model  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def export(source: Path, out: Path, dtype: str = "fp32", max_shard_size: str = "5GB") -> str:
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype} is not one of {', '.join(DTYPES)}")
    model, model_dir, loaded = run_model(source)
    model = model.to(DTYPES[dtype])
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{out} exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    if isinstance(model, CausalLM):
        model.hf.save_pretrained(str(out), max_shard_size=max_shard_size)
    else:
        from safetensors.torch import save_model

        save_model(model, str(out / "model.safetensors"), metadata={"format": "pt"})
        shutil.copyfile(model_dir / "config.json", out / "config.json")
    for name in ("meta.json", "meta.pkl", "tokenizer.json"):
        if (model_dir / name).is_file():
            shutil.copyfile(model_dir / name, out / name)
    if (model_dir / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast

        PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json")).save_pretrained(
            str(out)
        )
    return loaded


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path, help="a run directory or one checkpoint")
    parser.add_argument("out", type=Path, help="the directory to write")
    parser.add_argument("--dtype", default="fp32", help="fp32 | bf16 | fp16")
    parser.add_argument("--max-shard-size", default="5GB", help="split above this (model=hf)")
    args = parser.parse_args(argv)
    try:
        loaded = export(args.source, args.out, args.dtype, args.max_shard_size)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{loaded} -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
