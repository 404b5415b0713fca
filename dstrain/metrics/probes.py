"""What one training step reports while it runs: time per phase (data, forward, backward,
optimizer, checkpoint) and, through the communication timer, the collectives it blocked on.
`NO_PROBES` reports nothing (metrics.timers = false)."""

import contextlib
from collections.abc import Iterator

import torch

from dstrain.metrics.comm_timer import CommTimer
from dstrain.metrics.spans import Spans

PHASES = ("data", "forward", "backward", "optimizer", "checkpoint")


class Probes:
    def __init__(self, device: torch.device, comm: CommTimer | None = None) -> None:
        self.spans = Spans(device)
        self.comm = comm

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        started = self.spans.start()
        try:
            yield
        finally:
            self.spans.stop(name, started)
            if name == "backward" and self.comm is not None:
                self.comm.backward_done()

    def quiet(self) -> contextlib.AbstractContextManager:
        """Collectives that are not training communication (checkpoint, metrics)."""
        return self.comm.pause() if self.comm is not None else contextlib.nullcontext()


class _NoProbes(Probes):
    def __init__(self) -> None:
        super().__init__(torch.device("cpu"))

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        yield


NO_PROBES = _NoProbes()
