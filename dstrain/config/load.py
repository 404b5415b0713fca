"""Loading a config from a file (dstrain's own, or a DeepSpeed/Megatron one) plus --set overrides.

Precedence, highest first: `--set section.key=value` overrides, the file, the schema defaults.
"""

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from dstrain.config import megatron
from dstrain.config.deepspeed import from_deepspeed
from dstrain.config.ds_keys import DS_TOP_LEVEL
from dstrain.config.findings import Finding
from dstrain.config.io import dump_toml, read_config_file
from dstrain.config.overrides import apply_overrides, parse_override
from dstrain.config.schema import SECTION_NAMES, DstrainConfig
from dstrain.config.validate import build_config

Source = Literal["defaults", "dstrain", "deepspeed"]


@dataclass
class LoadedConfig:
    """A validated config and everything loading it had to say."""

    config: DstrainConfig
    source: Source
    findings: list[Finding] = field(default_factory=list)
    model_given: bool = True
    virtual_layers_per_stage: int | None = None
    origins: dict[str, str] = field(default_factory=dict)  # dstrain key -> the file's own key


def detect_source(raw: dict[str, Any]) -> Source:
    """dstrain's own file has section tables; a DeepSpeed/Megatron file has their flat keys
    (Megatron's `lr = 3e-4` is a number, where dstrain's `lr` is a table)."""
    if not raw:
        return "dstrain"
    if any(k in SECTION_NAMES and isinstance(v, dict) for k, v in raw.items()):
        return "dstrain"
    if any(k in DS_TOP_LEVEL or megatron.is_megatron_key(k) for k in raw):
        return "deepspeed"
    return "dstrain"


def load_config(path: Path | None, overrides: list[str] | None = None) -> LoadedConfig:
    """Read `path` (None = defaults), apply overrides, validate. Schema problems become findings;
    unreadable input raises UserError."""
    overrides = overrides or []
    for text in overrides:
        parse_override(text)  # malformed --set fails before the file is read
    raw = read_config_file(path) if path is not None else {}
    source: Source = detect_source(raw) if path is not None else "defaults"
    findings: list[Finding] = []
    model_given = source != "deepspeed"
    virtual_layers = None
    origins: dict[str, str] = {}
    data = raw
    if source == "deepspeed":
        imported = from_deepspeed(raw)
        data, findings = imported.data, imported.findings
        model_given = imported.model_given
        virtual_layers = imported.virtual_layers_per_stage
        origins = imported.origins
    model_given |= any(parse_override(t)[0][0] == "model" for t in overrides)
    config, schema_findings = build_config(apply_overrides(data, overrides))
    for text in overrides:  # a --set key is the user's own spelling again
        origins.pop(".".join(parse_override(text)[0]), None)
    return LoadedConfig(
        config, source, findings + schema_findings, model_given, virtual_layers, origins
    )


def to_toml(config: DstrainConfig) -> str:
    """The resolved config as TOML; `load_config` on it gives back an equal config."""
    return dump_toml(config.model_dump(mode="json", exclude_none=True))
