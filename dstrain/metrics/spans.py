"""Timed spans summed per label, on the device's own clock.

On a CPU the host runs the work it times, so wall time (`perf_counter`) is the truth. On a GPU the
host only queues kernels: a span is a pair of CUDA events on the current stream, resolved when the
figures are taken (one synchronize per logging window, not one per span).
"""

import time
from collections import defaultdict

import torch


class Spans:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.totals: dict[str, float] = defaultdict(float)
        self._pending: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []

    def start(self) -> object:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def stop(self, label: str, started: object) -> None:
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._pending.append((label, started, end))  # type: ignore[arg-type]
        else:
            self.totals[label] += time.perf_counter() - started  # type: ignore[operator]

    def add(self, label: str, seconds: float) -> None:
        self.totals[label] += seconds

    def take(self) -> dict[str, float]:
        """Seconds per label since the last take; resets."""
        if self._pending:
            torch.cuda.synchronize()
            for label, start, end in self._pending:
                self.totals[label] += start.elapsed_time(end) / 1000
            self._pending.clear()
        taken = dict(self.totals)
        self.totals.clear()
        return taken
