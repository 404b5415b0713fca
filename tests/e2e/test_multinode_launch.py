"""A real two-node launch on one machine: `dstrain deploy bare` renders launch.sh (the torchrun
command the Slurm script runs too), and two copies of it, one per "node", meet through c10d
rendezvous on 127.0.0.1 and train the debug model to the end. The loss must match a one-node
`dstrain train --nproc 2` of the same config: the two-node launch trained the same thing."""

import json
import os
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

from tests.distributed.harness import REPO, free_port
from tests.e2e.test_deploy_cli import deploy_cli

pytestmark = pytest.mark.slow

STEPS = 6


def _config(root: Path) -> Path:
    corpus = root / "corpus"
    corpus.mkdir()
    for source in sorted((Path(sysconfig.get_paths()["stdlib"]) / "json").glob("*.py")):
        (corpus / f"{source.stem}.txt").write_text(source.read_text())
    path = root / "run.toml"
    path.write_text(
        f"""
[run]
name = "two-node"
root = "{root / "runs"}"

[parallel]
dp_shard = 2

[train]
steps = {STEPS}
seq_len = 32
micro_batch_size = 4

[data]
source = "{corpus}"
cache_dir = "{root / "cache"}"

[checkpoint]
interval = 3

[metrics]
log_interval = 1
tensorboard = false

[cluster]
network = "eth-100"
"""
    )
    return path


def _losses(run_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [row["loss/main"] for row in rows if "loss/main" in row]


def test_two_agents_train_the_same_as_one_node(tmp_path):
    config = _config(tmp_path)
    out = tmp_path / "deploy"
    done = deploy_cli(
        "bare", config, "-o", out, "--nodes", "2", "--gpus-per-node", "1", "--max-restarts", "0"
    )
    assert done.code == 0, done.err
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "PYTHON": sys.executable,
        "NNODES": "2",
        "NPROC_PER_NODE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "RDZV_ID": f"e2e-{os.getpid()}",
        # One thread per rank, as torchrun gives each of `--nproc 2`'s ranks on one node (with one
        # process per node it leaves the threads alone): the loss's sum over tokens splits by
        # thread, and with AVX2 kernels another split rounds the reported loss differently.
        "OMP_NUM_THREADS": "1",
    }
    start = time.monotonic()
    agents = [
        subprocess.Popen(
            ["bash", str(out / "launch.sh")],
            cwd=tmp_path,
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for _ in range(2)
    ]
    results = [agent.communicate(timeout=180) for agent in agents]
    two_node_s = time.monotonic() - start
    for agent, (_, err) in zip(agents, results, strict=True):
        assert agent.returncode == 0, err[-3000:]
    run_dir = tmp_path / "runs" / "two-node"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2
    assert summary["steps"] == STEPS
    assert (run_dir / "checkpoints" / f"step-{STEPS}").is_dir()

    single = subprocess.run(
        [
            sys.executable,
            "-m",
            "dstrain",
            "train",
            str(out / "config.toml"),
            "--nproc",
            "2",
            "--set",
            "run.name=one-node",
        ],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        text=True,
        capture_output=True,
        timeout=180,
    )
    assert single.returncode == 0, single.stderr[-3000:]
    two, one = _losses(run_dir), _losses(tmp_path / "runs" / "one-node")
    assert len(two) == len(one) == STEPS
    print(f"two-node losses {two}\none-node losses {one}\ntwo-node launch {two_node_s:.1f} s")
    # Same layout, same rank count: the two-node run must be the same computation, bit for bit
    # (with 2 ranks every reduction is a commutative a + b).
    assert two == one
