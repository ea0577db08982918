"""Language models by directory: Hugging Face causal LMs from local files (`model=hf`), and
the files a run keeps of its model so that `scripts/sample.py` and `scripts/export_hf.py`
can rebuild it without the data or the directory it came from.

A run writes `<run dir>/model/`: `config.json` (Hugging Face's for model=hf; for model=gpt
our GPT's sizes under `"model_type": "shardtrain_gpt"`) and the data's tokenizer files
(meta.json, tokenizer.json). An exported directory adds `model.safetensors`. The final
model (trainer/run/final.py) is FINAL_DIR, a from_pretrained directory, for model=hf and
FINAL_FILE, a state_dict, for the built-in models.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainer.errors import ConfigError
from trainer.models.builtin import GPT, GPT_MOE_TYPE, GPT_TYPE, GPTMoE
from trainer.models.materialize import building_on_meta

WEIGHTS = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
FINAL_FILE = "final_model.pt"  # in a run directory: the built-in models' final state_dict
FINAL_DIR = "final_model"  # and model=hf's final model, as save_pretrained writes it


class CausalLM(nn.Module):
    """A transformers causal LM as the trainer's models are: ids (B, T) in, logits
    (B, T, V) out. The HF model is `self.hf`; its state_dict keys gain the prefix `hf.`.

    An MoE whose config asks for its router loss (`output_router_logits=True`) returns it
    unscaled as `aux_loss`; the training loop adds it times the coefficient with which
    the HF model adds it to its own loss given labels ([Note: model hooks] in hooks.py):
    the loss trained is then the one `hf(input_ids, labels=...)` returns."""

    def __init__(self, hf: nn.Module) -> None:
        super().__init__()
        self.hf = hf
        self.weights_dir: Path | None = None  # where pretrained weights are to be read from
        self.router_loss_coef = router_loss_coef(hf)  # None: the model names none
        # The router loss of the latest forward times its coefficient; None without one
        self.aux_loss: torch.Tensor | None = None

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        out = self.hf(input_ids=idx, use_cache=False)
        aux, coef = getattr(out, "aux_loss", None), self.router_loss_coef
        if aux is not None and coef is None:
            raise ConfigError(
                f"model=hf {self.hf.config.model_type}: its forward returns a router loss "
                "(output_router_logits=true) but the model names no coefficient for it "
                "(router_aux_loss_coef, aux_loss_coef); set model.config.output_router_logits"
                "=false to train without it"
            )
        self.aux_loss = coef * aux if aux is not None and coef else None
        return out.logits  # (B, T, V)

    # What the training loop calls ([Note: model hooks] in trainer/models/hooks.py)

    def extra_loss(self) -> torch.Tensor | None:
        return self.aux_loss

    def figures(self) -> dict[str, torch.Tensor]:
        return {} if self.aux_loss is None else {"moe/aux_loss": self.aux_loss.detach()}

    @property
    def block_size(self) -> int | None:
        """The model's positions (None: no limit in its config)."""
        c = self.hf.config
        return getattr(c, "n_positions", None) or getattr(c, "max_position_embeddings", None)

    def model_config(self) -> dict[str, Any]:
        return self.hf.config.to_dict()


def router_loss_coef(hf: nn.Module) -> float | None:
    """The coefficient with which a transformers MoE adds its router loss to its loss
    given labels, where it keeps it: `router_aux_loss_coef` on the model (Mixtral,
    Qwen2/3-MoE, OLMoE, DBRX, which reads it from ffn_config.moe_loss_weight, ...),
    `aux_loss_coef` (JetMoe), else the config's or its text_config's
    `router_aux_loss_coef`. None where there is none (a dense model)."""
    config = getattr(hf, "config", None)
    for owner in (hf, config, getattr(config, "text_config", None)):
        for name in ("router_aux_loss_coef", "aux_loss_coef"):
            value = getattr(owner, name, None)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return float(value)
    return None


