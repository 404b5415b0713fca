"""One check's verdict: ok / warn / fail, what was seen, and the fix for anything not ok."""

from dataclasses import asdict, dataclass
from typing import Any, Literal

Status = Literal["ok", "warn", "fail"]
SECTIONS = ("versions", "gpus", "topology", "infiniband", "nccl env", "system")


@dataclass(frozen=True)
class Check:
    """`section` groups the output; `fix` is empty for ok checks."""

    section: str
    name: str
    status: Status
    detail: str
    fix: str = ""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def ok(section: str, name: str, detail: str) -> Check:
    return Check(section, name, "ok", detail)


def warn(section: str, name: str, detail: str, fix: str) -> Check:
    return Check(section, name, "warn", detail, fix)


def fail(section: str, name: str, detail: str, fix: str) -> Check:
    return Check(section, name, "fail", detail, fix)


def summarize(checks: list[Check]) -> dict[str, int]:
    counts = {"ok": 0, "warn": 0, "fail": 0}
    for check in checks:
        counts[check.status] += 1
    return counts
