"""The pipeline timer's accounting, on a fake clock: what counts as compute, what as bubble."""

import dstrain.metrics.pipeline_timer as timer_module
from dstrain.metrics.pipeline_timer import PipelineTimer


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeStage:
    """Advances the fake clock by each action's cost, as a stage's compute would."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock

    def forward_one_chunk(self, chunk, args, kwargs=None):
        self.clock.now += 0.010

    def backward_one_chunk(self, chunk, loss=None, full_backward=True, last_backward=False):
        self.clock.now += 0.020 if full_backward else 0.012

    def backward_weight_one_chunk(self, chunk, last_backward=False):
        self.clock.now += 0.008


def test_bubble_is_the_idle_share_of_the_step(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(timer_module.time, "perf_counter", clock)
    stage = FakeStage(clock)
    timer = PipelineTimer(group=None)
    timer.instrument([stage])
    loss = timer.timed_loss(lambda outputs, labels: clock.__setattr__("now", clock.now + 0.002))
    for _ in range(2):  # two steps in the window
        timer.start()
        stage.forward_one_chunk(0, ())
        loss(None, None)
        clock.now += 0.018  # waiting for the peer: bubble
        stage.backward_one_chunk(0, full_backward=False)
        stage.backward_weight_one_chunk(0)
        timer.stop()
    figures = timer.collect("zbv", microbatches=4, virtual_stages=2)
    # Per step: 10 + 2 + 12 + 8 = 32 ms of compute in a 50 ms interval.
    assert abs(figures["pipeline/bubble_fraction"] - 18 / 50) < 1e-9
    assert abs(figures["pipeline/time_f_ms"] - 10) < 1e-9
    assert abs(figures["pipeline/time_i_ms"] - 12) < 1e-9
    assert abs(figures["pipeline/time_w_ms"] - 8) < 1e-9
    assert "pipeline/time_b_ms" not in figures
    assert figures["pipeline/stage_imbalance"] == 1.0
    assert figures["pipeline/bubble_fraction_theory"] == 0.0  # one rank: no pipeline
    assert timer.mean_bubble() == figures["pipeline/bubble_fraction"]
    assert timer.collect("zbv", 4, 2) == {}  # the window was reset


def test_full_backward_is_b_and_no_theory_needs_w():
    clock = Clock()
    timer = PipelineTimer(group=None)
    stage = FakeStage(clock)
    original = timer_module.time.perf_counter
    timer_module.time.perf_counter = clock
    try:
        timer.instrument([stage])
        timer.start()
        stage.forward_one_chunk(0, ())
        stage.backward_one_chunk(0)
        timer.stop()
    finally:
        timer_module.time.perf_counter = original
    figures = timer.collect("1f1b", microbatches=2, virtual_stages=1)
    assert figures["pipeline/bubble_fraction"] == 0.0
    assert abs(figures["pipeline/time_b_ms"] - 20) < 1e-9
    assert figures["pipeline/bubble_fraction_theory"] == 0.0  # pp 1: no pipeline
