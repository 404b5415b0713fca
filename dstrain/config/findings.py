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

    def as_dict(self) -> dict[str, str]:
        return asdict(self)


def error(key: str, message: str, fix: str = "") -> Finding:
    return Finding("error", key, message, fix)


def warning(key: str, message: str, fix: str = "") -> Finding:
    return Finding("warning", key, message, fix)


def info(key: str, message: str, fix: str = "") -> Finding:
    return Finding("info", key, message, fix)


def has_errors(findings: list[Finding]) -> bool:
    return any(f.severity == "error" for f in findings)
