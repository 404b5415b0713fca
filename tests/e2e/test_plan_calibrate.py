"""`dstrain plan --calibrate` on runs trained here: the constants come back inside their bounds
and predict the step times better than the defaults do, the counted model states match the
planner's to 3%, and a directory that is not a finished run is one clear error."""

import math
import os
import subprocess
import sys

import pytest

from dstrain.planner.calibrate import BOUNDS
from tests.conftest import run_cli
from tests.distributed.harness import REPO

pytestmark = pytest.mark.slow

LAYOUTS = {
    "one": (1, []),
    "fsdp": (2, ["parallel.dp_shard=2", "parallel.zero_stage=2"]),
    "tp2": (2, ["parallel.tp=2"]),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("calibrate")
    for name, (nproc, sets) in LAYOUTS.items():
        overrides = [
            f"run.root={root}",
            f"run.name={name}",
            "train.steps=8",
            "train.seq_len=64",
            "train.micro_batch_size=4",
            "metrics.log_interval=2",
            "checkpoint.enable=false",
            *sets,
        ]
        command = [sys.executable, "-m", "dstrain", "train", "--nproc", str(nproc)]
        command += [a for o in overrides for a in ("--set", o)]
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        done = subprocess.run(
            command, capture_output=True, text=True, env=env, cwd=REPO, timeout=300
        )
        assert done.returncode == 0, done.stderr[-3000:]
    return [root / name for name in LAYOUTS]


def test_calibration_fits_the_runs_and_counts_their_model_states(runs):
    result = run_cli("plan", "--calibrate", *runs, "--json")
    assert result.code == 0, result.text
    answer = result.json()
    for name, (low, high) in BOUNDS.items():
        assert low <= answer["constants"][name] <= high, name
    rows = {row["run"]: row for row in answer["runs"]}
    assert set(rows) == set(LAYOUTS)
    for row in rows.values():
        # Measured: +1.2 % on tp2, under 0.01 % on the others; bound 3 %.
        assert abs(row["states_error"]) < 0.03, row
        assert row["step_calibrated_s"] > 0 and row["step_measured_s"] > 0
    # The fit lowers the step-time error, summed |log(predicted / measured)| over the runs:
    # measured 0.41x and 0.52x the default constants' (3.8 against 9.3 and 7.3, on a loaded
    # 2-core CPU); bound 0.8x. Constants returned unchanged give exactly the default's error.
    calibrated, default = (
        sum(abs(math.log(row[key] / row["step_measured_s"])) for row in rows.values())
        for key in ("step_calibrated_s", "step_default_s")
    )
    assert calibrated < 0.8 * default, (calibrated, default)
    # tensor parallelism halves the split weights: fewer states than one rank holding all
    assert rows["tp2"]["states_measured_gib"] < rows["one"]["states_measured_gib"]


def test_a_directory_that_is_not_a_run_is_one_error(tmp_path):
    result = run_cli("plan", "--calibrate", tmp_path)
    assert result.code != 0 and "summary.json" in result.err
    assert "Traceback" not in result.text
