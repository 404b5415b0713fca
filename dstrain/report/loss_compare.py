"""Comparing two runs' per-step losses: the check a user runs before trusting a new layout.

Train a small proxy twice, once with the known-good layout and once with the new one (same
config, seed and data), then compare: the first step whose loss differs by more than `rtol`
is the first place the new layout changes the maths.
"""

import json
import math
from dataclasses import dataclass
from pathlib import Path

from dstrain.errors import UserError


@dataclass(frozen=True)
class Comparison:
    key: str
    steps: int  # steps present in both runs
    max_rel_diff: float
    first_divergence: tuple[int, float, float] | None  # (step, a, b)
    only_in_a: int
    only_in_b: int

    @property
    def matches(self) -> bool:
        return self.first_divergence is None and self.steps > 0


def read_losses(run: Path, key: str) -> dict[int, float]:
    """{step: value} from a run directory (or a metrics.jsonl path)."""
    path = run / "metrics.jsonl" if run.is_dir() else run
    if not path.exists():
        raise UserError(f"no metrics at {path}", "pass a run directory (runs/<name>)")
    losses: dict[int, float] = {}
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            raise UserError(
                f"{path}: line {number} is not JSON", "is the file truncated?"
            ) from None
        if isinstance(row, dict) and key in row and "step" in row:
            losses[int(row["step"])] = float(row[key])
    if not losses:
        raise UserError(f"{path} has no `{key}` values", "choose another --key", exit_code=1)
    return losses


def compare(a: dict[int, float], b: dict[int, float], key: str, rtol: float) -> Comparison:
    common = sorted(a.keys() & b.keys())
    worst, first = 0.0, None
    for step in common:
        x, y = a[step], b[step]
        rel = abs(x - y) / max(abs(x), abs(y), 1e-30)
        if math.isnan(x) != math.isnan(y):
            rel = math.inf
        worst = max(worst, rel)
        if first is None and rel > rtol:
            first = (step, x, y)
    return Comparison(
        key, len(common), worst, first, len(a.keys() - b.keys()), len(b.keys() - a.keys())
    )
