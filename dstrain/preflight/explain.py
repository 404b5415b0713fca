"""`dstrain config --explain [section.key]`: every field's type, default and description."""

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from dstrain.config.flavors import FLAVORS
from dstrain.config.schema import DstrainConfig
from dstrain.config.suggest import did_you_mean
from dstrain.errors import UserError


@dataclass(frozen=True)
class FieldDoc:
    key: str
    type: str
    default: Any
    description: str


def explain(prefix: str | None = None) -> list[FieldDoc]:
    """Docs for every leaf field under `prefix` (a section, a key, or None for all)."""
    docs = list(_walk(DstrainConfig, ""))
    if not prefix:
        return docs
    chosen = [d for d in docs if d.key == prefix or d.key.startswith(prefix + ".")]
    if not chosen:
        raise UserError(
            f"no config key `{prefix}`{did_you_mean(prefix, [d.key for d in docs])}",
            "run `dstrain config --explain` for the whole list",
            exit_code=1,
        )
    return chosen


def section_doc(name: str) -> str:
    field = DstrainConfig.model_fields.get(name)
    annotation = field.annotation if field else None
    return (annotation.__doc__ or "").strip() if isinstance(annotation, type) else ""


def flavor_summary() -> list[str]:
    return [
        f"{name}: {a.num_layers} layers, dim {a.dim}, {a.attention}, "
        + (
            f"{a.num_routed_experts} routed + {a.num_shared_experts} shared experts, "
            f"top-{a.num_activated_experts}"
            if a.is_moe
            else "dense"
        )
        for name, a in FLAVORS.items()
    ]


def _walk(model: type[BaseModel], prefix: str):
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            yield from _walk(annotation, key + ".")
            continue
        default = field.get_default(call_default_factory=True)
        yield FieldDoc(key, _type_name(annotation), default, field.description or "")


def _type_name(annotation: Any) -> str:
    text = getattr(annotation, "__name__", None) or str(annotation)
    return text.replace("typing.", "").replace("pathlib.", "")
