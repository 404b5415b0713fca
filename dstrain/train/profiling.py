"""`--profile-steps A:B`: a torch.profiler trace of steps A..B (1-based, inclusive), one Chrome
trace per rank in runs/<name>/profile/rank<R>.trace.json (open in https://ui.perfetto.dev or
chrome://tracing). Only those steps pay the profiler's overhead."""

from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile


def parse_steps(spec: str) -> tuple[int, int]:
    first, last = (int(part) for part in spec.split(":"))
    return first, last


class StepProfiler:
    def __init__(self, spec: str | None, folder: Path, rank: int, device: torch.device) -> None:
        self.steps = parse_steps(spec) if spec else None
        self.path = folder / f"rank{rank}.trace.json"
        self.activities = [ProfilerActivity.CPU]
        if device.type == "cuda":
            self.activities.append(ProfilerActivity.CUDA)
        self._profile: profile | None = None

    def before(self, step: int) -> None:
        """`step` is the 1-based number of the step about to run."""
        if self.steps is not None and step == self.steps[0] and self._profile is None:
            self._profile = profile(activities=self.activities, record_shapes=True)
            self._profile.start()

    def after(self, step: int) -> Path | None:
        """Ends the trace after the last profiled step (or a run that stops inside the range);
        returns the trace's path when it was written."""
        if self._profile is None or (self.steps is not None and step < self.steps[1]):
            return None
        return self.finish()

    def finish(self) -> Path | None:
        if self._profile is None:
            return None
        self._profile.stop()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._profile.export_chrome_trace(str(self.path))
        self._profile = None
        return self.path
