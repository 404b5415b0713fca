"""Turning a raw dict into a DstrainConfig, with every schema problem reported as a Finding.

`check` must report every problem at once, so a key that fails validation is reported, dropped
(its default takes its place), and validation runs again until the rest is clean.
"""

from typing import Any

from pydantic import BaseModel, ValidationError

from dstrain.config.findings import Finding, error
from dstrain.config.overrides import copy_tree
from dstrain.config.schema import DstrainConfig
from dstrain.config.suggest import did_you_mean
from dstrain.errors import UserError

_MAX_PASSES = 50


def build_config(data: dict[str, Any]) -> tuple[DstrainConfig, list[Finding]]:
    """Validate `data`; return the config (with bad keys at their defaults) and the findings."""
    findings: list[Finding] = []
    current = copy_tree(data)
    for _ in range(_MAX_PASSES):
        try:
            return DstrainConfig.model_validate(current), findings
        except ValidationError as exc:
            for err in exc.errors():
                findings.append(_finding(err))
                _drop(current, err["loc"])
    raise AssertionError("config validation did not converge")  # each pass drops >= 1 key


def raise_if_errors(findings: list[Finding]) -> None:
    """For commands that cannot run on a broken config: every error in one UserError (exit 1).
    They run it in dstrain, so what only dstrain cannot run (`unsupported`) stops them too."""
    errors = [f for f in findings if f.severity in ("error", "unsupported")]
    if errors:
        lines = "\n".join(f"  {f.key}: {f.message}" for f in errors)
        raise UserError(
            f"the config has {len(errors)} error(s):\n{lines}",
            "`dstrain check` on it gives the fix for each; `dstrain config --explain KEY` "
            "describes a key",
            exit_code=1,
        )


def _finding(err: Any) -> Finding:
    loc = [str(part) for part in err["loc"]]
    key = ".".join(loc)
    if err["type"] == "extra_forbidden":
        options = _fields_at(loc[:-1])
        hint = did_you_mean(loc[-1], options)
        where = f"section `{'.'.join(loc[:-1])}`" if len(loc) > 1 else "the top level"
        return error(
            key,
            f"unknown key `{loc[-1]}` in {where}{hint}",
            f"valid keys here: {', '.join(sorted(options))}",
        )
    got = err.get("input")
    shown = "" if isinstance(got, dict) else f" (got {got!r})"
    return error(key, f"{err['msg']}{shown}", f"see `dstrain config --explain {key}`")


def _fields_at(loc: list[str]) -> list[str]:
    model: type[BaseModel] = DstrainConfig
    for part in loc:
        field = model.model_fields.get(part)
        annotation = field.annotation if field else None
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return []
        model = annotation
    return list(model.model_fields)


def _drop(data: dict[str, Any], loc: tuple[Any, ...]) -> None:
    """Remove the deepest dict key on `loc` (a bad list item drops the whole list)."""
    node: Any = data
    parent: dict[str, Any] | None = None
    key: Any = None
    for part in loc:
        if not isinstance(node, dict) or part not in node:
            break
        parent, key, node = node, part, node[part]
    if parent is not None:
        parent.pop(key)
