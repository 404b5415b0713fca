"""Loading any config `check` and `convert` are given: dstrain's own (config/load.py), or another
engine's file imported as that engine reads it (a DeepSpeed JSON, with DeepSpeed's hjson
leniency; a Megatron-LM / Megatron-DeepSpeed / NeMo / ms-swift launch script).
"""

from pathlib import Path
from typing import Any

from dstrain.config.io import looks_like_script, parse_config_text, read_text
from dstrain.config.load import LoadedConfig, Source, load_config, validated
from dstrain.config.schema import SECTION_NAMES
from dstrain.errors import UserError
from dstrain.interop import megatron
from dstrain.interop.deepspeed import from_deepspeed
from dstrain.interop.ds_keys import DS_TOP_LEVEL
from dstrain.interop.ds_lint import read_hjson
from dstrain.interop.imported import DEFAULT_JUDGES, Imported, Judges
from dstrain.interop.launch_script import import_launch_script


def load_any(
    path: Path | None, overrides: list[str] | None = None, judges: Judges = DEFAULT_JUDGES
) -> LoadedConfig:
    """Read `path` (None = defaults) whoever's format it is, apply overrides, validate. Schema
    problems become findings; unreadable input raises UserError. `judges` says how a foreign
    file is judged."""
    if path is None:
        return load_config(None, overrides)
    source, imported = _read(path, judges)
    if source == "dstrain":  # our own file, read once: validated as load_config validates it
        return validated(imported.data, overrides, "dstrain")
    return validated(
        imported.data,
        overrides,
        source,
        imported.findings,
        imported.model_given,
        imported.virtual_layers_per_stage,
        imported.origins,
        imported.engine,
    )


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


def _read(path: Path, judges: Judges) -> tuple[Source, Imported]:
    """The file as a dstrain config dict: a foreign one imported, our own as it is."""
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
    if detect_source(data) != "deepspeed":
        return "dstrain", Imported(data=data, model_given=True)
    json_text = text if text.lstrip().startswith("{") else None
    return "deepspeed", from_deepspeed(data, text=json_text, judges=judges)
