"""Fault injection through the CLI, as on a real cluster: a worker killed mid-run, a corrupted
or truncated checkpoint, a disk that fills during a save, SIGTERM (preemption), a hung rank, and
a NaN. Each test says what was lost and checks that nothing else was; the figures print with -s.
"""

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests.distributed.harness import REPO
from tests.e2e.test_train_parallel_cli import (  # noqa: F401 (common: a fixture)
    _metrics,
    _run,
    common,
    run_root,
)

pytestmark = pytest.mark.slow


def _sets(*overrides: str) -> list[str]:
    return [arg for o in overrides for arg in ("--set", o)]


def _train(common, name, *extra, nproc=1, fault=None, args=()):  # noqa: F811
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    if fault:
        env["DSTRAIN_INJECT_FAULT"] = fault
    cmd = [sys.executable, "-m", "dstrain", "train", "--nproc", str(nproc), *args, *common]
    cmd += _sets(f"run.name={name}", "train.global_batch_size=8", "checkpoint.interval=2", *extra)
    started = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    done.seconds = time.monotonic() - started
    return done


def _losses(common, name):  # noqa: F811
    return [row["loss/main"] for row in _metrics(common, name)]


def _summary(common, name):  # noqa: F811
    return json.loads((run_root(common) / name / "summary.json").read_text())


def _weights(checkpoint: Path, tmp: Path) -> dict[str, torch.Tensor]:
    out = tmp / f"{checkpoint.parent.parent.name}.pt"
    dcp_to_torch_save(checkpoint, out)
    return torch.load(out, weights_only=False)["model"]


