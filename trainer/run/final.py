"""The run's final model (train.save_final): `final_model.pt`, and for model=hf also
`final_model/`, a directory `AutoModelForCausalLM.from_pretrained` loads (what
scripts/export_hf.py makes of a run, so that it is needed only for older runs).

Both are written by rank 0 alone from the state gathered to it one group at a time
([Note: gathering to rank 0] in trainer/parallel/pieces.py); the other ranks only send
their slices. Each appears whole under its final name or not at all.
"""

from __future__ import annotations

import copy
import shutil
import uuid
from pathlib import Path

import torch

from trainer import checkpoint
from trainer.errors import TrainingError
from trainer.models.lm import CausalLM

HF_DIR = "final_model"  # beside final_model.pt
MAX_SHARD_SIZE = "5GB"  # as scripts/export_hf.py: larger weights are split into shards


def save_final_model(engine, path: Path, is_rank0: bool, model_dir: Path | None = None) -> None:
    """The full model state_dict at `path`, loadable with plain
    torch.load(weights_only=True); for a Hugging Face model also the directory HF_DIR
    beside it, with `model_dir`'s tokenizer files. A collective: every rank calls it."""
    state = engine.full_state_dict(rank0_only=True)  # {} on the other ranks
    if not is_rank0:
        return
    checkpoint.write_file(path, state)  # never a half-written file under the final name
    module = getattr(engine, "module", None)
    if isinstance(module, CausalLM):
        write_hf_dir(module, state, path.with_name(HF_DIR), model_dir)


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
