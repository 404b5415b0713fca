"""The closed-form bubbles of dstrain.planner.bubble: pure arithmetic, no torch."""

import subprocess
import sys

import pytest

from dstrain.planner.bubble import SCHEDULES, Costs, stages_per_rank, theoretical_bubble


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_one_rank_has_no_bubble(schedule):
    assert theoretical_bubble(schedule, 1, 8, 2, Costs(1, 2, 3)) == 0.0


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_fill_drain_schedules_lose_p_minus_1_slots_whatever_the_costs(schedule):
    for costs in (Costs(), Costs(1, 2, 0), Costs(3, 1, 1)):
        assert theoretical_bubble(schedule, 4, 8, costs=costs) == pytest.approx(3 / 11)


def test_interleaving_shrinks_the_bubble_v_fold():
    assert theoretical_bubble("interleaved-1f1b", 4, 8, 2) == pytest.approx(3 / 19)
    assert theoretical_bubble("interleaved-1f1b", 4, 8, 3) == pytest.approx(3 / 27)


def test_v_shapes_follow_the_dualpipe_table_rows():
    p, m = 4, 8
    # F=1, full backward 2, W=1: ZB1P (p-1)(F+B-2W) = 3, DualPipeV (p-1)(F+2B-3W) = 6.
    assert theoretical_bubble("zbv", p, m) == pytest.approx(3 / (3 + 2 * m * 3))
    assert theoretical_bubble("dualpipev", p, m) == pytest.approx(6 / (6 + 2 * m * 3))
    costs = Costs(forward=2, backward=1.5, weight=0.5)  # full backward 2
    assert theoretical_bubble("zbv", p, m, costs=costs) == pytest.approx(9 / (9 + 2 * m * 4))


def test_weight_work_larger_than_the_bubble_clamps_to_zero():
    assert theoretical_bubble("zbv", 4, 8, costs=Costs(1, 0.5, 3)) == 0.0
    assert theoretical_bubble("dualpipev", 4, 8, costs=Costs(1, 0.5, 3)) == 0.0


def test_v_shapes_always_hold_two_stages_per_rank():
    assert stages_per_rank("zbv", 5) == stages_per_rank("dualpipev") == 2
    assert stages_per_rank("interleaved-1f1b", 3) == 3
    assert stages_per_rank("1f1b", 4) == 1
    assert theoretical_bubble("zbv", 4, 8, 7) == theoretical_bubble("zbv", 4, 8)


def test_bad_input_is_a_value_error():
    with pytest.raises(ValueError, match="unknown schedule"):
        theoretical_bubble("pipedream", 4, 8)
    with pytest.raises(ValueError, match=">= 1"):
        theoretical_bubble("1f1b", 0, 8)
    with pytest.raises(ValueError, match=">= 0"):
        Costs(forward=-1)


def test_importable_without_torch():
    code = "import sys, dstrain.planner.bubble; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
