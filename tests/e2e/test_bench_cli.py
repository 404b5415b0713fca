"""`dstrain bench comm` as a user runs it: --nproc starts the workers through torchrun's elastic
agent, the CLI prints the workers' report (a table, or only JSON with --json) and its exit code
says pass or fail."""

import json
import os
import subprocess
import sys

import pytest

from tests.distributed.harness import REPO

pytestmark = pytest.mark.slow

COMMAND = ["-m", "dstrain", "bench"]
QUICK = ["--sizes", "1K:16K", "--step-factor", "4", "--iters", "2", "--warmup", "1"]


def _bench(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, *COMMAND, *args],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
        cwd=REPO,
    )


def test_json_is_the_only_thing_on_stdout():
    done = _bench("comm", "--nproc", "2", "--ops", "all_reduce,all_to_all", *QUICK, "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert list(report["ops"]) == ["all_reduce", "all_to_all"]
    assert report["world_size"] == 2 and report["passed"]
    rows = report["ops"]["all_reduce"]
    assert [row["bytes"] for row in rows] == [1024, 4096, 16384]
    assert all(row["wrong"] == 0 and len(row["rank_time_us"]) == 2 for row in rows)
    assert len(report["gemm"]["tflops"]) == 2


def test_axis_table_and_min_busbw_failure():
    done = _bench(
        "comm", "--nproc", "2", "--axis", "tp", "--set", "parallel.tp=2", "--ops",
        "all_reduce", *QUICK, "--no-gemm", "--min-busbw", "1000",
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert "axis tp of tp2 = 2 ranks" in done.stdout
    assert "#       size         count      type   redop    root" in done.stdout
    assert "# Avg bus bandwidth" in done.stdout and "# Result: FAIL" in done.stdout
    assert "dstrain bench: FAIL: all_reduce: busbw" in done.stderr and "fix:" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_bad_flag_starts_nothing():
    done = _bench("comm", "--ops", "all_reduce,allgather")
    assert done.returncode == 2
    assert "unknown op `allgather` (did you mean `all_gather`?)" in done.stderr
    assert "Traceback" not in done.stderr and done.stdout == ""
