"""The observability issue's acceptance run: `dstrain train --nproc 4` (pp2 x dp2 with ZeRO-2, the
debug MoE model with MTP) shows every key in metrics.jsonl, in TensorBoard (read back with
tensorboard's own EventAccumulator) and in a real Prometheus server scraping the four ranks;
writes summary.json and a profiler trace per rank; and `dstrain report` draws it in a page that
headless Chromium renders with no broken image."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from dstrain.metrics.prometheus import prometheus_name
from tests.browser import rendered_images
from tests.conftest import run_cli
from tests.distributed.harness import REPO, free_port
from tests.prometheus_server import prometheus_server, query, wait_for_series
from tests.tools import require_tool

pytestmark = pytest.mark.slow

RANKS = 4
NAME = "observed"
LAYERS = ("layer1", "layer2", "layer3", "mtp1")  # the debug model's MoE layers (layer 0 is dense)
KEYS = [
    *("loss/main", "loss/mtp", "loss/max_over_dp"),
    *("optim/grad_norm", "optim/lr"),
    "throughput/tokens_per_s",
    "throughput/tokens_per_s_per_device",
    "throughput/tflops_per_device",
    "throughput/mfu",
    *("memory/rss_mb", "memory/peak_rss_mb"),
    *(f"time/{p}_s" for p in ("step", "data", "forward", "backward", "optimizer", "checkpoint")),
    *("comm/exposed_fraction", "comm/exposed_fraction_max"),
    *(f"comm/{axis}/{s}" for axis in ("dp", "pp") for s in ("exposed_fraction", "bytes_per_step")),
    *("pipeline/bubble_fraction", "pipeline/bubble_fraction_theory"),
    *(f"moe/{layer}/{stat}" for layer in LAYERS for stat in ("max_over_mean", "cv")),
    *(f"moe/{layer}/{stat}" for layer in LAYERS for stat in ("dead_experts", "bias_norm")),
    *(f"moe/{layer}/tokens_per_expert" for layer in LAYERS),
    *("moe/max_over_mean", "moe/dead_experts", "guard/bad_steps"),
]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    """Trains while Prometheus scrapes; returns the run folder and what Prometheus answered."""
    tmp = tmp_path_factory.mktemp("observed")
    port = _free_block(RANKS)
    targets = [f"127.0.0.1:{port + r}" for r in range(RANKS)]
    with prometheus_server(targets, tmp) as url:
        training = _train(tmp, port)
        try:
            wait_for_series(url, f'dstrain_loss_main{{run="{NAME}"}}', 120, count=RANKS)
            answers = {key: _ranks_answering(url, key) for key in KEYS}
        finally:
            out, _ = training.communicate(timeout=300)
    assert training.returncode == 0, out[-3000:]
    return {"dir": tmp / "runs" / NAME, "prometheus": answers, "log": out}


def test_every_key_is_in_metrics_jsonl(run):
    rows = [json.loads(line) for line in (run["dir"] / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(2, 41, 2))
    missing = [key for key in KEYS if key not in rows[-1]]
    assert not missing
    last = rows[-1]
    assert 0 < last["comm/exposed_fraction"] <= last["comm/exposed_fraction_max"] < 1
    assert 0 < last["pipeline/bubble_fraction"] < 1
    assert last["loss/max_over_dp"] >= last["loss/main"] * 0.9
    assert len(last["moe/layer1/tokens_per_expert"]) == 8
    # The global batch's routed tokens: 16 sequences x 32 positions x top-2 per layer.
    assert sum(last["moe/layer1/tokens_per_expert"]) == 16 * 32 * 2


def test_every_scalar_key_is_in_tensorboard(run):
    rows = [json.loads(line) for line in (run["dir"] / "metrics.jsonl").read_text().splitlines()]
    events = EventAccumulator(str(run["dir"] / "tb"), size_guidance={"scalars": 0}).Reload()
    tags = set(events.Tags()["scalars"])
    scalars = {
        key for key, value in rows[-1].items() if key != "step" and not isinstance(value, list)
    }
    assert scalars <= tags, scalars - tags
    logged = events.Scalars("loss/main")
    assert [e.step for e in logged] == [row["step"] for row in rows]
    assert [e.value for e in logged] == pytest.approx([row["loss/main"] for row in rows], rel=1e-6)


def test_every_key_is_scraped_from_every_rank(run):
    silent = {key: ranks for key, ranks in run["prometheus"].items() if ranks != set(range(RANKS))}
    assert not silent


def test_summary_and_profiler_traces(run):
    summary = json.loads((run["dir"] / "summary.json").read_text())
    assert summary["steps"] == 40 and summary["tokens_per_s"] > 0
    assert 0 < summary["comm_exposed_fraction"] < 1
    assert 0 < summary["pipeline_bubble_fraction"] < 1
    assert 0 < summary["mfu"] < 1 and summary["tflops_per_device"] > 0
    assert summary["peak_rss_mb"] > 100 and summary["goodput"] > 0
    for rank in range(RANKS):
        trace = json.loads((run["dir"] / "profile" / f"rank{rank}.trace.json").read_text())
        steps = {e["name"] for e in trace["traceEvents"] if e.get("name", "").startswith("step")}
        assert {"step 3", "step 4"} <= steps and not steps - {"step 3", "step 4"}


def test_report_draws_the_run_and_chromium_shows_it(run, tmp_path):
    chromium = require_tool("chromium")
    drawn = run_cli("report", run["dir"], "--json")
    assert drawn.code == 0, drawn.text
    answer = drawn.json()
    for figure in ("loss", "mfu", "comm", "bubble", "memory", "time", "expert_load"):
        assert f"{figure}.png" in answer["plots"]
    images = rendered_images(chromium, tmp_path, Path(answer["index"]))
    assert images.states == dict.fromkeys(answer["plots"], "loaded")


def _train(tmp: Path, port: int) -> subprocess.Popen:
    overrides = [
        f"run.name={NAME}",
        f"run.root={tmp / 'runs'}",
        "train.steps=40",
        "train.seq_len=32",
        "train.micro_batch_size=4",
        "train.global_batch_size=16",
        "parallel.pp=2",
        "parallel.dp_shard=2",
        "parallel.zero_stage=2",
        "metrics.log_interval=2",
        f"metrics.prometheus_port={port}",
        "checkpoint.interval=20",
    ]
    command = [sys.executable, "-m", "dstrain", "train", "--nproc", str(RANKS)]
    command += ["--profile-steps", "3:4", *(a for o in overrides for a in ("--set", o))]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO
    )


def _ranks_answering(url: str, key: str) -> set[int]:
    name, labels = prometheus_name(key)
    selector = ",".join(f'{k}="{v}"' for k, v in {"run": NAME, **labels}.items())
    return {int(series["metric"]["rank"]) for series in query(url, f"{name}{{{selector}}}")}


def _free_block(size: int) -> int:
    """A port P with P..P+size-1 free (rank r serves on P + r)."""
    for _ in range(20):
        port = free_port()
        if port + size < 65536 and all(_is_free(port + i) for i in range(size)):
            return port
    raise RuntimeError("no block of free ports")


def _is_free(port: int) -> bool:
    import socket

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
