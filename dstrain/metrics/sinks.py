"""Where metrics go: JSONL (one object per logged step) and TensorBoard."""

import json
from pathlib import Path
from typing import Protocol


class Sink(Protocol):
    def write(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    """runs/<name>/metrics.jsonl; appends, so a resumed run continues the same file."""

    def __init__(self, path: Path) -> None:
        self.handle = path.open("a", encoding="utf-8")

    def write(self, step: int, metrics: dict[str, float]) -> None:
        self.handle.write(json.dumps({"step": step, **metrics}) + "\n")
        self.handle.flush()

    def close(self) -> None:
        self.handle.close()


class TensorBoardSink:
    def __init__(self, folder: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: only when used

        self.writer = SummaryWriter(log_dir=str(folder))

    def write(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        self.writer.flush()
        self.writer.close()
