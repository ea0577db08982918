"""The run to estimate, from the same Hydra overrides train.py takes: conf/ composed with
Hydra's compose API and checked by trainer/config/checks.py, once per mode.

Without `mode=...` every mode is estimated. An override of a mode's own option
(`mode.min_unit_params=...`) applies to the modes that have it; an option no mode has
is refused as train.py refuses it.
"""

from __future__ import annotations

from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import ConfigCompositionException
from omegaconf import DictConfig, OmegaConf

from trainer.config import schema  # noqa: F401  (registers the config's types with Hydra)
from trainer.config.checks import CONF_DIR, validate
from trainer.errors import ConfigError
from trainer.parallel import ENGINES


def compose_modes(overrides: list[str], world_size: int) -> dict[str, DictConfig]:
    """{mode: composed and checked config} for the chosen mode, or for every mode."""
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except Exception as e:  # Hydra's parser error names the bad override
        raise ConfigError(str(e).splitlines()[0]) from None
    chosen = [str(o.value()) for o in parsed if o.key_or_group == "mode"]
    modes = chosen[-1:] or list(ENGINES)
    keys = {m: set(OmegaConf.load(CONF_DIR / "mode" / f"{m}.yaml")) for m in ENGINES}
    known = set().union(*keys.values())
    out = {}
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        for m in modes:
            kept = [
                o.input_line
                for o in parsed
                if o.key_or_group != "mode" and not _other_modes_key(o.key_or_group, keys[m], known)
            ]
            out[m] = _compose([f"mode={m}", *kept])
            validate(out[m], world_size)
    return out


def _other_modes_key(key: str, mine: set[str], known: set[str]) -> bool:
    """`mode.K` where K is an option of another mode only."""
    parts = key.split(".")
    return parts[0] == "mode" and len(parts) > 1 and parts[1] not in mine and parts[1] in known


def _compose(overrides: list[str]) -> DictConfig:
    try:
        return compose("config", overrides=overrides)
    except ConfigCompositionException as e:  # "Could not override 'model.foo'. ..."
        cause = str(e.__cause__ or "").strip().splitlines()
        reason = f": {cause[0]}" if cause and "Error merging" in str(e) else ""
        raise ConfigError(
            " ".join(str(e).split()).replace("Error merging override ", "") + reason
        ) from None