def hf_causal_lm(
    path: str | None = None,
    config: dict[str, Any] | None = None,
    vocab_size: int | None = None,
    activation_checkpointing: bool = False,
) -> CausalLM:
    """AutoModelForCausalLM from local files only. `path`: a directory with config.json,
    with weights (fine-tuning from them) or without (a fresh init); `config` overrides its
    values. No path: built from `config` alone (`model_type` and sizes). `vocab_size`
    (the data's) applies where neither gives one."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded, ever
    from transformers import AutoConfig, AutoModelForCausalLM

    overrides = dict(config or {})
    if path is not None:
        hf_config, weights = _local_config(path)
        for key, value in overrides.items():
            setattr(hf_config, key, value)
    else:
        model_type = overrides.pop("model_type", None)
        if model_type is None:
            raise ConfigError(
                "model=hf needs model.path=DIR (a local Hugging Face directory) or "
                "model.config.model_type=TYPE (llama, gpt2, ...) to build from scratch"
            )
        if vocab_size is not None:
            overrides.setdefault("vocab_size", vocab_size)
        try:
            hf_config = AutoConfig.for_model(model_type, **overrides)
        except ValueError as e:
            raise ConfigError(f"model.config.model_type={model_type}: {e}") from None
        weights = False
    # On meta (materialize.empty_weights) the weights are read later, each rank only the
    # slices it keeps (a Pretrained source): here the model is built empty.
    if weights and not building_on_meta():
        model = AutoModelForCausalLM.from_pretrained(
            str(Path(path).expanduser()),
            config=hf_config,
            local_files_only=True,
            dtype=torch.float32,
        )
    else:
        try:
            model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
        except ValueError as e:
            line = str(e).strip().splitlines()[0]
            raise ConfigError(f"model=hf cannot build a causal LM: {line}") from None
    if activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lm = CausalLM(model)
    lm.weights_dir = Path(path).expanduser() if weights else None
    return lm


def _local_config(path: str) -> tuple[Any, bool]:
    """The directory's config and whether it holds weights."""
    from transformers import AutoConfig

    directory = Path(path).expanduser()
    if not directory.is_dir():
        raise ConfigError(
            f"model.path={path} is not a local directory; nothing is downloaded: give a "
            "directory written by save_pretrained (config.json, weights optional)"
        )
    if not (directory / "config.json").is_file():
        if (directory / FINAL_DIR / "config.json").is_file():
            raise ConfigError(
                f"model.path={path} has no config.json: it is a run directory, whose final "
                f"model is model.path={Path(path) / FINAL_DIR}"
            )
        raise ConfigError(f"model.path={path} has no config.json")
    try:
        config = AutoConfig.from_pretrained(str(directory), local_files_only=True)
    except (OSError, ValueError) as e:
        line = str(e).strip().splitlines()[0]
        raise ConfigError(f"model.path={path}: config.json cannot be read: {line}") from None
    return config, any((directory / w).is_file() for w in WEIGHTS)


def positions(model: nn.Module) -> int | None:
    """How many positions the model takes (GPT's block_size, HF's maximum positions)."""
    return getattr(model, "block_size", None)


@torch.no_grad()
def generate(
    model: Any,
    ids: list[int],
    tokens: int,
    temperature: float = 0.8,
    top_k: int | None = 200,
    generator: torch.Generator | None = None,
    window: int | None = None,
    device: torch.device | str = "cpu",
) -> list[int]:
    """`tokens` new ids after `ids`, each drawn from the softmax of the last logits over
    `temperature`, among the `top_k` likeliest (temperature 0: the likeliest). `model` is
    an nn.Module or an engine; `window`: the positions it takes (default: the module's).
    Draws on the host with `generator`, so every rank of an engine draws the same ids and
    runs the same number of forwards."""
    if window is None and isinstance(model, nn.Module):
        window = positions(model)
    idx = torch.tensor([ids], dtype=torch.long)  # (1, T)
    for _ in range(tokens):
        context = idx if window is None else idx[:, -window:]
        logits = model(context.to(device))[:, -1, :].float().cpu()  # (1, V)
        if temperature <= 0:
            nxt = logits.argmax(dim=-1, keepdim=True)
        else:
            logits = logits / temperature
            if top_k is not None and top_k < logits.shape[-1]:
                kth = torch.topk(logits, top_k).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)
        idx = torch.cat([idx, nxt], dim=1)
    return idx[0, len(ids) :].tolist()


