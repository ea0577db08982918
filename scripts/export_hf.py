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

A checkpoint is read range by range, one tensor at a time, straight into the output
files ([Note: streamed export] in trainer/checkpoint/export.py): no engine, no optimizer
state; its memory is the largest tensor, whatever the model's size. Two cases load the
model whole (4Ψ in fp32) and write it with save_pretrained: a run that left only its
final model (final_model.pt, or model=hf's final_model/), and a transformers model
whose weights are converted on save (mixture of experts: stacked experts written one per
expert).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.checkpoint.export import parse_size, write_model  # noqa: E402
from trainer.checkpoint.recutting import model_entries  # noqa: E402
from trainer.errors import ConfigError, StorageError  # noqa: E402
from trainer.models.lm import CausalLM, build_from_config, run_model, run_source  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def export(source: Path, out: Path, dtype: str = "fp32", max_shard_size: str = "5GB") -> str:
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype} is not one of {', '.join(DTYPES)}")
    shard_bytes = parse_size(max_shard_size)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{out} exists and is not a directory")
    found, model_dir, loaded = run_source(source)
    with torch.device("meta"):  # the model's structure only: no memory, no init
        skeleton = build_from_config(model_dir)
    if found is None or _converted_on_save(skeleton):
        _export_whole(source, out, DTYPES[dtype], max_shard_size)
    else:
        _check_matches(found, skeleton)
        out.mkdir(parents=True, exist_ok=True)
        if isinstance(skeleton, CausalLM):
            config = skeleton.hf.config
            config.dtype = str(DTYPES[dtype]).removeprefix("torch.")  # as save_pretrained
            config.architectures = [type(skeleton.hf).__name__]
            config.save_pretrained(str(out))
            if skeleton.hf.can_generate():
                skeleton.hf.generation_config.save_pretrained(str(out))
            # as save_pretrained: tied weights once, under the first of their keys
            write_model(
                found, out, lambda k: k.removeprefix("hf."), lambda keys: keys[:1],
                DTYPES[dtype], shard_bytes,
            )  # fmt: skip
        else:
            # as safetensors' save_model: tied weights once, under the first key by name
            write_model(found, out, lambda k: k, lambda keys: sorted(keys)[:1], DTYPES[dtype])
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


def _converted_on_save(model) -> bool:
    """Whether transformers converts this model's weights when it saves them."""
    if not isinstance(model, CausalLM):
        return False
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    names = (type(model.hf).__name__, model.hf.config.model_type)
    return any(get_checkpoint_conversion_mapping(n) for n in names)


def _check_matches(checkpoint: Path, skeleton) -> None:
    """The checkpoint must hold the run's model: its keys, with their shapes."""
    ours = {k: tuple(v.shape) for k, v in skeleton.state_dict().items()}
    theirs = {key: tuple(shape) for key, _, _, shape in model_entries(checkpoint)}
    differ = sorted(k for k in ours.keys() | theirs.keys() if ours.get(k) != theirs.get(k))
    if differ:
        k = differ[0]
        raise ConfigError(
            f"checkpoint {checkpoint} does not hold the run's model ({len(differ)} keys differ): "
            f"{k} is {theirs.get(k, 'missing')} there and {ours.get(k, 'missing')} in the run's "
            "model/config.json"
        )


def _export_whole(source: Path, out: Path, dtype: torch.dtype, max_shard_size: str) -> None:
    model, model_dir, _ = run_model(source)
    model = model.to(dtype)
    out.mkdir(parents=True, exist_ok=True)
    if isinstance(model, CausalLM):
        model.hf.save_pretrained(str(out), max_shard_size=max_shard_size)
    else:
        from safetensors.torch import save_model

        save_model(model, str(out / "model.safetensors"), metadata={"format": "pt"})
        shutil.copyfile(model_dir / "config.json", out / "config.json")


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
    except StorageError as e:  # a checkpoint the storage does not let us read: try again
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"{loaded} -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
