"""Where metrics go: JSONL (one object per logged step) and TensorBoard. (The Prometheus exporter
and W&B live in files of their own.) A metric value is a float, or a list of floats for
per-expert token counts."""

import json
from pathlib import Path
from typing import Protocol

Metrics = dict[str, float | list[float]]


class Sink(Protocol):
    def write(self, step: int, metrics: Metrics) -> None: ...

    def rewind(self, step: int) -> None:
        """Forget what was logged after `step` (a rollback recomputes those steps)."""

    def close(self) -> None: ...


class JsonlSink:
    """runs/<name>/metrics.jsonl; appends, so a resumed run continues the same file (from the
    checkpoint's step: the lines after it are dropped first)."""

    def __init__(self, path: Path, after_step: int = 0) -> None:
        self.path = path
        _truncate_after(path, after_step)
        self.handle = path.open("a", encoding="utf-8")

    def rewind(self, step: int) -> None:
        self.handle.close()
        _truncate_after(self.path, step)
        self.handle = self.path.open("a", encoding="utf-8")

    def write(self, step: int, metrics: Metrics) -> None:
        self.handle.write(json.dumps({"step": step, **metrics}) + "\n")
        self.handle.flush()

    def close(self) -> None:
        self.handle.close()


class TensorBoardSink:
    def __init__(self, folder: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: only when used

        self.writer = SummaryWriter(log_dir=str(folder))

    def write(self, step: int, metrics: Metrics) -> None:
        for key, value in metrics.items():
            if isinstance(value, list):  # per-expert counts: the report draws them as a heatmap
                continue
            self.writer.add_scalar(key, value, step)

    def rewind(self, step: int) -> None:
        """Events cannot be unwritten; TensorBoard shows the recomputed steps over the old."""

    def close(self) -> None:
        self.writer.flush()
        self.writer.close()


def _truncate_after(path: Path, step: int) -> None:
    """Drop the logged steps after `step`."""
    if not path.exists():
        return
    kept = [line for line in path.read_text().splitlines() if json.loads(line)["step"] <= step]
    path.write_text("".join(line + "\n" for line in kept))
