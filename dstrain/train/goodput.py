"""Goodput: the share of wall time that produced steps the run kept.

- wall time runs from the run's first start (runs/<name>/run_state.json), across crashes,
  elastic restarts and resumes;
- productive time is the time of the steps that survive: it is part of every checkpoint, so a
  resume forgets the time of the steps it recomputes;
- recomputed steps: at each resume, the steps the previous attempt had finished past the
  checkpoint (from its heartbeats);
- restarts: every start after the first (elastic restarts counted apart).
"""

import json
import os
import time
from pathlib import Path
from typing import Any


class RunClock:
    def __init__(self, run_dir: Path, is_main: bool, fresh: bool) -> None:
        self.path = run_dir / "run_state.json"
        self.is_main = is_main
        state = None if fresh or not self.path.exists() else _read(self.path)
        self.state = state or {"first_start": time.time(), "starts": 0, "recomputed_steps": 0}
        self.state["starts"] += 1
        self.productive_s = 0.0
        self._write()

    def resumed(self, step: int, steps_done_before: int) -> int:
        """Record a resume at `step` after the previous attempt had finished `steps_done_before`;
        returns the steps that will be recomputed."""
        lost = max(0, steps_done_before - step)
        self.state["recomputed_steps"] += lost
        self._write()
        return lost

    def add(self, seconds: float) -> None:
        self.productive_s += seconds

    def summary(self) -> dict[str, Any]:
        wall = time.time() - self.state["first_start"]
        return {
            "goodput": self.productive_s / wall if wall > 0 else 0.0,
            "productive_s": self.productive_s,
            "wall_since_first_start_s": wall,
            "restarts": self.state["starts"] - 1,
            "elastic_restarts": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0),
            "recomputed_steps": self.state["recomputed_steps"],
        }

    def _write(self) -> None:
        if not self.is_main:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.state, indent=2) + "\n")
        os.replace(tmp, self.path)


def _read(path: Path) -> dict[str, Any] | None:
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    needed = {"first_start", "starts", "recomputed_steps"}
    return state if isinstance(state, dict) and needed <= state.keys() else None
