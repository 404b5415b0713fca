"""A real Slurm runs what `dstrain deploy slurm` renders. scripts/slurm-localhost.sh brings up
two slurmd "nodes" on this machine (Debian's slurm-wlm); the rendered dstrain.sbatch is
submitted unmodified with `sbatch`, for 1 node x 2 ranks and 2 nodes x 1 rank of a tiny CPU run,
and each must train exactly what `dstrain train --nproc 2` trains.

Restarts: the layer under test is torchrun's `--max-restarts`, which the rendered script uses.
One node's worker is killed mid-run; its agent restarts the group on both nodes and the workers
resume from the newest checkpoint, inside the same job step. Slurm's own `--requeue` is not the
layer for this: it requeues a job whose node failed or was preempted, not a step that exits with
an error, and a node failure cannot be made on one host.

Skips, saying why, without root or the slurm packages (and no apt-get to install them), or
when the cluster does not start."""

import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

from tests.distributed.harness import REPO
from tests.e2e.test_deploy_cli import deploy_cli
from tests.e2e.test_multinode_launch import _losses
from tests.tools import require_tool

pytestmark = pytest.mark.slow

SCRIPT = REPO / "scripts" / "slurm-localhost.sh"
STATE = Path(os.environ.get("DSTRAIN_SLURM_DIR", "/tmp/dstrain-slurm"))
TOOLS = ("sbatch", "scontrol", "sinfo", "slurmctld", "slurmd", "munged")
STEPS, INTERVAL = 6, 2
HANG_STEP = 4  # the killed node's rank stops at the start of step 4: the last checkpoint is step-2
JOB_TIMEOUT_S = 300