def test_a_killed_worker_restarts_the_group_and_loses_nothing(common, tmp_path):  # noqa: F811
    two = ("train.steps=8", "checkpoint.interval=4", "train.deterministic=true")
    whole = _train(common, "kill_ref", *two, nproc=2)
    assert whole.returncode == 0, whole.stderr
    killed = _train(
        common, "kill", *two, nproc=2, fault="kill:rank=1:step=6", args=("--max-restarts", "1")
    )
    assert killed.returncode == 0, killed.stderr
    assert "resumed from" in killed.stderr and "step-4" in killed.stderr
    assert _losses(common, "kill") == _losses(common, "kill_ref")
    summary = _summary(common, "kill")
    assert summary["elastic_restarts"] == 1 and summary["recomputed_steps"] == 1
    ckpts = run_root(common)
    a = _weights(ckpts / "kill" / "checkpoints" / "step-8", tmp_path)
    b = _weights(ckpts / "kill_ref" / "checkpoints" / "step-8", tmp_path)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    print(
        f"kill: lost 1 step (5 -> recomputed after the restart), 0 tokens of data; "
        f"wall {killed.seconds:.1f} s vs {whole.seconds:.1f} s uninterrupted "
        f"(+{killed.seconds - whole.seconds:.1f} s recovery); goodput {summary['goodput']:.2f}"
    )


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_damaged_newest_checkpoint_is_skipped(common, damage):  # noqa: F811
    name = f"damaged_{damage}"
    assert _train(common, name, "train.steps=4").returncode == 0
    shard = next((run_root(common) / name / "checkpoints" / "step-4").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0xFF
    else:
        data = data[: len(data) // 2]
    shard.write_bytes(bytes(data))
    again = _train(common, name, "train.steps=6")
    assert again.returncode == 0, again.stderr
    assert "skipping" in again.stderr and "step-4" in again.stderr
    assert "resumed from" in again.stderr and "step-2 at step 2" in again.stderr
    assert _train(common, "damaged_ref", "train.steps=6").returncode == 0
    assert _losses(common, name) == _losses(common, "damaged_ref")
    assert _summary(common, name)["recomputed_steps"] == 2
    print(f"{damage}: lost steps 3-4 (recomputed), resume took {again.seconds:.1f} s in all")


def test_a_full_disk_during_a_save_never_publishes_a_checkpoint(common):  # noqa: F811
    going = _train(common, "full_continue", "train.steps=6", fault="diskfull:rank=0:step=3")
    assert going.returncode == 0, going.stderr
    assert "was not saved" in going.stderr and "File too large" in going.stderr
    folder = run_root(common) / "full_continue" / "checkpoints"
    assert sorted(p.name for p in folder.iterdir() if p.name.startswith("step-")) == ["step-2"]
    assert not list(folder.glob(".*tmp*"))
    assert _summary(common, "full_continue")["checkpoint_failures"] == 2
    inspect = _run("-m", "dstrain", "ckpt", "inspect", str(folder.parent), "--json")
    assert inspect.returncode == 0
    stopped = _train(
        common,
        "full_stop",
        "train.steps=6",
        "checkpoint.on_save_error=stop",
        fault="diskfull:rank=0:step=3",
    )
    assert stopped.returncode == 1 and "Traceback" not in stopped.stderr
    assert "was not saved" in stopped.stderr
    folder = run_root(common) / "full_stop" / "checkpoints"
    assert sorted(p.name for p in folder.iterdir() if p.name.startswith("step-")) == ["step-2"]


def test_sigterm_saves_a_final_checkpoint_and_exits_cleanly(common):  # noqa: F811
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "dstrain", "train", "--nproc", "2", *common]
    cmd += _sets("run.name=preempt", "train.steps=500", "checkpoint.interval=1000")
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    metrics = run_root(common) / "preempt" / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (
        not metrics.exists() or len(metrics.read_text().splitlines()) < 3
    ):
        time.sleep(0.2)
    signalled = time.monotonic()
    job.send_signal(signal.SIGTERM)
    out, err = job.communicate(timeout=120)
    took = time.monotonic() - signalled
    assert job.returncode == 0, err
    assert "preempted (SIGTERM) after step" in err and "final checkpoint saved" in err
    summary = _summary(common, "preempt")
    assert summary["preempted"] and summary["steps"] >= 3
    final = run_root(common) / "preempt" / "checkpoints" / f"step-{summary['steps']}"
    assert (final / "manifest.json").exists()
    print(f"sigterm: checkpoint at step {summary['steps']}, exit {took:.1f} s after the signal")


def test_a_hung_rank_is_named_within_the_timeout(common):  # noqa: F811
    done = _train(
        common,
        "hang",
        "train.steps=4",
        "comm.timeout_s=5",
        "checkpoint.enable=false",
        "checkpoint.preemption_deadline_s=3",  # how long the hung rank outlives the agent's TERM
        nproc=2,
        fault="hang:rank=1:step=2",
    )
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "rank 0 timed out in step 2, held up by rank 1 at step 2 (step)" in done.stderr
    assert done.seconds < 30, done.seconds
    print(f"hang: job ended {done.seconds:.1f} s after launch with comm.timeout_s=5")


@pytest.mark.parametrize("policy", ["skip", "rollback", "stop"])
def test_a_nan_loss_meets_the_guard(common, policy):  # noqa: F811
    name = f"nan_{policy}"
    done = _train(
        common, name, "train.steps=5", f"guard.policy={policy}", fault="nan:rank=0:step=3"
    )
    if policy == "stop":
        assert done.returncode == 1 and "numerics guard: loss is nan" in done.stderr
        assert "Traceback" not in done.stderr
        return
    assert done.returncode == 0, done.stderr
    losses = _losses(common, name)
    assert all(math.isfinite(loss) for loss in losses[-2:])  # finite again after the bad step
    assert _summary(common, name)["bad_steps"] == 1
    print(f"nan/{policy}: {_summary(common, name)['recomputed_steps']} step(s) recomputed")
    if policy == "skip":
        assert "step 3 skipped" in done.stderr
    else:
        assert "rolled back from step 3 to step-2" in done.stderr


def test_async_and_model_only_checkpoints_resume_exactly(common):  # noqa: F811
    saves = ("checkpoint.async_mode=async", "checkpoint.model_only_interval=1")
    first = _train(common, "async", "train.steps=4", *saves)
    assert first.returncode == 0, first.stderr
    folder = run_root(common) / "async" / "checkpoints"
    assert sorted(p.name for p in folder.glob("step-*")) == ["step-2", "step-4"]
    models = sorted(p.name for p in (folder / "model").glob("step-*"))
    assert models == ["step-1", "step-3"]  # the full ones carry the weights at 2 and 4; kept 2
    inspect = _run("-m", "dstrain", "ckpt", "inspect", str(folder.parent), "--json")
    assert inspect.returncode == 0, inspect.stderr
    hf = run_root(common) / "async_hf"
    export = _run(
        "-m", "dstrain", "ckpt", "export-hf", str(folder / "model" / "step-3"), "-o", str(hf)
    )
    assert export.returncode == 0, export.stderr
    assert (hf / "model.safetensors.index.json").exists() and (hf / "config.json").exists()
    assert list(hf.glob("model-*-of-*.safetensors"))
    again = _train(common, "async", "train.steps=6", *saves)
    assert again.returncode == 0, again.stderr
    assert _train(common, "async_ref", "train.steps=6").returncode == 0
    assert _losses(common, "async") == _losses(common, "async_ref")
