"""Preemption: SIGTERM (a scheduler reclaiming the nodes; torchrun forwards it to every worker)
asks the run to save a final checkpoint and exit cleanly, within `checkpoint.preemption_deadline_s`.

The signal lands on each rank at its own moment, so the ranks agree at step boundaries: one tiny
all-reduce (MAX) per step tells every rank whether any rank was signalled, and all stop after the
same step. With torchrun, the agent waits TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds before SIGKILL;
`dstrain train --nproc` sets it from the deadline (set it yourself under a bare torchrun).

The agent also sends SIGTERM to the survivors when a rank fails, and a survivor may be stuck in a
collective that will never return (it waits for the dead rank), where Python's handler cannot
run. So the signal also arms a watchdog thread: a rank still alive `deadline` seconds later exits
(143, as SIGTERM's default would), whatever its main thread is doing. A checkpoint cut short by
it is never published (publishing is atomic).
"""

import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist


class Preemption:
    def __init__(self, deadline_s: float, device: torch.device) -> None:
        self.deadline_s, self.device = deadline_s, device
        self.signalled_at: float | None = None
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum: int, frame: object) -> None:
        if self.signalled_at is None:
            self.signalled_at = time.monotonic()
            watchdog = threading.Timer(self.deadline_s, _exit_now)
            watchdog.daemon = True
            watchdog.start()

    def requested(self) -> bool:
        """Collective: True on every rank once any rank got SIGTERM."""
        flag = torch.tensor(int(self.signalled_at is not None), device=self.device)
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() and self.signalled_at is None:  # another rank's signal
            self.signalled_at = time.monotonic()
        return bool(flag.item())  # host sync: the loop must know whether to go on

    def seconds_left(self) -> float:
        if self.signalled_at is None:
            return self.deadline_s
        return self.deadline_s - (time.monotonic() - self.signalled_at)


def _exit_now() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(128 + signal.SIGTERM)
