"""Multi-process training as a user launches it: `dstrain train --nproc N` (torchrun's elastic
agent inside dstrain) and `torchrun -m dstrain.train` (what a multi-node job runs)."""

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.distributed.harness import REPO, free_port

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def common(tmp_path_factory) -> list[str]:
    root = tmp_path_factory.mktemp("cli")
    corpus = root / "corpus"
    corpus.mkdir()
    for source in sorted((Path(sysconfig.get_paths()["stdlib"]) / "json").glob("*.py")):
        (corpus / f"{source.stem}.txt").write_text(source.read_text())
    overrides = [
        f"data.source={corpus}",
        f"data.cache_dir={root / 'cache'}",
        f"run.root={root / 'runs'}",
        "train.steps=4",
        "train.seq_len=32",
        "train.micro_batch_size=4",
        "metrics.log_interval=1",
    ]
    return [arg for o in overrides for arg in ("--set", o)]


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=300, env=env, cwd=REPO
    )


def run_root(common: list[str]) -> Path:
    """The runs folder the `common` overrides point at."""
    return Path(next(a for a in common if a.startswith("run.root=")).split("=", 1)[1])


def _metrics(common: list[str], name: str) -> list[dict]:
    lines = (run_root(common) / name / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def test_nproc_launches_workers_through_the_elastic_agent(common):
    done = _run(
        "-m",
        "dstrain",
        "train",
        "--nproc",
        "2",
        *common,
        "--set",
        "run.name=nproc",
        "--set",
        "parallel.ep=2",
        "--set",
        "parallel.zero_stage=2",
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("done: 4 steps") == 1
    rows = _metrics(common, "nproc")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert "dp_shard2 = 2 ranks, ep2" in done.stderr


def test_json_under_nproc_is_rank_zeros_summary_alone(common):
    """`--json` with `--nproc 2`: stdout holds one JSON document, rank 0's summary (the other
    rank and the launcher write to stderr), with the run's own step count and final loss."""
    done = _run(
        "-m", "dstrain", "train", "--nproc", "2", *common, "--set", "run.name=nproc_json",
        "--set", "parallel.dp_shard=2", "--json",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)  # the whole of stdout: nothing else printed there
    rows = _metrics(common, "nproc_json")
    assert summary["steps"] == 4 == rows[-1]["step"]
    assert summary["final_loss"] == pytest.approx(rows[-1]["loss/main"], rel=1e-6)
    assert Path(summary["run_dir"]) == run_root(common) / "nproc_json"


def test_torchrun_module_entry_point(common):
    done = _run(
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        "-m",
        "dstrain.train",
        *common,
        "--set",
        "run.name=torchrun",
        "--set",
        "parallel.zero_stage=3",
    )
    assert done.returncode == 0, done.stderr
    assert len(_metrics(common, "torchrun")) == 4


def test_a_layout_that_does_not_fit_fails_before_any_process(common):
    done = _run("-m", "dstrain", "train", "--nproc", "2", *common, "--set", "parallel.tp=4")
    assert done.returncode == 1
    assert "does not divide" in done.stderr or "world size" in done.stderr
    assert "torch.distributed" not in done.stderr and "Traceback" not in done.stderr


def test_a_failing_worker_takes_the_job_down_with_its_rank(common):
    done = _run(
        "-m", "dstrain", "train", "--nproc", "2", *common, "--set", "run.name=fail",
        env={"DSTRAIN_INJECT_FAULT": "kill:rank=1:step=2"},
    )  # fmt: skip
    assert done.returncode == 1
    assert "rank 1 failed" in done.stderr, done.stderr


def test_zero1_checkpoints_resume_under_zero2_and_pp2(common, tmp_path):
    """The issue's acceptance run: dp2 ZeRO-1 with checkpoints, cut after step 5, resumes from
    its step-4 checkpoint under dp_shard2 ZeRO-2 and under pp2, and `dstrain loss-compare`
    passes against the uninterrupted run."""
    zero1 = [*common, "--set", "train.steps=8", "--set", "checkpoint.interval=4"]
    zero1 += ["--set", "train.global_batch_size=8"]
    zero1 += ["--set", "parallel.dp_shard=2", "--set", "parallel.zero_stage=1"]
    reference = _run("-m", "dstrain", "train", "--nproc", "2", *zero1, "--set", "run.name=z1")
    assert reference.returncode == 0, reference.stderr
    cut = _run(
        "-m", "dstrain", "train", "--nproc", "2", *zero1, "--set", "run.name=z1_cut",
        env={"DSTRAIN_INJECT_FAULT": "kill:rank=1:step=6"},
    )  # fmt: skip
    assert cut.returncode != 0
    runs = run_root(common)
    assert (runs / "z1_cut" / "checkpoints" / "step-4").is_dir()
    layouts = {
        "z1_to_z2": ["--set", "parallel.zero_stage=2"],
        "z1_to_pp2": ["--set", "parallel.pp=2", "--set", "parallel.dp_shard=1"],
    }
    for name, layout in layouts.items():
        shutil.copytree(runs / "z1_cut", runs / name)
        resumed = _run(
            "-m", "dstrain", "train", "--nproc", "2", *zero1, *layout, "--set", f"run.name={name}"
        )
        assert resumed.returncode == 0, resumed.stderr
        assert "resumed from" in resumed.stderr and "at step 4" in resumed.stderr
        compared = _run("-m", "dstrain", "loss-compare", str(runs / "z1"), str(runs / name))
        assert compared.returncode == 0, compared.stdout + compared.stderr


def test_resume_under_another_layout_reshards(common):
    first = _run(
        "-m",
        "dstrain",
        "train",
        "--nproc",
        "2",
        *common,
        "--set",
        "run.name=layout",
        "--set",
        "parallel.ep=2",
    )
    assert first.returncode == 0, first.stderr
    again = _run(
        "-m", "dstrain", "train", *common, "--set", "run.name=layout", "--set", "train.steps=6"
    )
    assert again.returncode == 0, again.stderr
    assert (
        "resumed from" in again.stderr and "resharded (dp_shard 2 -> 1, ep 2 -> 1)" in again.stderr
    )
    assert [r["step"] for r in _metrics(common, "layout")] == [1, 2, 3, 4, 5, 6]


def test_resume_into_another_architecture_is_refused_clearly(common):
    first = _run("-m", "dstrain", "train", *common, "--set", "run.name=arch")
    assert first.returncode == 0, first.stderr
    again = _run(
        "-m",
        "dstrain",
        "train",
        *common,
        "--set",
        "run.name=arch",
        "--set",
        "train.steps=6",
        "--set",
        "model.num_layers=3",
    )
    assert (
        again.returncode == 1 and "another model architecture (num_layers: 4 -> 3" in again.stderr
    )
    assert "Traceback" not in again.stderr
