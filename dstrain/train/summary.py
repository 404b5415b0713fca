"""summary.json: the final figures of a run (throughput, MFU, exposed communication, pipeline
bubble, peak memory, and the fault-tolerance ones: goodput, restarts, recomputed steps, guard
events, failed saves)."""

import json
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass
class RunSummary:
    steps: int
    world_size: int
    device: str  # "cpu", or the GPU's name as the driver reports it
    final_loss: float
    tokens_per_s: float  # global, over the whole run (this attempt)
    tflops_per_device: float  # model FLOPs
    mfu: float
    mfu_against: str  # the peak MFU counts against, and where it came from
    comm_exposed_fraction: float | None  # mean over the logged windows; None: timers off
    pipeline_bubble_fraction: float | None  # mean over the logged windows; None: no PP
    peak_rss_mb: float  # max over ranks
    peak_gpu_allocated_mb: float | None  # max over ranks; None: not on GPUs
    wall_s: float
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
