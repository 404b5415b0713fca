"""Fault injection for tests and drills, from `DSTRAIN_INJECT_FAULT=KIND:rank=R:step=S`, at the
start of step S on rank R:

- `hang`: the rank stops responding (the others must fail within comm.timeout_s, naming it);
- `kill`: the rank dies by SIGKILL (torchrun restarts the group with --max-restarts; the run
  resumes from its newest checkpoint);
- `nan`: the rank's forward produces NaN for that step (the numerics guard must act);
- `diskfull`: from then on the rank cannot write files past 64 KiB (RLIMIT_FSIZE; writes fail
  with EFBIG as on a full disk), so its next checkpoint save fails;
- `oom`: the rank's step raises `torch.OutOfMemoryError`, as a device allocation that fails
  (the trainer's advice must follow: `train/oom.py`).

Each fires in the first attempt only (TORCHELASTIC_RESTART_COUNT 0), so a restarted group gets
past it. Read once at start-up; a malformed value is refused like any other bad input.
"""

import contextlib
import os
import resource
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from dstrain.errors import UserError
from dstrain.model.transformer import TransformerBlock

ENV = "DSTRAIN_INJECT_FAULT"
KINDS = ("hang", "kill", "nan", "diskfull", "oom")
FULL_DISK_BYTES = 64 * 1024


@dataclass
class Fault:
    kind: str
    rank: int
    step: int
    fired: bool = False  # once: a rollback that repeats the step does not repeat the fault

    def fires(self, rank: int, step: int) -> bool:
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") in ("", "0")
        now = rank == self.rank and step == self.step and first_attempt and not self.fired
        self.fired |= now
        return now

    def maybe_fire(self, rank: int, step: int) -> None:
        """Called at the start of every step (1-based); `nan` is the trainer's to apply."""
        if self.kind == "nan" or not self.fires(rank, step):
            return
        if self.kind == "oom":
            raise torch.OutOfMemoryError(
                f"out of memory injected by {ENV} at step {step} on rank {rank}"
            )
        if self.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.kind == "diskfull":
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # an error from write(), not a signal
            _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
            resource.setrlimit(resource.RLIMIT_FSIZE, (FULL_DISK_BYTES, hard))
        while self.kind == "hang":  # a rank that stopped responding: only the timeout ends it
            time.sleep(60)


def fault_from_env() -> Fault | None:
    text = os.environ.get(ENV, "").strip()
    if not text:
        return None
    kind, *fields = text.split(":")
    try:
        values = dict(field.split("=", 1) for field in fields)
        fault = Fault(kind, int(values.pop("rank")), int(values.pop("step")))
    except (ValueError, KeyError):
        fault, values = None, {}
    if fault is None or kind not in KINDS or values:
        raise UserError(
            f"{ENV}={text!r} is not a fault this build can inject",
            f"use {ENV}=KIND:rank=R:step=S with KIND one of {', '.join(KINDS)} (or unset it)",
            exit_code=2,
        )
    return fault


@contextlib.contextmanager
def poisoned_forward(model: nn.Module) -> Iterator[None]:
    """The `nan` fault: the first block this rank runs returns NaN while the context is open."""
    block = next(m for m in model.modules() if isinstance(m, TransformerBlock))
    handle = block.register_forward_hook(lambda module, args, out: out * float("nan"))
    try:
        yield
    finally:
        handle.remove()
