"""Shared test helpers: the repository paths and an in-process CLI runner."""

import io
import json
import os
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path

import pytest

from dstrain.cli import main

# The suite installs DeepSpeed and megatron-core (the engines' own verdicts are judged in
# test_deepspeed_differential.py and test_megatron_verdict.py, which switch them on); every
# other test judges by dstrain's offline rules alone, as a user without the engines gets.
os.environ.setdefault("DSTRAIN_DEEPSPEED_ENGINE", "0")
os.environ.setdefault("DSTRAIN_MEGATRON_ENGINE", "0")

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"


@dataclass
class CliResult:
    code: int
    out: str
    err: str

    @property
    def text(self) -> str:
        return self.out + self.err

    def json(self):
        return json.loads(self.out)


def run_cli(*args: str) -> CliResult:
    """Run `dstrain ARGS` in this process; argparse's own exits are caught as codes."""
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            code = main([str(a) for a in args])
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
    return CliResult(code, out.getvalue(), err.getvalue())


@pytest.fixture
def cli():
    return run_cli


@pytest.fixture
def shared() -> Path:
    if not SHARED.exists():
        pytest.skip(f"{SHARED} (the shared examples and fixtures) is not beside the repository")
    return SHARED
