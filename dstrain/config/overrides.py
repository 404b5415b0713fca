"""Dotted command-line overrides: `--set parallel.tp=2` beats the file, which beats the defaults."""

import tomllib
from typing import Any

from dstrain.errors import UserError


def parse_override(text: str) -> tuple[list[str], Any]:
    """`section.key=value` -> (["section", "key"], value). Values are read as TOML literals
    (`2`, `true`, `1e-4`, `[0.9, 0.95]`, `"x"`), and as a plain string otherwise."""
    key, sep, raw = text.partition("=")
    path = [part.strip() for part in key.strip().split(".")]
    if not sep or not all(path):
        raise UserError(
            f"--set {text!r} is not of the form section.key=value",
            "write e.g. --set parallel.tp=2 (no spaces around `=`, or quote the whole pair)",
        )
    return path, _parse_value(raw.strip())


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """A copy of `data` with each override set at its dotted path (later ones win)."""
    merged = copy_tree(data)
    for text in overrides:
        set_path(merged, *parse_override(text))
    return merged


def set_path(data: dict[str, Any], path: list[str], value: Any) -> None:
    """Set data[p0][p1]...[pn] = value, making (or replacing non-table) sections on the way."""
    node = data
    for part in path[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = node[part] = {}
        node = child
    node[path[-1]] = value


def _parse_value(raw: str) -> Any:
    if raw.lower() in ("none", "null"):
        return None
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def copy_tree(data: dict[str, Any]) -> dict[str, Any]:
    """A copy of nested dicts (leaves shared), so a caller's config dict is never mutated."""
    return {k: copy_tree(v) if isinstance(v, dict) else v for k, v in data.items()}
