"""Heartbeats: each rank records what it is doing (step, phase) in runs/<name>/heartbeat/, so a
rank that stops responding can be named, by the ranks that time out waiting for it and by
`dstrain status RUN_DIR`.

One small JSON file per rank, rewritten in place at every phase change (three per step): the file
is opened once and each beat is one `pwrite` of a fixed-size record at offset 0, so a beat is no
metadata operation (no create, no rename) on a shared filesystem, where 2,048 ranks renaming
three files a step would make ~6,000 metadata operations per step. A reader may, rarely, catch a
record half-written; it skips that file for that read.
"""

import json
import os
import time
from pathlib import Path
from typing import Any

from dstrain.errors import UserError

# In the order a step goes through them ("step": about to start step+1); a rank whose phase is
# earlier than the others' at the same step is the one holding them up.
PHASES = ("start", "step", "data", "compute", "checkpoint", "done", "failed", "out of memory")
RECORD_BYTES = 256  # every record padded to this size, so each write covers the last one


class Heartbeat:
    def __init__(self, run_dir: Path, rank: int, attempt: int) -> None:
        self.folder = run_dir / "heartbeat"
        self.folder.mkdir(parents=True, exist_ok=True)
        self.path = self.folder / f"rank{rank}.json"
        self.rank, self.attempt = rank, attempt
        self.step, self.phase = 0, "start"
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o644)
        os.ftruncate(self._fd, RECORD_BYTES)  # a longer file from an older version: cut

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
        os.pwrite(self._fd, json.dumps(record).encode().ljust(RECORD_BYTES), 0)

    def close(self) -> None:
        os.close(self._fd)


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
    """The ranks that fell behind the rest: at an earlier (step, phase). Empty when none did."""
    others = [b for b in beats if b["rank"] != me]
    if not others:
        return []
    progress = [_progress(b) for b in beats]
    furthest = max(progress)
    behind = [b for b in others if _progress(b) < furthest]
    return behind if len(behind) < len(beats) else []


def _progress(beat: dict[str, Any]) -> tuple[int, int]:
    phase = beat.get("phase")
    return beat["step"], PHASES.index(phase) if phase in PHASES else 0


# What gloo and NCCL say when a peer never answers, or died.
TIMEOUT_SIGNS = ("timed out", "timeout", "connection closed by peer", "connection reset")


def explain_timeout(exc: BaseException, run_dir: Path, me: int, step: int) -> UserError | None:
    """A collective or p2p timeout as one error that names the ranks holding the others up (from
    their heartbeats) and what this rank was waiting in; None for any other error."""
    text = exc.message if isinstance(exc, UserError) else str(exc).strip()
    if not any(sign in text.lower() for sign in TIMEOUT_SIGNS):
        return None
    beats = read_heartbeats(run_dir)
    # a rank that ran out of memory (`oom.py`) said so before it left: the one to name
    ran_out = [b for b in beats if b["rank"] != me and b.get("phase") == "out of memory"]
    late = ran_out or laggards(beats, me)
    now = time.time()
    shown = late or [b for b in beats if b["rank"] != me]
    heard = "; ".join(
        f"rank {b['rank']} at step {b['step'] + 1} ({b['phase']}), last heard "
        f"{now - b['time']:.0f} s ago"
        for b in shown
    )
    culprit = "held up by " if late else "no rank stands out in the heartbeats: "
    first = text.splitlines()[0] if isinstance(exc, UserError) else text.splitlines()[-1]
    return UserError(
        f"rank {me} timed out in step {step}, {culprit}{heard or 'no heartbeats'} ({first})",
        "the rank named above hung or died: its own log has the cause (`dstrain status "
        f"{run_dir}` shows every rank's heartbeat); if it is only slow, raise comm.timeout_s",
        exit_code=1,
    )
