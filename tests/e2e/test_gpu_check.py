"""The prepared GPU check's plumbing, on CPU (`--smoke`): every step runs and reports, so that the
script a lent GPU machine runs works the first time."""

import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.slow


def test_the_gpu_check_runs_its_steps_on_cpu(tmp_path):
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--smoke", "--out", tmp_path],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    table = done.stdout.split("=" * 100)[-1]
    checks = ("doctor", "1-GPU proxy", "document mask kernels", "document-masked run trains")
    for check in (*checks, "dp2_zero1 vs one GPU", "pp2_1f1b vs one GPU"):
        assert check in table, table
    assert "FAIL" not in table
