"""A step that runs out of memory, through the CLI: an injected `torch.OutOfMemoryError`
(DSTRAIN_INJECT_FAULT=oom) with an async checkpoint in flight, a real host allocation failing
under RLIMIT_AS, and a rank of two running out under torchrun. Each must print the measured
breakdown, the planner's estimate and `--set` lines instead of a traceback, exit 3, and leave
the newest checkpoint valid and resumable. The printed advice shows with -s."""

import json
import os
import resource
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from dstrain.checkpoint.catalog import latest_valid
from dstrain.errors import OUT_OF_MEMORY
from tests.distributed.harness import REPO

pytestmark = pytest.mark.slow

STEPS = ("train.steps=4", "checkpoint.interval=2", "checkpoint.async_mode=async")


@dataclass
class Run:
    code: int
    out: str
    err: str
    seconds: float
    vm_peak: int  # bytes of address space the process reached (/proc/PID/status VmPeak)


@pytest.fixture(scope="module")
def common(tmp_path_factory) -> list[str]:
    root = tmp_path_factory.mktemp("oom")
    corpus = root / "corpus"
    corpus.mkdir()
    for source in sorted((Path(sysconfig.get_paths()["stdlib"]) / "json").glob("*.py")):
        (corpus / f"{source.stem}.txt").write_text(source.read_text())
    return [
        f"data.source={corpus}",
        f"data.cache_dir={root / 'cache'}",
        f"run.root={root / 'runs'}",
        "train.seq_len=32",
        "train.micro_batch_size=4",
        "metrics.log_interval=1",
        "comm.timeout_s=20",
        "checkpoint.preemption_deadline_s=5",
    ]


def _train(common, name, *sets, nproc=1, fault=None, address_space=None) -> Run:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("DSTRAIN_INJECT_FAULT", None)
    if fault:
        env["DSTRAIN_INJECT_FAULT"] = fault
    cmd = [sys.executable, "-m", "dstrain", "train", "--nproc", str(nproc)]
    for override in (*common, f"run.name={name}", *sets):
        cmd += ["--set", override]

    def limit() -> None:
        if address_space:
            resource.setrlimit(resource.RLIMIT_AS, (address_space, address_space))

    began = time.monotonic()
    job = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO,
        preexec_fn=limit,
    )  # fmt: skip
    vm_peak = 0
    while job.poll() is None and time.monotonic() - began < 240:
        vm_peak = max(vm_peak, _vm_peak(job.pid))
        time.sleep(0.05)
    out, err = job.communicate(timeout=60)
    return Run(job.returncode, out, err, time.monotonic() - began, vm_peak)


def _vm_peak(pid: int) -> int:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    line = next((x for x in status.splitlines() if x.startswith("VmPeak:")), "VmPeak: 0 kB")
    return int(line.split()[1]) * 1024


def _root(common) -> Path:
    return Path(next(a for a in common if a.startswith("run.root=")).split("=", 1)[1])


def _assert_advice(run: Run) -> str:
    """The advice's parts, once, without a traceback; returns its text."""
    assert run.code == OUT_OF_MEMORY, run.err
    assert "Traceback" not in run.err
    lines = run.err.splitlines()
    text = "\n".join(lines[next(i for i, x in enumerate(lines) if " ran out of " in x) :])
    assert text.count("nearest layouts that fit") == 1
    head = text.splitlines()[1].split()
    assert head[4:] == ["weights", "gradients", "optimizer", "activations", "other", "total"]
    assert "  measured (rank " in text and "  planner's estimate " in text
    assert "  1. --set " in text
    print("\n" + text)
    return text


@pytest.fixture(scope="module")
def injected(common) -> Run:
    """Step 3 of 4 runs out, the async save of step 2 just started."""
    return _train(common, "injected", *STEPS, fault="oom:rank=0:step=3")


def test_an_injected_oom_prints_the_advice_exits_3_and_resumes(common, injected):
    text = _assert_advice(injected)
    assert "rank 0 ran out of host memory" in text and "in step 3" in text
    record = json.loads((_root(common) / "injected" / "oom.json").read_text())
    assert record["exit_code"] == OUT_OF_MEMORY and record["measured"]["step"] == 3
    assert record["nearest"] and all("=" in f for f in record["nearest"][0]["flags"])
    folder = _root(common) / "injected" / "checkpoints"
    assert latest_valid(folder).name == "step-2"  # the save in flight was finished, published
    again = _train(common, "injected", *STEPS)
    assert again.code == 0, again.err
    assert "resumed from" in again.err and "step-2 at step 2" in again.err
    assert latest_valid(folder).name == "step-4"
    print(f"injected: {injected.seconds:.1f} s, resumed and finished in {again.seconds:.1f} s")


def test_a_host_memory_limit_gets_the_same_advice(common, injected):
    """RLIMIT_AS a little above what the small run reached: the model builds, and the first
    step at 16x the micro-batch and 8x the sequence fails in torch's CPU allocator."""
    assert injected.vm_peak > 0
    limit = injected.vm_peak + 512 * 2**20
    run = _train(
        common,
        "limited",
        "train.steps=2",
        "train.seq_len=256",
        "train.micro_batch_size=64",
        "checkpoint.enable=false",
        address_space=limit,
    )
    text = _assert_advice(run)
    assert "host memory (RLIMIT_AS" in text and "in step 1" in text
    assert "DefaultCPUAllocator" in text or "MemoryError" in text
    assert "--set train.micro_batch_size=" in text  # the obvious fix is among the nearest
    print(f"limited to {limit / 2**30:.2f} GiB of address space: {run.seconds:.1f} s")


def test_one_rank_of_two_runs_out_and_nobody_hangs(common):
    run = _train(common, "two", *STEPS, nproc=2, fault="oom:rank=1:step=3")
    _assert_advice(run)
    assert "rank 1 ran out of host memory" in run.err
    assert "held up by rank 1 at step 3 (out of memory)" in run.err  # rank 0's own message
    assert "rank 1 failed (exit code 3)" in run.err
    assert latest_valid(_root(common) / "two" / "checkpoints").name == "step-2"
    assert run.seconds < 90, run.seconds
    print(f"two ranks: job ended {run.seconds:.1f} s after launch")
