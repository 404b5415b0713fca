"""The prepared GPU check's plumbing, on CPU (`--smoke`): every step runs and reports, so that the
script a lent GPU machine runs works the first time; and no kernel row passes where its kernel
did not run (`tests/unit/test_gpu_check_rows.py` fails a row that compares a path with itself)."""

import json
import re
import subprocess
import sys

import pytest
import torch

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
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    rows = {row["check"]: row for row in report["rows"]}

    # The header: what the numbers were measured on ("none" for what this machine lacks).
    facts = report["platform"]
    assert facts["cuda"] == (torch.version.cuda or "none")
    if not torch.cuda.is_available():
        assert facts["gpu"] == "none"
    header = f"CUDA {facts['cuda']}, GPU {facts['gpu']} (capability {facts['capability']}), "
    assert header + f"driver {facts['driver']}" in table

    checks = ("doctor", "1-GPU proxy", "fp8 run trains (emulated)", "document-masked run trains")
    for check in (*checks, "dp2_zero1 vs one GPU", "pp2_1f1b vs one GPU"):
        assert check in table, table
    assert [r for r in rows.values() if r["verdict"] == "FAIL"] == []
    assert "0 FAIL" in table

    # No kernel runs on a CPU: every kernel row skips, with its reason, and says so at the end.
    kernel_rows = [row for row in rows.values() if row["kernel"]]
    kinds = {row["kernel"] for row in kernel_rows}
    assert kinds == {
        "cuBLASLt blockwise FP8 scaled_mm",
        "grouped_mm (CUDA)",
        "FlexAttention",
        "SDPA causal_lower_right",
    }
    for row in kernel_rows:
        assert row["verdict"] == "skip" and row["detail"].startswith("cpu"), row
        assert re.search(rf"{re.escape(row['check'])} +skip  {re.escape(row['detail'])}", table)
    skipped = table.split("skip (did not run here, proved nothing): ")[1].splitlines()[0]
    assert all(row["check"] in skipped for row in kernel_rows)
    for check in ("fp8_matmul fwd+bwd", "fp8_grouped_matmul fwd+bwd", "grouped_mm bf16 fwd+bwd"):
        assert any(name.startswith(check) for name in rows), check
