"""The run to estimate, from the same Hydra overrides train.py takes: conf/ composed with
Hydra's compose API and checked by trainer/config/checks.py, once per mode.

Without `mode=...` every mode is estimated. An override of a mode's own option
(`mode.min_unit_params=...`) applies to the modes that have it; an option no mode has
is refused as train.py refuses it. Replica groups (`--replica-groups N`, or the `ft.*`
keys) switch `ft.enabled` on; the estimate needs no Lighthouse.
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

# ft.lighthouse where none is given: the estimate starts nothing and asks no Lighthouse,
# but the config's checks want one named under ft.enabled
NO_LIGHTHOUSE = "http://no-lighthouse.invalid:0"


def compose_modes(
    overrides: list[str], world_size: int, replica_groups: int | None = None
) -> dict[str, DictConfig]:
    """{mode: composed and checked config} for the chosen mode, or for every mode;
    `replica_groups`: N groups of `world_size` ranks (ft.replica_groups=N)."""
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except Exception as e:  # Hydra's parser error names the bad override
        raise ConfigError(str(e).splitlines()[0]) from None
    overrides = [*overrides, *_ft_overrides(parsed, replica_groups)]
    parsed = OverridesParser.create().parse_overrides(overrides)
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
            if out[m].ft.enabled and not out[m].ft.lighthouse:
                out[m].ft.lighthouse = NO_LIGHTHOUSE
            validate(out[m], world_size)
    return out


def _ft_overrides(parsed: list, replica_groups: int | None) -> list[str]:
    """`ft.replica_groups=N` for `--replica-groups N`, and `ft.enabled=true` where groups
    or any ft key are asked for and ft.enabled is not given."""
    given = {o.key_or_group: o.value() for o in parsed if o.key_or_group.startswith("ft.")}
    extra = []
    if replica_groups is not None:
        if replica_groups < 1:
            raise ConfigError(f"--replica-groups {replica_groups} must be >= 1")
        configured = given.get("ft.replica_groups", replica_groups)
        if configured != replica_groups:
            raise ConfigError(
                f"--replica-groups {replica_groups} differs from ft.replica_groups={configured}"
            )
        if "ft.replica_groups" not in given:
            extra.append(f"ft.replica_groups={replica_groups}")
    wanted = (replica_groups or 1) > 1 or any(k != "ft.enabled" for k in given)
    if wanted and "ft.enabled" not in given:
        extra.append("ft.enabled=true")
    elif (replica_groups or 1) > 1 and given.get("ft.enabled") is False:
        raise ConfigError(
            f"--replica-groups {replica_groups} with ft.enabled=false: replica groups are "
            "ft's; drop ft.enabled=false"
        )
    return extra


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
