"""The schedule simulator: upstream's orders, the event-driven replay, and agreement with the
closed forms of dstrain.planner.bubble."""

from collections import Counter

import pytest
from torch.distributed.pipelining.schedules import _Action, _ComputationType

from dstrain.parallel.pipeline_sim import (
    Action,
    ShapeError,
    _compute,
    schedule_actions,
    simulate,
)
from dstrain.planner.bubble import SCHEDULES, Costs, theoretical_bubble

UNIFORM = Costs(forward=1, backward=1, weight=1)  # F = 1, full backward B + W = 2
SHAPES = [(2, 4), (2, 8), (4, 8), (4, 16)]


def _stages(schedule: str, pp: int) -> int:
    return pp * (1 if schedule in ("gpipe", "1f1b") else 2)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize(("pp", "m"), SHAPES)
def test_every_forward_and_backward_runs_exactly_once(schedule, pp, m):
    actions = schedule_actions(schedule, pp, m, 2)
    runs = Counter((a.stage, a.microbatch, a.kind) for rank in actions for a in rank)
    expected = {(stage, mb) for stage in range(_stages(schedule, pp)) for mb in range(m)}
    assert {(stage, mb) for stage, mb, _ in runs} == expected
    assert set(runs.values()) == {1}
    for stage, mb in expected:
        assert runs[(stage, mb, "F")] == 1
        # one backward: a full B, or its input-gradient half I and its weight-gradient half W
        assert runs[(stage, mb, "B")] + runs[(stage, mb, "I")] == 1
        assert runs[(stage, mb, "W")] == runs[(stage, mb, "I")]


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
@pytest.mark.parametrize("pp", [2, 4])
def test_v_shapes_place_stages_r_and_2p_minus_1_minus_r(schedule, pp):
    actions = schedule_actions(schedule, pp, 4 * pp)
    for rank, acts in enumerate(actions):
        assert {a.stage for a in acts} == {rank, 2 * pp - 1 - rank}
    assert simulate(actions, UNIFORM).stages == [(r, 2 * pp - 1 - r) for r in range(pp)]


def test_interleaved_places_stage_s_on_rank_s_mod_p():
    for rank, acts in enumerate(schedule_actions("interleaved-1f1b", 4, 8, 3)):
        assert {a.stage for a in acts} == {rank, rank + 4, rank + 8}


def test_1f1b_is_what_the_runtime_executes():
    # Upstream's descriptive order shows F1..F4 on the last rank; the runtime runs F0..F3.
    last = schedule_actions("1f1b", 2, 4)[1]
    assert [str(a) for a in last] == ["1F0", "1B0", "1F1", "1B1", "1F2", "1B2", "1F3", "1B3"]
    first = schedule_actions("1f1b", 2, 4)[0]
    assert [str(a) for a in first] == ["0F0", "0F1", "0B0", "0F2", "0B1", "0F3", "0B2", "0B3"]


def test_overlapped_forward_backward_becomes_its_parts_in_order():
    f, b = _ComputationType.FORWARD, _ComputationType.FULL_BACKWARD
    overlap = _Action(-1, _ComputationType.OVERLAP_F_B, None, (_Action(0, f, 3), _Action(7, b, 1)))
    assert _compute(overlap) == [Action(0, "F", 3), Action(7, "B", 1)]
    assert _compute(_Action(0, _ComputationType.REDUCE_GRAD, None)) == []


@pytest.mark.parametrize(
    ("schedule", "v"), [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("interleaved-1f1b", 3)]
)
@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("factor", [1, 2, 4, 8])
def test_simulated_bubble_is_the_closed_form(schedule, v, pp, factor):
    m = factor * pp
    timeline = simulate(schedule_actions(schedule, pp, m, v), UNIFORM)
    expected = theoretical_bubble(schedule, pp, m, v, UNIFORM)
    assert timeline.bubble_fraction == pytest.approx(expected, abs=1e-12, rel=0)


@pytest.mark.parametrize(
    ("pp", "m", "v"), [(2, 3, 2), (4, 5, 2), (4, 6, 3), (4, 10, 2), (8, 10, 3)]
)
def test_interleaved_rounds_that_do_not_divide_by_p_still_meet_the_closed_form(pp, m, v):
    # Upstream relaxes Megatron's m % p == 0 to whole rounds of m // p; the bubble still holds.
    timeline = simulate(schedule_actions("interleaved-1f1b", pp, m, v), UNIFORM)
    expected = theoretical_bubble("interleaved-1f1b", pp, m, v)
    assert timeline.bubble_fraction == pytest.approx(expected, abs=1e-12, rel=0)


