"""What the user watches: one logger with a fixed prefix, and a live progress bar.

The bar (step, loss, lr, tokens/s, MFU, ETA) draws only on a terminal; every log interval also
prints one plain line, so CI logs and `tee`d files show the run too.
"""

import contextlib
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

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


_LINE_EVERY_S = 30.0
_active: "TrainProgress | None" = None  # the bar on screen, which a wait shows itself in


@contextmanager
def waiting(what: str, written: Callable[[], int] | None = None, show: bool = True) -> Iterator:
    """A long wait the user would otherwise stare at (a checkpoint save or load): the elapsed
    time, and the bytes `written()` so far, live in the training bar (or a status line of its
    own before the bar exists) on a terminal, a plain line every 30 s in a log, and one closing
    line with the time and the rate."""
    if not show:
        yield
        return
    started = time.perf_counter()
    done = threading.Event()
    bar = _active if _active is not None and not _active.progress.disable else None
    status = None if bar or not _console.is_terminal else _console.status(what)

    def text() -> str:
        size = f", {_size(written())}" if written else ""
        return f"{what}: {time.perf_counter() - started:,.1f} s{size}"

    def watch() -> None:
        last_line = started
        while not done.wait(0.5):
            if bar is not None:
                bar.progress.update(bar.task, stats=text())
            elif status is not None:
                status.update(text())
            elif time.perf_counter() - last_line >= _LINE_EVERY_S:
                last_line = time.perf_counter()
                log(f"{text()} so far")

    if status is not None:
        status.start()
    thread = threading.Thread(target=watch, name="dstrain-waiting", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        if status is not None:
            status.stop()
        seconds = time.perf_counter() - started
        rate = f" ({written() / 2**20 / max(seconds, 1e-9):,.0f} MiB/s)" if written else ""
        log(f"{text()}{rate}, done")


def _size(num_bytes: int) -> str:
    if num_bytes >= 2**30:
        return f"{num_bytes / 2**30:,.2f} GiB"
    return f"{num_bytes / 2**20:,.1f} MiB"


def bytes_under(folder: Path, *names: str) -> Callable[[], int]:
    """What `waiting` shows of a save: the size of the files in `folder`'s entries `names` (a
    save's temporary folder fills up as it writes, then is renamed to its final name)."""

    def total() -> int:
        size = 0
        for name in names:
            for path in (folder / name).rglob("*"):
                with contextlib.suppress(OSError):  # renamed while we looked
                    size += path.stat().st_size if path.is_file() else 0
        return size

    return total


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
        global _active
        self.progress.start()
        _active = self
        return self

    def __exit__(self, *exc: object) -> None:
        global _active
        _active = None
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
