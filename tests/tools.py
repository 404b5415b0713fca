"""System programs some tests drive (Prometheus, Chromium). `scripts/install-test-deps.sh`
installs them; a missing one fails the test with that advice, unless
DSTRAIN_ALLOW_MISSING_TOOLS=1 (a laptop without root), where it skips."""

import os
import shutil

import pytest


def require_tool(name: str) -> str:
    path = shutil.which(name)
    if path is not None:
        return path
    advice = f"`{name}` is not installed: run scripts/install-test-deps.sh"
    if os.environ.get("DSTRAIN_ALLOW_MISSING_TOOLS") == "1":
        pytest.skip(advice)
    pytest.fail(advice)
