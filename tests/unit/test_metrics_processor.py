"""The metrics processor's arithmetic on one process: what each key is made of (the 4-rank run in
tests/e2e/test_observability.py checks they all arrive everywhere)."""

import json
import math
import time

import pytest
import torch

from dstrain.metrics.comm_timer import CommTimer
from dstrain.metrics.moe_stats import layer_label, load_stats
from dstrain.metrics.probes import NO_PROBES, Probes
from dstrain.metrics.processor import MetricsProcessor, StepFigures, Throughput, Window
from dstrain.metrics.spans import Spans
from dstrain.model.transformer import build_model
from dstrain.train.profiling import StepProfiler
from tests.unit.tiny import tiny_args


def test_load_stats_of_a_skewed_layer():
    stats = load_stats(torch.tensor([4.0, 0.0, 2.0, 2.0]))
    assert stats["tokens_per_expert"] == [4.0, 0.0, 2.0, 2.0]
    assert stats["max_over_mean"] == 2.0
    assert stats["cv"] == pytest.approx(math.sqrt(2) / 2)  # population std sqrt(2), mean 2
    assert stats["dead_experts"] == 1.0
    assert load_stats(torch.zeros(4)) == {}  # a layer that saw no token has no figures


@pytest.mark.parametrize(
    "name, label",
    [
        ("layers.3.moe.router", "layer3"),
        ("layers.12._checkpoint_wrapped_module.moe.router", "layer12"),
        ("module.layers.1._orig_mod.moe.router", "layer1"),
        ("mtp.1.block.ffn.router", "mtp1"),
        ("odd.place.router", "odd_place"),
    ],
)
def test_layer_labels_survive_wrappers(name, label):
    assert layer_label(name) == label


def test_spans_sum_per_label_and_reset():
    spans = Spans(torch.device("cpu"))
    started = spans.start()
    time.sleep(0.02)
    spans.stop("forward", started)
    spans.add("forward", 1.0)
    taken = spans.take()
    assert 1.02 <= taken["forward"] < 1.5
    assert spans.take() == {}


class _FakeComm(CommTimer):
    """A communication timer that reports fixed figures (one process has no collectives)."""

    def __init__(self, exposed: dict[str, float], moved: dict[str, int]) -> None:
        super().__init__(torch.device("cpu"), {})
        self.fixed = exposed, moved

    def take(self):
        return self.fixed


def _window(seconds: float, tokens: int, steps: int) -> Window:
    window = Window()
    window.seconds, window.tokens, window.steps = seconds, tokens, steps
    return window


def _figures(**changes) -> StepFigures:
    base = dict(
        loss=torch.tensor(5.0),
        grad_norm=torch.tensor(0.5),
        local_loss=torch.tensor(5.0),
        lr=1e-3,
        expert_load={"layers.1.moe.router": torch.tensor([6.0, 2.0, 0.0, 0.0])},
    )
    return StepFigures(**{**base, **changes})


@pytest.fixture
def processor():
    model = build_model(tiny_args(), torch.device("cpu"))
    with torch.no_grad():
        model.layers["1"].ffn.router.expert_bias.copy_(torch.tensor([3.0, 4.0, 0.0, 0.0]))
    probes = Probes(torch.device("cpu"), _FakeComm({"dp": 0.5, "tp": 0.25}, {"dp": 4000}))
    probes.spans.add("forward", 0.8)
    probes.spans.add("data", 0.04)
    throughput = Throughput(world_size=1, flops_per_token=6e6, peak_flops=1e12)
    return MetricsProcessor(model, throughput, probes, torch.device("cpu"))


def test_figures_of_a_window(processor):
    metrics = processor.collect(
        _figures(mtp_loss=torch.tensor(5.5), loss_scale=1024.0), _window(2.0, 1000, 4)
    )
    assert metrics["loss/main"] == 5.0 and metrics["loss/mtp"] == 5.5
    assert metrics["loss/max_over_dp"] == 5.0  # one rank: its own loss
    assert metrics["optim/loss_scale"] == 1024.0 and metrics["optim/lr"] == 1e-3
    assert metrics["throughput/tokens_per_s"] == 500.0
    assert metrics["throughput/tflops_per_device"] == pytest.approx(500 * 6e6 / 1e12)
    assert metrics["throughput/mfu"] == pytest.approx(500 * 6e6 / 1e12)
    assert metrics["time/step_s"] == 0.5
    assert metrics["time/forward_s"] == pytest.approx(0.2)  # 0.8 s over 4 steps
    assert metrics["time/data_s"] == pytest.approx(0.01)
    assert metrics["time/backward_s"] == 0.0
    assert metrics["comm/exposed_fraction"] == pytest.approx(0.375)  # 0.75 s of 2 s
    assert metrics["comm/dp/exposed_fraction"] == pytest.approx(0.25)
    assert metrics["comm/tp/exposed_fraction"] == pytest.approx(0.125)
    assert metrics["comm/dp/bytes_per_step"] == 1000.0
    assert "comm/ep/exposed_fraction" not in metrics  # an axis that saw nothing
    assert metrics["memory/peak_rss_mb"] >= metrics["memory/rss_mb"] > 10
    assert "memory/peak_allocated_mb" not in metrics  # CPU only
    assert metrics["moe/layer1/max_over_mean"] == 3.0
    assert metrics["moe/layer1/dead_experts"] == 2.0
    assert metrics["moe/layer1/bias_norm"] == 5.0
    assert metrics["moe/max_over_mean"] == 3.0 and metrics["moe/dead_experts"] == 2.0
    json.dumps(metrics)  # every value is JSON (lists of floats, floats)


def test_fp32_runs_have_no_loss_scale_and_timers_off_no_comm(processor):
    processor.probes = NO_PROBES
    metrics = processor.collect(_figures(), _window(1.0, 100, 1))
    assert "optim/loss_scale" not in metrics and "loss/mtp" not in metrics
    assert not any(key.startswith("comm/") for key in metrics)
    assert processor.mean_comm_fraction() is None


def test_summary_means_the_comm_fraction_over_windows(processor):
    processor.collect(_figures(), _window(2.0, 1000, 4))
    processor.collect(_figures(), _window(0.75, 1000, 4))  # the same 0.75 s exposed: all of it
    assert processor.mean_comm_fraction() == pytest.approx((0.375 + 1.0) / 2)


def test_profiler_traces_only_the_asked_steps(tmp_path):
    profiler = StepProfiler("2:3", tmp_path, rank=0, device=torch.device("cpu"))
    x = torch.randn(64, 64)
    for step in range(1, 6):
        with profiler.step(step):
            x @ x
        if step == 1:
            assert profiler._profile is None  # nothing recorded before step 2
    assert profiler.written == tmp_path / "rank0.trace.json"
    events = json.loads(profiler.written.read_text())["traceEvents"]
    steps = {e["name"] for e in events if e.get("name", "").startswith("step ")}
    assert steps == {"step 2", "step 3"}
