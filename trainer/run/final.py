"""The run's final model (train.save_final), written once, in the form its model family
loads: for model=hf `final_model/`, a directory `AutoModelForCausalLM.from_pretrained`
loads with no code of ours (what scripts/export_hf.py makes of a checkpoint); for the
built-in models `final_model.pt`, their full state_dict for `torch.load(weights_only=True)`
and `load_state_dict` (what scripts/consolidate.py makes of a checkpoint).

It is written by rank 0 alone from the state gathered to it one group at a time
([Note: gathering to rank 0] in trainer/parallel/pieces.py); the other ranks only send
their slices. It appears whole under its final name or not at all.
"""

from __future__ import annotations

import copy
import shutil
import uuid
from pathlib import Path

import torch
from torch import nn

from trainer import checkpoint
from trainer.errors import TrainingError
from trainer.models.lm import FINAL_DIR, FINAL_FILE, CausalLM

MAX_SHARD_SIZE = "5GB"  # as scripts/export_hf.py: larger weights are split into shards


def final_model_path(run_dir: Path, module: nn.Module | None) -> Path:
    """Where the final model of `module` goes in `run_dir`: FINAL_DIR for a Hugging Face
    model, FINAL_FILE for the others."""
    return run_dir / (FINAL_DIR if isinstance(module, CausalLM) else FINAL_FILE)


def save_final_model(engine, path: Path, is_rank0: bool, model_dir: Path | None = None) -> None:
    """The full model at `path`: for a Hugging Face model a from_pretrained directory with
    `model_dir`'s tokenizer files, else a state_dict file that torch.load(weights_only=True)
    reads. A collective: every rank calls it."""
    state = engine.full_state_dict(rank0_only=True)  # {} on the other ranks
    if not is_rank0:
        return
    module = getattr(engine, "module", None)
    if isinstance(module, CausalLM):
        write_hf_dir(module, state, path, model_dir)
    else:
        checkpoint.write_file(path, state)  # never a half-written file under the final name


def write_hf_dir(
    model: CausalLM,
    state: dict[str, torch.Tensor],
    out: Path,
    model_dir: Path | None = None,
    max_shard_size: str = MAX_SHARD_SIZE,
) -> None:
    """`state` (keys `hf.*`, as the engine's) as a Hugging Face directory at `out`:
    save_pretrained's config.json, safetensors split above `max_shard_size` (tied weights
    once), and the tokenizer files of `model_dir`. Written into a temporary directory
    renamed at the end. `state` is emptied: each tensor goes once its shard is written."""
    weights = {k.removeprefix("hf."): v for k, v in state.items()}
    state.clear()
    # The values are fp32 whatever the run computed in; from_pretrained takes the dtype to
    # load in from config.json, which save_pretrained fills with the module's (bf16).
    config = copy.deepcopy(model.hf.config)
    config.dtype = "float32"
    tmp = out.with_name(f"{out.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        # the module's own values are not read: in fsdp they are resharded away
        model.hf.save_pretrained(str(tmp), state_dict=weights, max_shard_size=max_shard_size)
        config.save_pretrained(str(tmp))
        for name in ("meta.json", "meta.pkl", "tokenizer.json"):
            if model_dir is not None and (model_dir / name).is_file():
                shutil.copyfile(model_dir / name, tmp / name)
        if model_dir is not None and (model_dir / "tokenizer.json").is_file():
            from transformers import PreTrainedTokenizerFast

            tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"))
            tokenizer.save_pretrained(str(tmp))
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except Exception as e:  # OSError, or safetensors' own error for a full disk
        shutil.rmtree(tmp, ignore_errors=True)
        why = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise TrainingError(f"cannot write {out}: {why}") from None
