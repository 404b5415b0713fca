"""A finding is one thing `check` has to say: its severity, the key it is about, and the fix.

An imported config (DeepSpeed JSON, a Megatron launch script) answers two questions apart:
would its own engine accept it, and can dstrain run it. `error` answers the first (the engine,
or for dstrain's own file dstrain, refuses it); `unsupported` the second (the engine runs it,
dstrain cannot yet).
"""

from dataclasses import asdict, dataclass, replace
from typing import Literal

Severity = Literal["error", "unsupported", "warning", "info"]
SEVERITIES: tuple[Severity, ...] = ("error", "unsupported", "warning", "info")


@dataclass(frozen=True)
class Finding:
    """`error` stops a launch, `unsupported` is what dstrain cannot run of a config its own
    engine accepts, `warning` is worth reading, `info` says what was inferred."""

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

    def as_unsupported(self, engine: str) -> "Finding":
        """This trainer limit, said of a config that `engine` runs."""
        return replace(
            self,
            severity="unsupported",
            message=f"runs under {engine}; dstrain cannot yet: {self.message}",
        )


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


def has_unsupported(findings: list[Finding]) -> bool:
    return any(f.severity == "unsupported" for f in findings)