def _slurm(*args: str, env: dict[str, str], cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(args, env=env, cwd=cwd, capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def slurm_env() -> dict[str, str]:
    """The environment `sbatch` runs in, with the localhost cluster up; it is brought down
    afterwards unless it was up before."""
    if os.geteuid() != 0:
        pytest.skip("the localhost Slurm cluster needs root (slurmd starts jobs as any user)")
    if not all(shutil.which(tool) for tool in TOOLS):
        if shutil.which("apt-get") is None:
            pytest.skip("Slurm is not installed and there is no apt-get to install slurm-wlm")
        for tool in TOOLS:
            require_tool(tool)
    env = {**os.environ, "SLURM_CONF": str(STATE / "slurm.conf"), "DSTRAIN_SLURM_DIR": str(STATE)}
    was_up = _slurm("bash", str(SCRIPT), "status", env=env).returncode == 0
    started = time.monotonic()
    up = _slurm("bash", str(SCRIPT), "up", env=env)
    if up.returncode != 0:
        why = (up.stderr or up.stdout)[-1500:]
        pytest.skip(f"the localhost Slurm cluster did not start: {why}")
    print(f"slurm-localhost up in {time.monotonic() - started:.1f} s (was up: {was_up})")
    # PYTHON: the rendered script's interpreter; PYTHONPATH: this checkout. sbatch passes the
    # submitting environment to the job (--export=ALL), as a user's activated venv would be.
    # OMP_NUM_THREADS=1: one thread per rank, as torchrun gives `--nproc 2`'s ranks on one node
    # (alone on a node it leaves them unset): another split of the loss's sum over threads rounds
    # the reported loss differently.
    yield {**env, "PYTHON": sys.executable, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    if not was_up:
        _slurm("bash", str(SCRIPT), "down", env=env)


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> Path:
    """A tiny CPU run: the debug flavor, 6 steps of 4 x 32 tokens, fp32, gloo, a checkpoint
    every 2 steps, on a corpus of the standard library's json sources."""
    root = tmp_path_factory.mktemp("slurm")
    corpus = root / "corpus"
    corpus.mkdir()
    for source in sorted((Path(sysconfig.get_paths()["stdlib"]) / "json").glob("*.py")):
        (corpus / f"{source.stem}.txt").write_text(source.read_text())
    path = root / "run.toml"
    path.write_text(
        f"""
[run]
name = "slurm"
root = "{root / "runs"}"

[model]
flavor = "debug"

[parallel]
dp_shard = 2

[train]
steps = {STEPS}
seq_len = 32
micro_batch_size = 4
precision = "fp32"

[data]
source = "{corpus}"
cache_dir = "{root / "cache"}"

[checkpoint]
interval = {INTERVAL}

[metrics]
log_interval = 1
tensorboard = false

[comm]
backend = "gloo"

[cluster]
network = "eth-100"
"""
    )
    return path


@pytest.fixture(scope="module")
def reference(config) -> list[float]:
    """The losses of `dstrain train --nproc 2` of the same config, on this machine."""
    done = subprocess.run(
        [sys.executable, "-m", "dstrain", "train", str(config), "--nproc", "2"]
        + ["--set", "run.name=local"],
        cwd=config.parent,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=JOB_TIMEOUT_S,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    losses = _losses(config.parent / "runs" / "local")
    assert len(losses) == STEPS
    return losses


def _deploy(config: Path, name: str, nodes: int, ranks: int) -> Path:
    out = config.parent / f"deploy-{name}"
    done = deploy_cli(
        "slurm", config, "-o", out, "--nodes", nodes, "--gpus-per-node", ranks,
        "--cpus-per-task", len(os.sched_getaffinity(0)), "--set", f"run.name={name}",
    )  # fmt: skip
    assert done.code == 0, done.err
    return out


def _submit(out: Path, env: dict[str, str]) -> str:
    # As docs/deploy.md says: from the deploy folder, which becomes the job's DEPLOY_DIR.
    done = _slurm("sbatch", "--parsable", "dstrain.sbatch", env=env, cwd=out)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().split(";")[0]


def _job(job: str, env: dict[str, str]) -> dict[str, str]:
    """`scontrol show job` as key -> value (the job stays visible for MinJobAge)."""
    text = _slurm("scontrol", "show", "job", "-o", job, env=env).stdout
    return dict(field.split("=", 1) for field in text.split() if "=" in field)


def _wait(job: str, out: Path, env: dict[str, str]) -> dict[str, str]:
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while (info := _job(job, env)).get("JobState") in ("PENDING", "RUNNING", "COMPLETING"):
        assert time.monotonic() < deadline, f"job {job} still {info.get('JobState')}"
        time.sleep(0.5)
    log = next(out.glob(f"*-{job}.out"), None)
    info["log"] = log.read_text() if log else ""
    assert info.get("JobState") == "COMPLETED", f"{info}\n{info['log'][-3000:]}"
    assert info["ExitCode"] == "0:0"
    return info


def _run_dir(config: Path, name: str) -> Path:
    return config.parent / "runs" / name


@pytest.fixture(scope="module")
def uninterrupted(config, slurm_env) -> dict[str, dict[str, str]]:
    """Both layouts submitted at once and waited for: name -> the job's record."""
    started = time.monotonic()
    layouts = {"slurm-1x2": (1, 2), "slurm-2x1": (2, 1)}
    outs = {name: _deploy(config, name, *shape) for name, shape in layouts.items()}
    jobs = {name: _submit(out, slurm_env) for name, out in outs.items()}
    done = {name: _wait(jobs[name], outs[name], slurm_env) for name in layouts}
    print(f"1x2 and 2x1 jobs: {time.monotonic() - started:.1f} s")
    return done


@pytest.mark.parametrize(("name", "nodes"), [("slurm-1x2", "node1"), ("slurm-2x1", "node[1-2]")])
def test_the_rendered_sbatch_trains_as_dstrain_train(config, uninterrupted, reference, name, nodes):
    job = uninterrupted[name]
    assert job["NodeList"] == nodes and job["Restarts"] == "0"
    losses = _losses(_run_dir(config, name))
    print(f"{name}: losses {losses}\nlocal: losses {reference}")
    # Same layout, same rank count: the same computation bit for bit (with 2 ranks every
    # reduction is a commutative a + b).
    assert losses == reference
    final = _run_dir(config, name) / "checkpoints" / f"step-{STEPS}"
    # One shard per rank; on 2 x 1 each node holds one rank, so each node wrote one.
    assert sorted(p.name for p in final.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    summary = json.loads((_run_dir(config, name) / "summary.json").read_text())
    assert (summary["world_size"], summary["steps"]) == (2, STEPS)


def _cpus(pid: int) -> int:
    """How many CPUs the process may run on (Slurm's task/affinity binds each task)."""
    return len(os.sched_getaffinity(pid))


def _workers(job: str) -> dict[int, tuple[int, str]]:
    """This job's training workers on this host: rank -> (pid, the Slurm node it runs on)."""
    found = {}
    for proc in Path("/proc").iterdir():
        try:
            raw = (proc / "environ").read_bytes()
        except (OSError, ValueError):
            continue
        env = dict(kv.split("=", 1) for kv in raw.decode(errors="replace").split("\0") if "=" in kv)
        # torchrun sets RANK for its workers only, never for itself.
        if env.get("SLURM_JOB_ID") == job and "RANK" in env and "TORCHELASTIC_RUN_ID" in env:
            found[int(env["RANK"])] = (int(proc.name), env.get("SLURMD_NODENAME", "?"))
    return found


def test_a_killed_node_step_restarts_and_resumes_from_the_last_checkpoint(
    config, slurm_env, uninterrupted
):
    name = "slurm-kill"
    out = _deploy(config, name, 2, 1)
    # The rank stops at the start of step 4 (first attempt only), so the kill lands at a known
    # step and not after the run ended; the kill itself comes from outside, as a node's OOM
    # killer or a failing host would.
    env = {**slurm_env, "DSTRAIN_INJECT_FAULT": f"hang:rank=1:step={HANG_STEP}"}
    started = time.monotonic()
    job = _submit(out, env)
    run_dir = _run_dir(config, name)
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while len(_losses(run_dir) if (run_dir / "metrics.jsonl").exists() else []) < HANG_STEP - 1:
        assert time.monotonic() < deadline, "the run never reached the step before the hang"
        time.sleep(0.2)
    workers = _workers(job)
    assert sorted(node for _, node in workers.values()) == ["node1", "node2"], workers
    # srun passed --cpus-per-task: each node's rank may use all of its task's CPUs, not one core.
    assert [_cpus(p) for p, _ in workers.values()] == [len(os.sched_getaffinity(0))] * 2
    pid, node = workers[1]
    for victim, victim_node in workers.values():  # every worker of rank 1's node
        if victim_node == node:
            os.kill(victim, signal.SIGKILL)
    info = _wait(job, out, slurm_env)
    wall = time.monotonic() - started
    resumed = f"resumed from {run_dir}/checkpoints/step-{INTERVAL} at step {INTERVAL}"
    assert resumed in info["log"], info["log"][-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    # One group restart by torchrun, inside the same job (Slurm restarted nothing); step 3,
    # done after the step-2 checkpoint, is done again.
    assert (summary["elastic_restarts"], summary["recomputed_steps"]) == (
        1,
        HANG_STEP - 1 - INTERVAL,
    )
    assert summary["steps"] == STEPS and info["Restarts"] == "0"
    killed, whole = _losses(run_dir), _losses(_run_dir(config, "slurm-2x1"))
    print(f"killed rank 1 (pid {pid}) on {node} at step {HANG_STEP}; job {wall:.1f} s")
    print(f"killed: losses {killed}\nwhole:  losses {whole}")
    assert killed == whole
    final = run_dir / "checkpoints" / f"step-{STEPS}"
    assert sorted(p.name for p in final.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
