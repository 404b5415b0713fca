"""What an import (DeepSpeed JSON, Megatron keys) produces, and the value coercions it shares."""

import re
from dataclasses import dataclass, field
from typing import Any

from dstrain.config.findings import Finding, error
from dstrain.config.overrides import set_path

AUTO = "auto"
# The strings pydantic's lax mode reads as a bool (pydantic-core's bool parser).
LAX_BOOL_WORDS = {
    "0": False, "off": False, "f": False, "false": False, "n": False, "no": False,
    "1": True, "on": True, "t": True, "true": True, "y": True, "yes": True,
}  # fmt: skip
_INT_TEXT = re.compile(r"\s*[+-]?\d+(\.0*)?\s*")  # "8" and "8.0", not "5e8"


@dataclass(frozen=True)
class Judges:
    """How a foreign file is judged beyond dstrain's own reading of it: the DeepSpeed release the
    offline rules model (None: $DSTRAIN_DEEPSPEED_RELEASE, else the newest modelled), and whether
    an installed DeepSpeed also runs `deepspeed.initialize` and one step on a tiny model."""

    deepspeed_release: str | None = None
    deepspeed_initialize: bool = False


DEFAULT_JUDGES = Judges()


@dataclass
class Imported:
    """A dstrain config dict built from a foreign config, plus what the import had to say.

    `virtual_layers_per_stage` is Megatron's num_layers_per_virtual_pipeline_stage, which becomes
    parallel.num_virtual_stages only once the model's layer count is known. `origins` maps each
    dstrain key that was set to the foreign key it came from, so findings can name the user's key.
    """

    data: dict[str, Any] = field(default_factory=dict)
    findings: list[Finding] = field(default_factory=list)
    model_given: bool = False
    virtual_layers_per_stage: int | None = None
    origins: dict[str, str] = field(default_factory=dict)
    samples: dict[str, int] = field(default_factory=dict)  # Megatron *_samples, until steps
    stage_layers: dict[str, Any] = field(default_factory=dict)  # Megatron's per-stage overrides
    current: str = ""  # the foreign key being mapped; the default origin of `set`
    # The engine whose semantics the file is judged by first: DeepSpeed, Megatron-LM or
    # Megatron-DeepSpeed (the launch script's program and flags say which).
    engine: str = "DeepSpeed"
    release: Any = None  # the DeepSpeed release (ds_keys.Release) a DeepSpeed file is judged by

    def set(self, dotted: str, value: Any, source: str | None = None) -> None:
        self.origins[dotted] = source or self.current
        set_path(self.data, dotted.split("."), value)


def as_int(value: Any, key: str, findings: list[Finding], minimum: int = 0) -> int | None:
    """An integer (1e9 and 8.0 count), or None with an error finding."""
    if isinstance(value, bool) or not isinstance(value, int | float) or value != int(value):
        findings.append(error(key, f"expected a whole number, got {value!r}", "write e.g. 8"))
        return None
    if value < minimum:
        findings.append(error(key, f"must be >= {minimum}, got {value!r}"))
        return None
    return int(value)


def as_float(value: Any, key: str, findings: list[Finding]) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        findings.append(error(key, f"expected a number, got {value!r}", "write e.g. 1e-4"))
        return None
    return float(value)


def as_bool(value: Any, key: str, findings: list[Finding]) -> bool | None:
    if isinstance(value, bool):
        return value
    findings.append(error(key, f"expected true or false, got {value!r}", "write true or false"))
    return None


def lax_value(text: str, kind: str) -> int | float | bool | None:
    """`text` as pydantic's lax mode reads it into an int, float or bool field; None when it
    cannot ("5e8" is no int, "maybe" no bool)."""
    if kind == "bool":
        return LAX_BOOL_WORDS.get(text.strip().lower())
    if kind == "int":
        return int(float(text)) if _INT_TEXT.fullmatch(text) else None
    try:
        return float(text)
    except ValueError:
        return None
