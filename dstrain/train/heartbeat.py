"""Heartbeats: each rank records what it is doing (step, phase) in runs/<name>/heartbeat/, so a
rank that stops responding can be named, by the ranks that time out waiting for it and by
`dstrain status RUN_DIR`.

One small JSON file per rank, replaced atomically at every phase change (a few per step: the
write costs tens of microseconds, nothing beside a step).
"""

import json
import os
import time
from pathlib import Path
from typing import Any

PHASES = ("start", "data", "step", "checkpoint", "done", "failed")


class Heartbeat:
    def __init__(self, run_dir: Path, rank: int, attempt: int) -> None:
        self.folder = run_dir / "heartbeat"
        self.folder.mkdir(parents=True, exist_ok=True)
        self.path = self.folder / f"rank{rank}.json"
        self.rank, self.attempt = rank, attempt
        self.step, self.phase = 0, "start"

    def beat(self, step: int, phase: str) -> None:
        self.step, self.phase = step, phase
        record = {
            "rank": self.rank,
            "step": step,
            "phase": phase,
            "time": time.time(),
            "pid": os.getpid(),
            "attempt": self.attempt,
        }
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record))
        os.replace(tmp, self.path)


def read_heartbeats(run_dir: Path) -> list[dict[str, Any]]:
    """Every rank's last heartbeat, by rank; unreadable files are skipped."""
    beats = []
    for path in sorted((run_dir / "heartbeat").glob("rank*.json")):
        try:
            beats.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return sorted(beats, key=lambda b: b["rank"])


def laggards(beats: list[dict[str, Any]], me: int) -> list[dict[str, Any]]:
    """The ranks that fell behind: on an earlier step than the others, or (same step) silent the
    longest. Empty when nothing stands out."""
    others = [b for b in beats if b["rank"] != me]
    if not others:
        return []
    newest_step = max(b["step"] for b in beats)
    behind = [b for b in others if b["step"] < newest_step]
    if behind:
        return behind
    oldest = min(b["time"] for b in others)
    newest = max(b["time"] for b in beats)
    return [b for b in others if b["time"] == oldest] if newest - oldest > 1.0 else []
