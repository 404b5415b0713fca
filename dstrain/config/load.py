"""Loading dstrain's own config from a file plus --set overrides.

Other engines' files (a DeepSpeed JSON, a Megatron launch script) are read by
`dstrain/interop/load.py`, which only `check` and `convert` import: the trainer's floor does not
carry their catalogues. Given one, `load_config` says how to convert it.

Precedence, highest first: `--set section.key=value` overrides, the file, the schema defaults.
"""

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from dstrain.config.findings import Finding
from dstrain.config.io import dump_toml, looks_like_script, parse_config_text, read_text
from dstrain.config.overrides import apply_overrides, parse_override
from dstrain.config.schema import SECTION_NAMES, DstrainConfig
from dstrain.config.validate import build_config
from dstrain.errors import UserError

Source = Literal["defaults", "dstrain", "deepspeed", "script"]


@dataclass
class LoadedConfig:
    """A validated config and everything loading it had to say."""

    config: DstrainConfig
    source: Source
    findings: list[Finding] = field(default_factory=list)
    model_given: bool = True
    virtual_layers_per_stage: int | None = None
    origins: dict[str, str] = field(default_factory=dict)  # dstrain key -> the file's own key
    engine: str | None = None  # the foreign engine an imported file is judged by; None = ours


def load_config(path: Path | None, overrides: list[str] | None = None) -> LoadedConfig:
    """Read dstrain's own config at `path` (None = defaults), apply overrides, validate. Schema
    problems become findings; unreadable input, or another engine's file, raises UserError."""
    if path is None:
        return validated({}, overrides, "defaults")
    text = read_text(path)
    if looks_like_script(path.suffix, text):
        raise _foreign(path, "a launch script")
    data = parse_config_text(text, path)
    if data and not any(k in SECTION_NAMES and isinstance(v, dict) for k, v in data.items()):
        raise _foreign(path, f"none of its keys ({', '.join(list(data)[:4])}) is a dstrain section")
    return validated(data, overrides, "dstrain")


def validated(
    data: dict[str, Any],
    overrides: list[str] | None,
    source: Source,
    findings: list[Finding] | None = None,
    model_given: bool = True,
    virtual_layers_per_stage: int | None = None,
    origins: dict[str, str] | None = None,
    engine: str | None = None,
) -> LoadedConfig:
    """A config dict (ours, or one imported from another engine's file with what the import had
    to say) with the overrides applied, validated."""
    overrides = overrides or []
    keys = [".".join(parse_override(text)[0]) for text in overrides]  # malformed --set fails first
    config, schema_findings = build_config(apply_overrides(data, overrides))
    origins = dict(origins or {})
    for key in keys:  # a --set key is the user's own spelling again
        origins.pop(key, None)
    return LoadedConfig(
        config,
        source,
        [*(findings or []), *schema_findings],
        model_given or any(k.startswith("model.") for k in keys),
        virtual_layers_per_stage,
        origins,
        engine,
    )


def _foreign(path: Path, why: str) -> UserError:
    return UserError(
        f"{path} is not a dstrain config: {why}; it looks like another engine's file "
        "(DeepSpeed JSON, Megatron launch script)",
        f"`dstrain check {path}` judges it as its engine would; `dstrain convert {path} -o "
        "run.toml` writes the dstrain config to run",
    )


def to_toml(config: DstrainConfig) -> str:
    """The resolved config as TOML; `load_config` on it gives back an equal config."""
    return dump_toml(config.model_dump(mode="json", exclude_none=True))
