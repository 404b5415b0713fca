"""Pipeline parallelism as a user meets it: `dstrain train --nproc 2` with pp=2 logs the measured
bubble beside the theory, resumes exactly from a checkpoint, feeds `dstrain schedule --from-run`,
and a stuck pipeline rank ends in one clear timeout error instead of a hang."""

import json
import os
import time

import pytest

from tests.e2e.test_train_parallel_cli import (  # noqa: F401 (common: a fixture)
    _metrics,
    _run,
    common,
    run_root,
)

pytestmark = pytest.mark.slow

ZBV = [
    "parallel.pp=2",
    "parallel.pp_schedule=zbv",
    "parallel.num_virtual_stages=2",
    "train.global_batch_size=16",  # 4 micro-batches of 4
]


def _sets(*overrides: str) -> list[str]:
    return [arg for o in overrides for arg in ("--set", o)]


def _train(common: list[str], name: str, steps: int, *extra: str):  # noqa: F811
    return _run(
        "-m",
        "dstrain",
        "train",
        "--nproc",
        "2",
        *common,
        *_sets(f"run.name={name}", f"train.steps={steps}", "checkpoint.interval=2", *ZBV, *extra),
    )


def test_pipeline_run_logs_bubble_and_resumes_exactly(common):  # noqa: F811
    whole = _train(common, "pp_whole", 6)
    assert whole.returncode == 0, whole.stderr
    assert "pp2 = 2 ranks" in whole.stderr
    rows = _metrics(common, "pp_whole")
    for key in (
        "pipeline/bubble_fraction",
        "pipeline/bubble_fraction_theory",
        "pipeline/time_f_ms",
        "pipeline/time_i_ms",
        "pipeline/time_w_ms",
        "loss/mtp",
    ):
        assert all(key in row for row in rows), key
    assert all(0 <= row["pipeline/bubble_fraction"] < 1 for row in rows)
    # ZB1P with the measured F, B, W: a few percent for 4 micro-batches on 2 ranks.
    assert all(0 <= row["pipeline/bubble_fraction_theory"] < 0.2 for row in rows)
    run_dir = run_root(common)
    summary = json.loads((run_dir / "pp_whole" / "summary.json").read_text())
    assert 0 <= summary["pipeline_bubble_fraction"] < 1

    first = _train(common, "pp_resumed", 4)
    assert first.returncode == 0, first.stderr
    second = _train(common, "pp_resumed", 6)
    assert second.returncode == 0, second.stderr
    assert "resumed from" in second.stderr
    losses = [r["loss/main"] for r in _metrics(common, "pp_resumed")]
    assert losses == [r["loss/main"] for r in rows]  # bit-identical: same order of every sum

    drawn = run_dir / "pp_whole" / "schedule.png"
    schedule = _run(
        "-m", "dstrain", "schedule", "--from-run", str(run_dir / "pp_whole"), "--png", str(drawn)
    )
    assert schedule.returncode == 0, schedule.stderr
    assert "zbv: pp 2, 4 micro-batches" in schedule.stdout and "(ms)" in schedule.stdout
    assert drawn.read_bytes().startswith(b"\x89PNG")


def test_a_stuck_pipeline_rank_ends_in_a_clear_timeout(common):  # noqa: F811
    os.environ["DSTRAIN_INJECT_FAULT"] = "hang:rank=1:step=2"
    try:
        started = time.monotonic()
        done = _train(common, "pp_hang", 4, "comm.timeout_s=5", "checkpoint.enable=false")
        took = time.monotonic() - started
    finally:
        del os.environ["DSTRAIN_INJECT_FAULT"]
    assert done.returncode == 1
    assert "pipeline stuck: pp rank 0" in done.stderr and "pp ranks [1]" in done.stderr
    assert "comm.timeout_s" in done.stderr
    assert "Traceback" not in done.stderr
    assert took < 60, took


def test_a_malformed_fault_variable_is_refused(common):  # noqa: F811
    os.environ["DSTRAIN_INJECT_FAULT"] = "explode:rank=x"
    try:
        done = _run("-m", "dstrain", "train", *common, *_sets("run.name=badfault"))
    finally:
        del os.environ["DSTRAIN_INJECT_FAULT"]
    assert done.returncode == 2
    assert "DSTRAIN_INJECT_FAULT" in done.stderr and "Traceback" not in done.stderr
