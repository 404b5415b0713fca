"""Loading a config from a file (dstrain's own, or a DeepSpeed/Megatron one) plus --set overrides.

Precedence, highest first: `--set section.key=value` overrides, the file, the schema defaults.
"""

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from dstrain.config import megatron
from dstrain.config.deepspeed import from_deepspeed
from dstrain.config.ds_keys import DS_TOP_LEVEL
from dstrain.config.ds_lint import read_hjson
from dstrain.config.findings import Finding
from dstrain.config.imported import DEFAULT_JUDGES, Imported, Judges
from dstrain.config.io import dump_toml, parse_config_text, read_text
from dstrain.config.launch_script import import_launch_script, looks_like_script
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


def detect_source(raw: dict[str, Any]) -> Source:
    """dstrain's own file has section tables; a DeepSpeed/Megatron file has their flat keys
    (Megatron's `lr = 3e-4` is a number, where dstrain's `lr` is a table). A table both name
    (DeepSpeed's `checkpoint` section) decides nothing: a key only DeepSpeed has decides."""
    if not raw:
        return "dstrain"
    ours = {k for k, v in raw.items() if k in SECTION_NAMES and isinstance(v, dict)}
    foreign = {k for k in raw if k in DS_TOP_LEVEL or megatron.is_megatron_key(k)}
    if ours - foreign:
        return "dstrain"
    if foreign - ours:
        return "deepspeed"
    return "dstrain"


def load_config(
    path: Path | None, overrides: list[str] | None = None, judges: Judges = DEFAULT_JUDGES
) -> LoadedConfig:
    """Read `path` (None = defaults), apply overrides, validate. Schema problems become findings;
    unreadable input raises UserError. `judges` says how a foreign file is judged."""
    overrides = overrides or []
    keys = [".".join(parse_override(text)[0]) for text in overrides]  # malformed --set fails first
    source, imported = _read(path, judges)
    config, schema_findings = build_config(apply_overrides(imported.data, overrides))
    for key in keys:  # a --set key is the user's own spelling again
        imported.origins.pop(key, None)
    return LoadedConfig(
        config,
        source,
        imported.findings + schema_findings,
        imported.model_given or any(k.startswith("model.") for k in keys),
        imported.virtual_layers_per_stage,
        imported.origins,
        imported.engine if source in ("deepspeed", "script") else None,
    )


def _read(path: Path | None, judges: Judges) -> tuple[Source, Imported]:
    """The file as a dstrain config dict: our own format as is, foreign ones imported."""
    if path is None:
        return "defaults", Imported(model_given=True)
    text = read_text(path)
    if looks_like_script(path.suffix, text):
        return "script", import_launch_script(text, judges)
    try:
        data = parse_config_text(text, path)
    except UserError:
        # DeepSpeed reads its file with hjson (comments, trailing commas): so does check.
        data = read_hjson(text)[0]
        if data is None or detect_source(data) != "deepspeed":
            raise
    source = detect_source(data)
    if source == "deepspeed":
        json_text = text if text.lstrip().startswith("{") else None
        return source, from_deepspeed(data, text=json_text, judges=judges)
    return source, Imported(data=data, model_given=True)


def to_toml(config: DstrainConfig) -> str:
    """The resolved config as TOML; `load_config` on it gives back an equal config."""
    return dump_toml(config.model_dump(mode="json", exclude_none=True))