# --------------------------------------------------------------------------------------
# The run's model files, and models rebuilt from them


def save_model_files(model: nn.Module, directory: Path, data_dir: Path | None) -> None:
    """config.json of `model` and the tokenizer files of `data_dir` into `directory`."""
    config = getattr(model, "model_config", None)
    if config is None:
        return  # not a language model: nothing to sample or export
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config(), indent=1, default=str))
    for name in ("meta.json", "tokenizer.json", "meta.pkl"):
        if data_dir is not None and (Path(data_dir) / name).is_file():
            shutil.copyfile(Path(data_dir) / name, directory / name)


def build_from_config(directory: Path) -> nn.Module:
    """A freshly initialised model of `directory/config.json` (ours or Hugging Face's)."""
    config = json.loads((Path(directory) / "config.json").read_text())
    ours = {GPT_TYPE: GPT, GPT_MOE_TYPE: GPTMoE}.get(config.get("model_type"))
    if ours is not None:
        return ours(**{k: v for k, v in config.items() if k != "model_type"})
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = AutoConfig.from_pretrained(str(directory), local_files_only=True)
    return CausalLM(AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32))


def load_exported(directory: Path) -> nn.Module:
    """A model exported by scripts/export_hf.py, weights included."""
    directory = Path(directory)
    if not (directory / "config.json").is_file():
        raise ConfigError(f"{directory} has no config.json")
    config = json.loads((directory / "config.json").read_text())
    if config.get("model_type") in (GPT_TYPE, GPT_MOE_TYPE):
        from safetensors.torch import load_model

        model = build_from_config(directory)
        load_model(model, str(directory / "model.safetensors"))
        return model
    return hf_causal_lm(str(directory))


def run_model(path: Path) -> tuple[nn.Module, Path, str]:
    """The model of a run directory (its newest checkpoint, else its final model) or of one
    checkpoint directory, on one process whatever mode and world size saved it: (model in
    eval mode, the run's model/ directory, what was loaded)."""
    from trainer import checkpoint

    found, model_dir, source = run_source(path)
    if found is None and Path(source).is_dir():  # model=hf's FINAL_DIR
        return hf_causal_lm(source).eval(), model_dir, source
    model = build_from_config(model_dir)
    if found is not None:
        state = checkpoint.consolidate(found)
    else:
        state = torch.load(source, weights_only=True)
    model.load_state_dict(state)
    return model.eval(), model_dir, source


def run_source(path: Path) -> tuple[Path | None, Path, str]:
    """Where the model of a run directory or of one checkpoint directory is: (the newest
    checkpoint, or None where only the final model is, the run's model/ directory, what
    will be read: that checkpoint, FINAL_FILE or FINAL_DIR)."""
    from omegaconf import OmegaConf

    from trainer import checkpoint

    path = Path(path)
    if (path / "meta.pt").is_file():  # one checkpoint: <run dir>/checkpoints/step_N
        found, model_dir = [path], path.parent.parent / "model"
    else:
        if not path.is_dir():
            raise ConfigError(f"{path} is neither a run directory nor a checkpoint")
        ckpt_dir = path / "checkpoints"
        saved = path / ".hydra" / "config.yaml"
        if saved.is_file() and OmegaConf.load(saved).get("ckpt", {}).get("dir"):
            ckpt_dir = Path(OmegaConf.load(saved).ckpt.dir)
        found, model_dir = checkpoint.find_checkpoints(ckpt_dir), path / "model"
        final = [path / n for n in (FINAL_FILE, FINAL_DIR) if (path / n).exists()]
        if not found and not final:
            raise ConfigError(
                f"run {path} has no checkpoint (none under {ckpt_dir}) and no final model "
                f"({FINAL_FILE} or {FINAL_DIR}/)"
            )
    if not (model_dir / "config.json").is_file():
        raise ConfigError(
            f"{model_dir / 'config.json'} is missing: the run did not train a language model "
            "(model=gpt or model=hf), or the checkpoint is not inside its run directory"
        )
    if found:
        return found[0], model_dir, str(found[0])
    return None, model_dir, str(final[0])
