"""A user's clone has no `../shared` beside it: the unit tier, run in a copy of this checkout with
nothing beside it, passes, and the tests that read shared files skip and say why."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.slow
SKIPPED = {".git", ".venv", "venv", "runs", "build", "dist", "__pycache__", ".pytest_cache"}


def _checkout_files() -> list[Path]:
    """What a clone holds: git's tracked and not-ignored files, or (no git) the tree itself."""
    if (REPO / ".git").exists() and shutil.which("git"):
        listed = subprocess.run(
            ["git", "ls-files", "-co", "--exclude-standard"],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.splitlines()
        return [Path(name) for name in listed if (REPO / name).is_file()]
    return [
        path.relative_to(REPO)
        for path in REPO.rglob("*")
        if path.is_file() and not SKIPPED & set(path.relative_to(REPO).parts)
    ]


def test_the_unit_tier_passes_without_shared(tmp_path):
    if not (REPO.parent / "shared").exists():
        # A clone like a user's already (CI's): the whole suite running here is this check.
        pytest.skip(f"{REPO.parent / 'shared'} is absent: this run is itself the fresh clone")
    clone = tmp_path / "clone"
    for rel in _checkout_files():
        target = clone / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / rel, target)
    assert not (clone.parent / "shared").exists()
    env = {**os.environ, "PYTHONPATH": str(clone)}
    env.pop("WANDB_SERVICE", None)  # this process's wandb service, if a test here started one
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs", "tests/unit"],
        cwd=clone,
        capture_output=True,
        text=True,
        env=env,
        timeout=1800,
    )
    # Failures first: the skip reasons that follow them would push them out of a plain tail.
    failures = [line for line in done.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]
    tail = "\n".join(failures) + "\n" + done.stdout[-4000:] + done.stderr[-2000:]
    assert done.returncode == 0, tail
    assert " error" not in done.stdout.splitlines()[-1], tail
    # The shared-file tests skip, naming the folder that is missing.
    assert "is not beside the repository" in done.stdout, tail
    # The clone's own package ran, not this checkout's.
    where = subprocess.run(
        [sys.executable, "-c", "import dstrain; print(dstrain.__file__)"],
        cwd=clone,
        capture_output=True,
        text=True,
        env=env,
    ).stdout.strip()
    assert Path(where).is_relative_to(clone), where
