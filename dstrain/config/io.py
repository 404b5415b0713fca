"""Reading config files (TOML, YAML, JSON) into dicts, and writing the resolved config as TOML.

Every syntax error becomes a UserError that gives the file, line and column.
"""

import json
import re
import tomllib
from pathlib import Path
from typing import Any

import tomli_w
import yaml

from dstrain.errors import UserError

_FORMATS = {".toml": "toml", ".yaml": "yaml", ".yml": "yaml", ".json": "json"}


def read_text(path: Path) -> str:
    if not path.exists():
        raise UserError(f"config file not found: {path}", "check the path (relative to the cwd)")
    if path.is_dir():
        raise UserError(f"{path} is a directory, not a config file", "pass the file inside it")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(
            f"{path} is not UTF-8 text (byte {exc.start})", "save the config as UTF-8"
        ) from None
    except OSError as exc:
        raise UserError(f"cannot read {path}: {exc.strerror}", "check its permissions") from None


def parse_config_text(text: str, path: Path) -> dict[str, Any]:
    """Parse a config file's text by `path`'s extension (or by content when it has none)."""
    kind = _FORMATS.get(path.suffix.lower()) or _sniff(text)
    data = parse_text(text, kind, str(path))
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(
            f"{path}: the top level is a {type(data).__name__}, not a table of sections",
            "write `key = value` pairs (TOML) or a JSON object `{...}`",
        )
    bad = _non_text_keys(data)
    if bad:
        # YAML allows keys that are not strings (`? : x`, `1: x`); no config format has them.
        raise UserError(
            f"{path}: the key {bad[0]!r} is not a name (YAML read it as "
            f"{_KINDS.get(type(bad[0]), type(bad[0]).__name__)})",
            "write every key as a name, e.g. `train:` (quote it if it looks like a number)",
        )
    return data


_KINDS = {type(None): "null", bool: "a boolean", int: "a number", float: "a number"}


def _non_text_keys(node: Any) -> list[Any]:
    """Every key anywhere in `node` that is not a string."""
    if isinstance(node, dict):
        return [
            bad
            for key, value in node.items()
            for bad in ([key] if not isinstance(key, str) else []) + _non_text_keys(value)
        ]
    if isinstance(node, list):
        return [bad for item in node for bad in _non_text_keys(item)]
    return []


def parse_text(text: str, kind: str, name: str) -> Any:
    if kind == "json":
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise _syntax_error(name, "JSON", exc.msg, exc.lineno, exc.colno) from None
    if kind == "toml":
        try:
            return tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            line, col = _toml_position(str(exc))
            message = re.sub(r"\s*\(at .*\)$", "", str(exc))
            raise _syntax_error(name, "TOML", message, line, col) from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line, col = (mark.line + 1, mark.column + 1) if mark else (None, None)
        message = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise _syntax_error(name, "YAML", message, line, col) from None


def dump_toml(data: dict[str, Any]) -> str:
    return tomli_w.dumps(data)


def _sniff(text: str) -> str:
    stripped = text.lstrip()
    if stripped.startswith(("{", "[")) and not re.match(
        r"\[[A-Za-z_.]+\]\s*$", stripped.split("\n")[0]
    ):
        return "json"
    try:
        tomllib.loads(text)
        return "toml"
    except tomllib.TOMLDecodeError:
        return "yaml"


def _toml_position(message: str) -> tuple[int | None, int | None]:
    match = re.search(r"line (\d+), column (\d+)", message)
    return (int(match.group(1)), int(match.group(2))) if match else (None, None)


def _syntax_error(
    name: str, fmt: str, message: str, line: int | None, col: int | None
) -> UserError:
    where = f" at line {line}, column {col}" if line is not None else ""
    hint = {
        "JSON": "look for a missing comma or quote just before that point; JSON allows no "
        "trailing commas or comments",
        "TOML": "check the quoting and the `key = value` form on that line",
        "YAML": "check the indentation and the `key: value` form on that line",
    }[fmt]
    return UserError(f"{name}: invalid {fmt}{where}: {message}", hint, exit_code=2)


SCRIPT_SUFFIXES = {".sh", ".bash", ".slurm", ".sbatch"}


def looks_like_script(suffix: str, text: str) -> bool:
    """A shell launch script (by its suffix or a shebang), not a config file."""
    return suffix.lower() in SCRIPT_SUFFIXES or text.startswith("#!")