@pytest.mark.parametrize(("pp", "m", "v"), [(4, 2, 2), (4, 3, 2), (4, 2, 3), (8, 5, 4)])
def test_interleaved_with_fewer_microbatches_than_ranks_waits_once_per_chunk(pp, m, v):
    # Megatron's (p-1)/(vm+p-1) assumes m >= p. With fewer, each chunk's wave must cross all p
    # ranks before the next chunk starts: the step takes v*p + m - 1 slots of F+B, not v*m + p - 1.
    timeline = simulate(schedule_actions("interleaved-1f1b", pp, m, v), UNIFORM)
    assert timeline.bubble_fraction == pytest.approx(1 - v * m / (v * pp + m - 1), abs=1e-12)
    assert timeline.bubble_fraction > theoretical_bubble("interleaved-1f1b", pp, m, v)


@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("factor", [2, 4, 8])
def test_v_shapes_with_uniform_costs(pp, factor):
    m = factor * pp
    zbv = simulate(schedule_actions("zbv", pp, m), UNIFORM).bubble_fraction
    dualpipev = simulate(schedule_actions("dualpipev", pp, m), UNIFORM).bubble_fraction
    assert zbv == pytest.approx(theoretical_bubble("zbv", pp, m), abs=1e-12)
    # On one stream (no F&B overlap) upstream's DualPipeV order idles (p-1) x F per rank, as ZBV:
    # half of the table's (p-1)(F&B + B - 3W).
    assert dualpipev == pytest.approx(zbv, abs=1e-12)
    assert dualpipev < theoretical_bubble("dualpipev", pp, m)


def test_peak_inflight_1f1b_holds_min_p_m_gpipe_holds_m():
    for pp, m in [(2, 2), (4, 4), (4, 16)]:
        assert simulate(schedule_actions("1f1b", pp, m), UNIFORM).peak_inflight == [
            min(pp, m) - r for r in range(pp)
        ]
    for pp, m in [(4, 2), (4, 16)]:
        assert simulate(schedule_actions("gpipe", pp, m), UNIFORM).peak_inflight == [m] * pp


def test_split_backward_holds_activations_until_w():
    actions = [[Action(0, "F", 0), Action(0, "I", 0), Action(0, "F", 1), Action(0, "W", 0)]]
    actions[0] += [Action(0, "I", 1), Action(0, "W", 1)]
    assert simulate(actions, UNIFORM).peak_inflight == [2]


def test_p2p_latency_is_paid_on_every_hop_between_ranks():
    pp, m, x = 4, 8, 0.25
    timeline = simulate(schedule_actions("gpipe", pp, m), UNIFORM, p2p=x)
    assert timeline.makespan == pytest.approx((m + pp - 1) * 3 + 2 * (pp - 1) * x)
    # The V's turn (stage p-1 to p) stays on one rank: one rank pays nothing.
    one_rank = schedule_actions("zbv", 1, 4)
    assert simulate(one_rank, UNIFORM, p2p=5).makespan == simulate(one_rank, UNIFORM).makespan


def test_deadlocked_order_is_reported():
    bad = [
        [Action(0, "F", 0), Action(0, "B", 0)],
        [Action(1, "B", 0), Action(1, "F", 0)],  # backward before its own forward
    ]
    with pytest.raises(ValueError, match="deadlock.*1B0"):
        simulate(bad, UNIFORM)


def test_missing_stage_is_reported():
    with pytest.raises(ValueError, match="stage 0"):
        simulate([[Action(1, "F", 0), Action(1, "B", 0)]], UNIFORM)


@pytest.mark.parametrize(
    ("schedule", "pp", "m", "v", "fix"),
    [
        ("1f1b", 4, 2, 1, ">= 4 micro-batches"),
        ("interleaved-1f1b", 2, 5, 2, "use 6 micro-batches"),
        ("interleaved-1f1b", 2, 4, 1, "virtual stages >= 2"),
        ("dualpipev", 4, 6, 2, ">= 8 micro-batches"),
        ("gpipe", 0, 4, 1, ">= 1"),
    ],
)
def test_shapes_upstream_refuses_name_the_fix(schedule, pp, m, v, fix):
    with pytest.raises(ShapeError) as caught:
        schedule_actions(schedule, pp, m, v)
    assert fix in caught.value.fix
