"""Finding checkpoints in a run's checkpoints/ folder, and choosing the one to resume from.

    checkpoints/step-N/          full checkpoints (model, optimizer, schedule, data position, RNG)
    checkpoints/model/step-N/    model-only checkpoints, kept and pruned apart
    checkpoints/latest           the newest published full checkpoint (model/latest likewise)
    checkpoints/.step-N.tmp/     a save in progress, or one a crash interrupted

Plain Python (no torch): the trainer, `dstrain ckpt inspect` and `diff` choose alike.
"""

import re
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from dstrain.checkpoint.manifest import HASH_BELOW_BYTES, verify
from dstrain.errors import UserError

Kind = Literal["full", "model"]
KINDS: tuple[Kind, ...] = ("full", "model")
POINTER = "latest"
_STEP = re.compile(r"step-(\d+)$")


def kind_folder(folder: Path, kind: Kind) -> Path:
    """Where checkpoints of `kind` live inside a checkpoints/ folder."""
    return folder if kind == "full" else folder / "model"


def checkpoints(folder: Path, kind: Kind = "full") -> list[Path]:
    """Published step-N folders of `kind`, oldest first, valid or not."""
    where = kind_folder(folder, kind)
    if not where.is_dir():
        return []
    found = [p for p in where.iterdir() if p.is_dir() and _STEP.match(p.name)]
    return sorted(found, key=step_of)


def step_of(path: Path) -> int:
    match = _STEP.search(path.name)
    return int(match.group(1)) if match else -1


def latest_valid(
    folder: Path,
    report: Callable[[str], None] | None = None,
    kind: Kind = "full",
    *,
    hash_below_bytes: int = HASH_BELOW_BYTES,
) -> Path | None:
    """The newest checkpoint of `kind` whose manifest verifies; each newer one that does not is
    reported ("skipping PATH: REASON") and skipped.

    Checkpoints under `hash_below_bytes` are checked by sha256, larger ones by file sizes (see
    `manifest.verify`). The `latest` pointer is not consulted: it is a hint for people and tools,
    and a checkpoint it names may have been damaged since.
    """
    for path in reversed(checkpoints(folder, kind)):
        verdict = verify(path, quick=None, hash_below_bytes=hash_below_bytes)
        if verdict.ok:
            return path
        if report is not None:
            report(f"skipping {path}: {verdict.reason}")
    return None


def locate(path: Path) -> tuple[Path, Path | None]:
    """For a run directory, its checkpoints/ folder or one step-N folder: the checkpoints/
    folder, and the one checkpoint PATH names (None for the first two). Raises UserError
    (exit 2) for anything else."""
    if not path.exists():
        raise UserError(f"{path} does not exist", _WHAT, exit_code=2)
    if path.is_dir() and _STEP.match(path.name):
        root = path.parent.parent if path.parent.name == "model" else path.parent
        return root, path
    if (path / "checkpoints").is_dir() or (path / "config.toml").is_file():
        return path / "checkpoints", None
    holds = [checkpoints(path), checkpoints(path, "model"), (path / POINTER).exists()]
    if path.is_dir() and (path.name == "checkpoints" or any(holds)):
        return path, None
    raise UserError(
        f"{path} is neither a run directory, a checkpoints folder nor a checkpoint",
        _WHAT,
        exit_code=2,
    )


_WHAT = "pass runs/<name>, runs/<name>/checkpoints or runs/<name>/checkpoints/step-N"
