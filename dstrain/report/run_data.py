"""A run directory as the report reads it: metrics.jsonl as one series per key, the experts'
loads per MoE layer, summary.json and config.toml.

Every file but metrics.jsonl may be missing (a run still going, or one that crashed). A line of
metrics.jsonl cut short by a kill is skipped; any other unreadable line is an error naming it.
"""

import json
import math
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dstrain.errors import UserError

LOAD_KEY = re.compile(r"moe/(?P<layer>.+)/tokens_per_expert")


@dataclass(frozen=True)
class Series:
    """One metric over the run, in step order."""

    steps: list[int]
    values: list[float]


@dataclass
class RunData:
    name: str
    path: Path
    series: dict[str, Series] = field(default_factory=dict)
    # layer -> one list of per-expert token counts per logged line, all of that layer's width
    expert_load: dict[str, list[list[float]]] = field(default_factory=dict)
    summary: dict[str, Any] | None = None  # None: no summary.json yet
    config_text: str | None = None
    truncated_tail: bool = False  # the last line of metrics.jsonl was cut short and skipped


def load_run(run_dir: Path) -> RunData:
    """Read `run_dir` (runs/<name>); raises UserError when it is not a readable run."""
    if not run_dir.is_dir():
        raise UserError(f"no run directory at {run_dir}", "pass runs/<name> of a run")
    rows, truncated = _read_rows(run_dir / "metrics.jsonl")
    run = RunData(name=run_dir.resolve().name, path=run_dir, truncated_tail=truncated)
    run.series, run.expert_load = _columns(rows)
    run.summary = _read_summary(run_dir / "summary.json")
    config = run_dir / "config.toml"
    run.config_text = config.read_text(errors="replace") if config.is_file() else None
    return run


def _read_rows(path: Path) -> tuple[list[dict[str, Any]], bool]:
    """The logged lines in step order (a repeated step: the later line wins), and whether the
    last line was cut short."""
    if not path.is_file():
        raise UserError(
            f"{path.parent} has no metrics.jsonl",
            "pass the runs/<name> folder of a run that has logged at least one step",
        )
    lines = path.read_text(errors="replace").splitlines()
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    by_step: dict[int, dict[str, Any]] = {}
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            if i == last:
                return _in_order(by_step), True  # killed mid-write: what came before stands
            raise _bad_line(path, i + 1, f"is not JSON ({exc.msg})") from None
        by_step[_step_of(row, path, i + 1)] = row
    return _in_order(by_step), False


def _in_order(by_step: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    return [by_step[step] for step in sorted(by_step)]


def _step_of(row: Any, path: Path, number: int) -> int:
    if not isinstance(row, dict):
        raise _bad_line(path, number, "is not a JSON object")
    step = row.get("step")
    if not _is_number(step) or not math.isfinite(step) or step != int(step):
        raise _bad_line(path, number, f"has no whole-number `step` (got {step!r})")
    return int(step)


def _bad_line(path: Path, number: int, what: str) -> UserError:
    return UserError(
        f"{path}: line {number} {what}",
        "repair or delete that line (each line is one JSON object with a `step`)",
    )


def _columns(
    rows: list[dict[str, Any]],
) -> tuple[dict[str, Series], dict[str, list[list[float]]]]:
    """Numbers become series; `moe/<layer>/tokens_per_expert` lists become per-layer loads;
    anything else (strings, other lists) is not drawn."""
    series: dict[str, Series] = {}
    loads: dict[str, list[list[float]]] = {}
    for row in rows:
        for key, value in row.items():
            if key == "step":
                continue
            if _is_number(value):
                entry = series.setdefault(key, Series([], []))
                entry.steps.append(int(row["step"]))
                entry.values.append(float(value))
            elif (match := LOAD_KEY.fullmatch(key)) and _is_load(value):
                loads.setdefault(match["layer"], []).append([float(v) for v in value])
    return series, {layer: _same_width(lines) for layer, lines in loads.items()}


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_load(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(_is_number(v) for v in value)


def _same_width(lines: list[list[float]]) -> list[list[float]]:
    """Keep the lines of the layer's usual expert count (a resume with another model would
    otherwise mix widths)."""
    width = Counter(len(line) for line in lines).most_common(1)[0][0]
    return [line for line in lines if len(line) == width]


def _read_summary(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        summary = json.loads(path.read_text(errors="replace"))
    except json.JSONDecodeError as exc:
        raise UserError(
            f"{path} is not JSON (line {exc.lineno}: {exc.msg})",
            "delete it to report the metrics alone; the trainer rewrites it at the end of a run",
        ) from None
    if not isinstance(summary, dict):
        raise UserError(f"{path} is not a JSON object", "delete it to report the metrics alone")
    return summary
