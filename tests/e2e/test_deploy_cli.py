"""`dstrain deploy` as a user runs it: files written, --json facts, and bad input as one clear
message with a fix, a non-zero exit and no traceback."""

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import CliResult, run_cli

REPO = Path(__file__).resolve().parents[2]
DEBUG = REPO / "examples" / "debug.toml"
V3 = REPO / "examples" / "deepseek-v3-h800x2048.toml"


def deploy_cli(*args: object) -> CliResult:
    """`dstrain deploy ARGS` in this process."""
    return run_cli("deploy", *args)


def _failed(done: CliResult, *needles: str) -> None:
    assert done.code != 0
    assert "Traceback" not in done.text
    for needle in needles:
        assert needle in done.text, done.text


@pytest.mark.parametrize(
    ("target", "names"),
    [
        ("docker", {"config.toml", "Dockerfile", "Dockerfile.dockerignore"}),
        ("k8s", {"config.toml", "dstrain.yaml"}),
        ("slurm", {"config.toml", "dstrain.sbatch", "launch.sh"}),
        ("bare", {"config.toml", "launch.sh"}),
    ],
)
def test_each_target_writes_its_files_and_the_config_that_runs(tmp_path, target, names):
    out = tmp_path / "out"
    done = deploy_cli(target, DEBUG, "-o", out, "--nodes", "2", "--gpus-per-node", "4", "--json")
    assert done.code == 0, done.err
    facts = done.json()
    assert {Path(p).name for p in facts["files"]} == names == {p.name for p in out.iterdir()}
    assert (facts["nodes"], facts["gpus_per_node"], facts["world_size"]) == (2, 4, 8)
    config = (out / "config.toml").read_text()
    assert "nodes = 2" in config and "gpus_per_node = 4" in config
    for script in names & {"launch.sh", "dstrain.sbatch"}:
        assert os.stat(out / script).st_mode & stat.S_IXUSR


def test_the_cluster_section_gives_the_defaults(tmp_path):
    done = deploy_cli("k8s", V3, "-o", tmp_path / "o", "--allow-cross-node-ep", "--json")
    assert done.code == 0, done.err
    facts = done.json()
    assert (facts["nodes"], facts["gpus_per_node"], facts["job_name"]) == (256, 8, "deepseek-v3")
    assert any("expert-parallel groups span nodes" in w for w in facts["warnings"])
    assert any("checkpoints die with the pod" in w for w in facts["warnings"])
    # Several pods: without a shared claim no pod holds a whole checkpoint.
    assert any("ReadWriteMany" in w for w in facts["warnings"])


def test_human_output_names_the_files_and_warns_without_a_pvc(tmp_path):
    done = deploy_cli("k8s", DEBUG, "-o", tmp_path / "o", "--nodes", "2")
    assert done.code == 0
    assert "wrote" in done.out and "dstrain.yaml" in done.out
    assert "checkpoints die with the pod" in done.err
    quiet = deploy_cli("k8s", DEBUG, "-o", tmp_path / "p", "--nodes", "2", "--pvc", "runs")
    assert "checkpoints die" not in quiet.err


