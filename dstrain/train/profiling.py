"""`--profile-steps A:B`: a torch.profiler trace of steps A..B (1-based, inclusive), one Chrome
trace per rank in runs/<name>/profile/rank<R>.trace.json (open in https://ui.perfetto.dev or
chrome://tracing), each step marked `step N`. Only those steps pay the profiler's overhead."""

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function


class StepProfiler:
    def __init__(self, spec: str | None, folder: Path, rank: int, device: torch.device) -> None:
        self.steps = tuple(int(n) for n in spec.split(":")) if spec else None
        self.path = folder / f"rank{rank}.trace.json"
        self.activities = [ProfilerActivity.CPU]
        if device.type == "cuda":
            self.activities.append(ProfilerActivity.CUDA)
        self._profile: profile | None = None
        self.written: Path | None = None  # set when the trace is written

    @contextlib.contextmanager
    def step(self, number: int) -> Iterator[None]:
        """Around step `number` (1-based): starts the trace at A, marks the step, writes the
        trace after B."""
        if self.steps is None or not self.steps[0] <= number <= self.steps[1]:
            yield
            return
        if self._profile is None:
            self._profile = profile(activities=self.activities, record_shapes=True)
            self._profile.start()
        with record_function(f"step {number}"):
            yield
        if number == self.steps[1]:
            self.finish()

    def finish(self) -> None:
        """Writes the trace (also of a run that stopped inside the range)."""
        if self._profile is None:
            return
        self._profile.stop()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._profile.export_chrome_trace(str(self.path))
        self._profile = None
        self.written = self.path
