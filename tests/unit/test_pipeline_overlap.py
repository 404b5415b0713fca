"""DualPipeV's overlapped pairs without processes: the turn taking, the wait hook, the timer, and
which schedules have pairs. (Their parity: tests/distributed/test_pipeline_parity.py.)"""

import threading
import time

import pytest
import torch
import torch.distributed._functional_collectives as funcol

from dstrain.metrics import pipeline_timer
from dstrain.metrics.pipeline_timer import PipelineTimer
from dstrain.parallel import pipeline_overlap
from dstrain.parallel.pipeline_overlap import BACKWARD, FORWARD, Turns
from dstrain.preflight.rules import OVERLAPPED_SCHEDULES


def _run_sides(forward_steps: int, backward_steps: int) -> list[str]:
    """Each side logs a step, then hands over (as at a collective's wait); returns the log."""
    turns, log = Turns(), []

    def side(name: str, steps: int) -> None:
        for i in range(steps):
            log.append(f"{name[0].upper()}{i}")
            turns.hand_over(name)
        turns.end(name)

    def backward() -> None:
        turns.begin(BACKWARD)
        side(BACKWARD, backward_steps)

    helper = threading.Thread(target=backward)
    helper.start()
    side(FORWARD, forward_steps)
    helper.join()
    return log


def test_sides_alternate_at_every_hand_over_and_the_longer_one_finishes_alone():
    # The same interleaving every time: what keeps collectives in one order on every rank.
    for _ in range(5):
        assert _run_sides(3, 3) == ["F0", "B0", "F1", "B1", "F2", "B2"]
        assert _run_sides(1, 3) == ["F0", "B0", "B1", "B2"]
        assert _run_sides(3, 1) == ["F0", "B0", "F1", "F2"]


def test_the_backward_side_is_any_thread_but_the_one_that_made_the_turns():
    turns, seen = Turns(), []
    assert turns.side() == FORWARD
    helper = threading.Thread(target=lambda: seen.append(turns.side()))
    helper.start()
    helper.join()
    assert seen == [BACKWARD]


def test_waits_hand_over_once_even_under_a_wrapper_installed_later(monkeypatch):
    waited = []
    monkeypatch.setattr(funcol, "wait_tensor", lambda t: waited.append(t) or t)
    pipeline_overlap._install()
    ours = funcol.wait_tensor
    later = lambda t: ours(t)  # noqa: E731 (as the communication timer wraps on its start)
    monkeypatch.setattr(funcol, "wait_tensor", later)
    pipeline_overlap._install()  # run_pair does this before every pair
    assert funcol.wait_tensor is not later and funcol.wait_tensor._dstrain_hands_over

    class Counting:
        hand_overs = 0

        def side(self) -> str:
            return FORWARD

        def hand_over(self, side: str) -> None:
            self.hand_overs += 1

    counting = Counting()
    monkeypatch.setattr(pipeline_overlap, "_turns", counting)
    x = torch.ones(2)
    assert funcol.wait_tensor(x) is x
    assert counting.hand_overs == 1 and len(waited) == 1
    monkeypatch.setattr(pipeline_overlap, "_turns", None)
    funcol.wait_tensor(x)
    assert counting.hand_overs == 1 and len(waited) == 2  # no pair in flight: a plain wait


def test_the_pipeline_timer_leaves_out_the_time_a_side_waited_for_its_turn(monkeypatch):
    monkeypatch.setattr(pipeline_timer, "TURN_WAITS", {"forward": 0.0, "backward": 0.0})
    timer = PipelineTimer(None)

    def forward_chunk() -> None:
        time.sleep(0.02)
        pipeline_timer.TURN_WAITS["forward"] += 0.015  # the other side's turn inside the span

    timer._timed(forward_chunk, lambda *a, **k: "F")()
    seconds = timer.window[2].item()
    assert 0.0 < seconds < 0.015, seconds


@pytest.mark.parametrize("name", ["interleaved-1f1b", "zbv", "dualpipev"])
def test_the_schedules_with_overlapped_pairs_are_the_ones_check_names(name):
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops
    from torch.distributed.pipelining.schedules import OVERLAP_F_B

    from dstrain.parallel.pipeline_sim import UPSTREAM_NAMES

    ops = get_schedule_ops(UPSTREAM_NAMES[name], 2, 8, 2)
    paired = any(op is not None and op.computation_type == OVERLAP_F_B for r in ops for op in r)
    assert paired == (name in OVERLAPPED_SCHEDULES)


@pytest.mark.parametrize("pp,m", [(2, 4), (2, 16), (4, 8), (4, 12), (8, 16)])
def test_the_planners_paired_share_is_upstreams_order(pp, m):
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops
    from torch.distributed.pipelining.schedules import OVERLAP_F_B

    from dstrain.planner.layout import Layout

    ops = get_schedule_ops("DualPipeV", pp, m, 2)
    pairs = [sum(op is not None and op.computation_type == OVERLAP_F_B for op in r) for r in ops]
    layout = Layout(dp=1, pp=pp, micro_batch=1, global_batch=m, schedule="dualpipev")
    assert layout.paired_share == min(pairs) / (2 * m)


def test_auto_overlaps_on_cuda_only_and_an_explicit_setting_wins():
    from dstrain.parallel.pipeline_overlap import overlap_pairs

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert overlap_pairs(None, cuda) and not overlap_pairs(None, cpu)
    assert not overlap_pairs(None, None)  # a dry run on meta: nothing to run
    assert overlap_pairs(True, cpu) and not overlap_pairs(False, cuda)
