"""The pure-Python parts of deploy: names, the placement rule, the shared torchrun command as
the shell really runs it (launch.sh and the sbatch script with stand-ins for python, srun and
scontrol), and the Docker pins."""

import os
import subprocess
from pathlib import Path

import pytest

from dstrain.config.schema import DstrainConfig
from dstrain.deploy import render
from dstrain.deploy.build import build_spec
from dstrain.deploy.docker import CUDA_BUILDS, installed_pins
from dstrain.deploy.launch import torchrun_command
from dstrain.deploy.spec import check_placement, dns_label
from dstrain.errors import UserError

DEBUG = Path(__file__).resolve().parents[2] / "examples" / "debug.toml"


@pytest.mark.parametrize(
    ("name", "label"),
    [("debug", "debug"), ("My_Run.v2", "my-run-v2"), ("42", "dstrain-42"), ("--x--", "x")],
)
def test_job_names_are_dns_labels(name, label):
    assert dns_label(name) == label


def test_long_names_leave_room_for_pod_hostnames():
    label = dns_label("a" * 100)
    assert len(f"{label}-node-999-0") <= 63


def _config(**parallel: int) -> DstrainConfig:
    return DstrainConfig.model_validate({"parallel": parallel})


@pytest.mark.parametrize(
    ("parallel", "nodes", "gpus"),
    [({"tp": 8}, 2, 8), ({"tp": 2, "ep": 4}, 4, 8), ({"ep": 8}, 2, 8), ({"tp": 8}, 1, 8)],
)
def test_groups_inside_a_node_are_placed(parallel, nodes, gpus):
    assert check_placement(_config(**parallel), nodes, gpus) == []


def test_tensor_parallel_across_nodes_is_refused():
    with pytest.raises(UserError, match="tensor-parallel groups span nodes") as err:
        check_placement(_config(tp=4), 2, 2)
    assert "--set parallel.tp=2" in err.value.fix
    with pytest.raises(UserError):  # 6 ranks per node cannot hold whole tp=4 groups
        check_placement(_config(tp=4, dp_shard=3), 2, 6)


def test_expert_parallel_across_nodes_needs_the_opt_in():
    with pytest.raises(UserError, match="expert-parallel") as err:
        check_placement(_config(ep=16), 4, 8)
    assert "--allow-cross-node-ep" in err.value.fix
    assert "allowed" in check_placement(_config(ep=16), 4, 8, allow_cross_node_ep=True)[0]


def _fake_bin(tmp_path: Path) -> Path:
    """python, srun and scontrol stand-ins: python prints its argv one per line."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scripts = {
        "python": 'printf "%s\\n" "$@"',
        "scontrol": 'printf "node-a\\nnode-b\\n"',
        # srun: drop its own options, run the task once (as on the first node)
        "srun": 'while [[ "$1" == -* ]]; do shift; done; exec "$@"',
    }
    for name, body in scripts.items():
        (bin_dir / name).write_text(f"#!/usr/bin/env bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    return bin_dir


def _run(script: Path, env: dict[str, str]) -> list[str]:
    done = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def test_launch_sh_reads_the_environment_with_config_defaults(tmp_path):
    spec = build_spec(DEBUG, [], nodes=2, gpus_per_node=4, max_restarts=2).spec
    files = render("bare", spec)
    (tmp_path / "launch.sh").write_text(files["launch.sh"])
    fake = _fake_bin(tmp_path)
    base = {"PATH": f"{fake}:{os.environ['PATH']}", "PYTHON": str(fake / "python")}
    argv = _run(tmp_path / "launch.sh", base)
    assert argv[:2] == ["-m", "torch.distributed.run"]
    assert {
        "--nnodes=2",
        "--nproc-per-node=4",
        "--rdzv-backend=c10d",
        "--max-restarts=2",
        "--rdzv-endpoint=127.0.0.1:29400",
        "--rdzv-id=debug",
    } <= set(argv)
    assert argv[-3:] == ["-m", "dstrain.train", str(tmp_path / "config.toml")]
    assert not any(a.startswith("--node-rank") for a in argv)
    env = {
        **base,
        "NNODES": "3",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "1234",
        "NODE_RANK": "1",
        "DSTRAIN_CONFIG": "/x.toml",
    }
    argv = _run(tmp_path / "launch.sh", env)
    assert {"--nnodes=3", "--rdzv-endpoint=10.0.0.1:1234", "--node-rank=1"} <= set(argv)
    assert argv[-1] == "/x.toml"


def test_sbatch_runs_the_same_torchrun_command_per_node(tmp_path):
    spec = build_spec(DEBUG, [], nodes=2, gpus_per_node=8, partition="gpu").spec
    files = render("slurm", spec)
    sbatch = files["dstrain.sbatch"]
    assert torchrun_command() in sbatch and torchrun_command() in files["launch.sh"]
    for line in (
        "--nodes=2",
        "--ntasks-per-node=1",
        "--gpus-per-node=8",
        "--exclusive",
        "--partition=gpu",
        "--cpus-per-task=16",
    ):
        assert f"#SBATCH {line}\n" in sbatch
    assert "--time" not in sbatch
    (tmp_path / "job.sbatch").write_text(sbatch)
    fake = _fake_bin(tmp_path)
    env = {
        "PATH": f"{fake}:{os.environ['PATH']}",
        "PYTHON": str(fake / "python"),
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_JOB_NODELIST": "node-[a-b]",
        "SLURM_JOB_ID": "777",
        "SLURM_SUBMIT_DIR": str(tmp_path),
    }
    argv = _run(tmp_path / "job.sbatch", env)
    assert {
        "--nnodes=2",
        "--nproc-per-node=8",
        "--rdzv-endpoint=node-a:29400",
        "--rdzv-id=777",
        "--max-restarts=3",
    } <= set(argv)
    assert argv[-1] == str(tmp_path / "config.toml")


def test_docker_pins_what_is_installed_with_torch_from_the_cuda_index():
    pins = installed_pins()
    assert "+" not in pins["torch"]
    assert {"numpy", "pydantic", "PyYAML"} <= set(pins)  # pyproject's dependencies
    assert "pytest" not in pins  # test extras stay out of the image
    spec = build_spec(DEBUG, [], cuda="cu126").spec
    dockerfile = render("docker", spec, pins={"torch": "2.13.0"})["Dockerfile"]
    assert f"FROM {CUDA_BUILDS['cu126'][0]}\n" in dockerfile
    assert "torch==2.13.0\n" in dockerfile
    assert "--index-url https://download.pytorch.org/whl/cu126" in dockerfile
    assert 'ENTRYPOINT ["python3", "-m", "torch.distributed.run"]' in dockerfile
