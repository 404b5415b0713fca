"""A finding is one thing `check` has to say: its severity, the key it is about, and the fix."""

from dataclasses import asdict, dataclass
from typing import Literal

Severity = Literal["error", "warning", "info"]


@dataclass(frozen=True)
class Finding:
    """`error` stops a launch, `warning` is worth reading, `info` says what was inferred."""

    severity: Severity
    key: str
    message: str
    fix: str = ""
    # A limit of dstrain's trainer, not of the layout: other engines run it (the planner still
    # estimates such a layout, and says the trainer would refuse it).
    trainer_limit: bool = False

    def as_dict(self) -> dict[str, str]:
        out = asdict(self)
        if not self.trainer_limit:
            del out["trainer_limit"]
        return out


def error(key: str, message: str, fix: str = "") -> Finding:
    return Finding("error", key, message, fix)


def trainer_limit(key: str, message: str, fix: str = "") -> Finding:
    """An error for what dstrain's trainer does not run though the layout is sound."""
    return Finding("error", key, message, fix, trainer_limit=True)


def warning(key: str, message: str, fix: str = "") -> Finding:
    return Finding("warning", key, message, fix)


def info(key: str, message: str, fix: str = "") -> Finding:
    return Finding("info", key, message, fix)


def has_errors(findings: list[Finding]) -> bool:
    return any(f.severity == "error" for f in findings)
