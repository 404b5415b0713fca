"""Saving and finding checkpoints in runs/<name>/checkpoints/.

Each checkpoint is a torch.distributed.checkpoint (DCP) folder `step-N`, written to a temporary
folder first and renamed into place, after which the `latest` pointer moves. A crash mid-save
therefore never leaves a `step-N` that looks complete; the integrity manifest and async saves
arrive with the fault-tolerance issue.
"""

import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from dstrain.errors import UserError

_STEP = re.compile(r"step-(\d+)$")


def save(
    folder: Path, step: int, state: dict[str, Any], keep_last_k: int = 0, is_main: bool = True
) -> Path:
    """Write `state` as folder/step-{step}, point `latest` at it, prune old ones. Collective when
    a process group exists: every rank writes its shards, then rank 0 publishes."""
    final = folder / f"step-{step}"
    tmp = folder / f".step-{step}.tmp"
    if is_main:
        folder.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
    _barrier()
    with warnings.catch_warnings():  # single-process DCP warns that it assumes no process group
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, checkpoint_id=str(tmp))
    _barrier()  # every rank's shards are on disk before the folder is published
    if is_main:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        _write_pointer(folder, final.name)
        if keep_last_k:
            for old in checkpoints(folder)[:-keep_last_k]:
                shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def load(path: Path, state: dict[str, Any]) -> None:
    """Fill `state` (tensors in place, other values replaced) from the checkpoint at `path`."""
    if not (path / ".metadata").exists():
        raise UserError(
            f"{path} is not a dstrain checkpoint (no .metadata)",
            "pass a runs/<name>/checkpoints/step-N folder",
            exit_code=1,
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=str(path))


def checkpoints(folder: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    if not folder.exists():
        return []
    found = [p for p in folder.iterdir() if p.is_dir() and _STEP.match(p.name)]
    return sorted(found, key=step_of)


def latest(folder: Path) -> Path | None:
    pointer = folder / "latest"
    if pointer.exists():
        target = folder / pointer.read_text().strip()
        if (target / ".metadata").exists():
            return target
    complete = [p for p in checkpoints(folder) if (p / ".metadata").exists()]
    return complete[-1] if complete else None


def step_of(path: Path) -> int:
    match = _STEP.search(path.name)
    return int(match.group(1)) if match else -1


def _write_pointer(folder: Path, name: str) -> None:
    tmp = folder / ".latest.tmp"
    tmp.write_text(name + "\n")
    os.replace(tmp, folder / "latest")