def test_a_non_empty_dir_is_never_overwritten_without_force(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.toml").write_text("mine")
    _failed(deploy_cli("slurm", DEBUG, "-o", out), "not empty", "--force")
    assert (out / "config.toml").read_text() == "mine"
    assert deploy_cli("slurm", DEBUG, "-o", out, "--force").code == 0
    assert (out / "config.toml").read_text() != "mine"


def test_a_layout_that_does_not_fit_the_world_is_refused(tmp_path):
    # debug has 4 heads: tp=4 is legal on its own, but not on 3 ranks.
    done = deploy_cli(
        "k8s",
        DEBUG,
        "-o",
        tmp_path / "o",
        "--nodes",
        "3",
        "--gpus-per-node",
        "1",
        "--set",
        "parallel.tp=4",
    )
    _failed(done, "error", "fix:")
    assert not (tmp_path / "o").exists()


def test_tensor_parallel_across_nodes_is_refused_with_a_fix(tmp_path):
    done = deploy_cli(
        "k8s",
        DEBUG,
        "-o",
        tmp_path / "o",
        "--nodes",
        "2",
        "--gpus-per-node",
        "2",
        "--set",
        "parallel.tp=4",
    )
    _failed(done, "tensor-parallel groups span nodes", "fix:", "divisors of 2")
    assert done.code == 1


def test_expert_parallel_across_nodes_needs_the_opt_in(tmp_path):
    args = (
        "k8s",
        DEBUG,
        "-o",
        tmp_path / "o",
        "--nodes",
        "2",
        "--gpus-per-node",
        "4",
        "--set",
        "parallel.ep=8",
    )
    _failed(deploy_cli(*args), "expert-parallel groups span nodes", "--allow-cross-node-ep")
    assert deploy_cli(*args, "--allow-cross-node-ep").code == 0


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("nowhere", DEBUG), "invalid choice"),
        (("k8s", Path("missing.toml")), "config file not found"),
        (("k8s", DEBUG, "--set", "parallel.tpp=2"), "tpp"),
        (("k8s", DEBUG, "--node-selector", "novalue"), "KEY=VALUE"),
        (("k8s", DEBUG, "--shm-size", "lots"), "Kubernetes quantity"),
        (("k8s", DEBUG, "--set", 'cluster.network="ib-xdr"'), "unknown network preset"),
    ],
)
def test_bad_input_is_one_message(tmp_path, args, needle):
    _failed(deploy_cli(*args, "-o", tmp_path / "o"), needle)


def test_an_unwritable_output_is_one_message(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    _failed(deploy_cli("bare", DEBUG, "-o", blocker), "is a file")
    _failed(deploy_cli("bare", DEBUG, "-o", blocker / "sub"), "cannot write")


def test_help_has_examples():
    done = deploy_cli("--help")
    assert done.code == 0
    assert "examples:" in done.out and "dstrain deploy k8s" in done.out


def test_json_is_machine_readable(tmp_path):
    done = deploy_cli("slurm", DEBUG, "-o", tmp_path / "o", "--nodes", "2", "--json")
    facts = json.loads(done.out)
    assert facts["target"] == "slurm" and facts["max_restarts"] == 3
    assert facts["rdzv_endpoint"].endswith(":29400")


def test_deploy_runs_on_a_laptop_without_importing_torch(tmp_path):
    code = (
        "import sys\n"
        "from tests.e2e.test_deploy_cli import deploy_cli\n"
        f"done = deploy_cli('k8s', {str(DEBUG)!r}, '-o', {str(tmp_path / 'o')!r}, '--nodes', '2')\n"
        "assert done.code == 0, done.err\n"
        "assert 'torch' not in sys.modules, 'deploy imported torch'\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize(
    ("overrides", "gpus"),
    [
        ((), True),  # comm.backend auto: NCCL on a GPU node
        (("--set", 'comm.backend="gloo"'), False),
        (("--set", 'cluster.gpu="cpu"'), False),
    ],
)
def test_slurm_asks_for_gpus_only_for_a_gpu_run_and_srun_gets_the_cpus(tmp_path, overrides, gpus):
    out = tmp_path / "o"
    done = deploy_cli(
        "slurm", DEBUG, "-o", out, "--nodes", "2", "--gpus-per-node", "2", "--cpus-per-task", "4",
        *overrides,
    )  # fmt: skip
    assert done.code == 0, done.err
    sbatch = (out / "dstrain.sbatch").read_text()
    # A cluster without GPU GRES refuses a job that asks for GPUs.
    assert ("#SBATCH --gpus-per-node=2\n" in sbatch) is gpus
    assert "gpus" not in sbatch.replace("#SBATCH --gpus-per-node=2\n", "").split("srun")[0].lower()
    assert "#SBATCH --cpus-per-task=4\n" in sbatch
    # Slurm's docs since 22.05: srun does not inherit --cpus-per-task from sbatch.
    srun = sbatch[sbatch.index("\nsrun ") :]
    assert '--cpus-per-task="${SLURM_CPUS_PER_TASK:-4}"' in srun.split("bash -c")[0]
