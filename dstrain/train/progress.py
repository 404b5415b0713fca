"""What the user watches: one logger with a fixed prefix, and a live progress bar.

The bar (step, loss, lr, tokens/s, MFU, ETA) draws only on a terminal; every log interval also
prints one plain line, so CI logs and `tee`d files show the run too.
"""

import sys

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from dstrain.metrics.sinks import Metrics

PREFIX = "[dstrain]"
_console = Console(stderr=True, highlight=False, soft_wrap=True)


def log(message: str) -> None:
    _console.print(f"{PREFIX} {message}", markup=False)


class TrainProgress:
    def __init__(self, total_steps: int, start_step: int, enabled: bool = True) -> None:
        self.progress = Progress(
            TextColumn("step"),
            MofNCompleteColumn(),
            BarColumn(bar_width=20),
            TextColumn("{task.fields[stats]}"),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            console=_console,
            disable=not (enabled and _console.is_terminal),
        )
        self.task = self.progress.add_task(
            "train", total=total_steps, completed=start_step, stats="starting"
        )

    def __enter__(self) -> "TrainProgress":
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    def advance(self) -> None:
        self.progress.advance(self.task)

    def report(self, step: int, metrics: Metrics) -> None:
        stats = _format(metrics)
        if "loss/main" in metrics:  # not an evaluation-only line
            self.progress.update(self.task, stats=_compact(metrics))
        if self.progress.disable:
            print(f"{PREFIX} step {step}: {stats}", file=sys.stderr, flush=True)
        else:
            self.progress.console.print(f"{PREFIX} step {step}: {stats}", markup=False)


def _compact(m: Metrics) -> str:
    """The bar's short form, to fit an 80-column terminal."""
    parts = [
        f"loss {m['loss/main']:.3f}",
        f"lr {m['optim/lr']:.1e}",
        f"{m['throughput/tokens_per_s'] / 1000:.1f}k tok/s",
    ]
    if "throughput/mfu" in m:
        parts.append(f"MFU {100 * m['throughput/mfu']:.0f}%")
    return " ".join(parts)


def _format(m: Metrics) -> str:
    evaluation = (
        f"eval loss {m['eval/loss']:.4f} (ppl {m['eval/ppl']:.2f})" if "eval/loss" in m else ""
    )
    if "loss/main" not in m:
        return evaluation
    parts = [f"loss {m['loss/main']:.4f}"]
    if "loss/mtp" in m:
        parts.append(f"mtp {m['loss/mtp']:.4f}")
    parts.append(f"lr {m['optim/lr']:.2e}")
    parts.append(f"{m['throughput/tokens_per_s']:,.0f} tok/s")
    if "throughput/mfu" in m:
        parts.append(f"MFU {100 * m['throughput/mfu']:.1f}%")
    if "comm/exposed_fraction" in m:
        parts.append(f"comm {100 * m['comm/exposed_fraction']:.0f}%")
    if "pipeline/bubble_fraction" in m:
        parts.append(f"bubble {100 * m['pipeline/bubble_fraction']:.0f}%")
    if "memory/peak_allocated_mb" in m:
        parts.append(f"mem {m['memory/peak_allocated_mb'] / 1024:.1f} GiB")
    elif "memory/rss_mb" in m:
        parts.append(f"rss {m['memory/rss_mb']:,.0f} MB")
    if evaluation:
        parts.append(evaluation)
    return "  ".join(parts)
