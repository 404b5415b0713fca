"""Fault injection for tests and drills: `DSTRAIN_INJECT_FAULT=hang:rank=1:step=2` makes rank 1
stop responding at the start of step 2, to prove that a stuck rank ends in a timeout error that
names it, never in a silent hang.

Read once at start-up; a malformed value is refused like any other bad input.
"""

import os
import time
from dataclasses import dataclass

from dstrain.errors import UserError

ENV = "DSTRAIN_INJECT_FAULT"
KINDS = ("hang",)


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    step: int

    def maybe_fire(self, rank: int, step: int) -> None:
        """Called at the start of every step (1-based)."""
        if rank == self.rank and step == self.step and self.kind == "hang":
            while True:  # a rank that stopped responding: only the timeout ends the job
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
            f"use {ENV}=hang:rank=R:step=S (or unset it)",
            exit_code=2,
        )
    return fault
