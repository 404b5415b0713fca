"""summary.json: the final figures of a run (throughput, MFU, memory, pipeline bubble, and the
fault-tolerance ones: goodput, restarts, recomputed steps, guard events, failed saves)."""

import json
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass
class RunSummary:
    steps: int
    final_loss: float
    tokens_per_s: float
    mfu: float
    peak_rss_mb: float
    wall_s: float
    pipeline_bubble_fraction: float | None = None  # mean over the logged windows
    bad_steps: int = 0  # refused by the numerics guard
    checkpoint_failures: int = 0
    preempted: bool = False
    goodput: float = 0.0  # productive time / wall time since the run's first start
    productive_s: float = 0.0
    wall_since_first_start_s: float = 0.0
    restarts: int = 0
    elastic_restarts: int = 0
    recomputed_steps: int = 0


def write_summary(path: Path, summary: RunSummary) -> None:
    path.write_text(json.dumps(asdict(summary), indent=2) + "\n")
