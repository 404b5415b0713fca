"""Preemption: SIGTERM (a scheduler reclaiming the nodes; torchrun forwards it to every worker)
asks the run to save a final checkpoint and exit cleanly, within `checkpoint.preemption_deadline_s`.

The signal lands on each rank at its own moment, so the ranks agree at step boundaries: the
step's one agreement all-reduce (`train/agreement.py`, with the fp16 overflow flag) tells every
rank whether any rank was signalled, and all stop after the same step. With torchrun, the agent
waits TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds before SIGKILL; `dstrain train --nproc` sets it from
the deadline (set it yourself under a bare torchrun).

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


class Preemption:
    def __init__(self, deadline_s: float) -> None:
        self.deadline_s = deadline_s
        self.signalled_at: float | None = None
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum: int, frame: object) -> None:
        if self.signalled_at is None:
            self.signalled_at = time.monotonic()
            watchdog = threading.Timer(self.deadline_s, _exit_now)
            watchdog.daemon = True
            watchdog.start()

    @property
    def signalled(self) -> bool:
        """This rank got SIGTERM (the step's agreement tells whether any rank did)."""
        return self.signalled_at is not None

    def agreed(self, any_rank: bool) -> bool:
        """The step's verdict: True once any rank got SIGTERM (its deadline then runs here too)."""
        if any_rank and self.signalled_at is None:  # another rank's signal
            self.signalled_at = time.monotonic()
        return any_rank

    def seconds_left(self) -> float:
        if self.signalled_at is None:
            return self.deadline_s
        return self.deadline_s - (time.monotonic() - self.signalled_at)


def _exit_now() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(128 + signal.SIGTERM)
