"""`bench comm` on 4 gloo ranks: every op runs and is correct, the size/count columns and the
bus factors use the size of the group that ran, and the axis mode runs every group at once."""

import pytest

from dstrain.bench.ops import bus_factor
from dstrain.bench.spec import OP_NAMES
from tests.distributed.harness import run_ranks

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    ranks = run_ranks(4, "bench_comm", tmp_path_factory.mktemp("bench"))
    assert all(r[name] is None for r in ranks[1:] for name in r)  # only rank 0 reports
    return ranks[0]


def _check_rows(report, n):
    for op, rows in report["ops"].items():
        assert [row["wrong"] for row in rows] == [0] * len(rows), op
        for row in rows:
            assert row["busbw"] == pytest.approx(row["algbw"] * bus_factor(op, n))
            assert row["algbw"] == pytest.approx(row["bytes"] / row["time_us"] / 1e3)
            assert len(row["rank_time_us"]) == 4 and row["time_us"] > 0


def test_every_op_on_the_world(reports):
    world = reports["world"]
    assert list(world["ops"]) == list(OP_NAMES) and world["group_size"] == 4
    assert world["passed"] and world["groups"] == [[0, 1, 2, 3]]
    _check_rows(world, 4)
    ag = world["ops"]["all_gather"][0]  # 1K of float on 4 ranks: 64 elements per rank
    assert (ag["bytes"], ag["count"]) == (1024, 64)
    assert world["ops"]["all_reduce"][0]["count"] == 256
    assert world["ops"]["broadcast"][0]["root"] == 0
    assert len(world["gemm"]["tflops"]) == 4 and min(world["gemm"]["tflops"]) > 0


def test_tp_axis_runs_both_groups_with_n_2(reports):
    tp = reports["tp"]
    assert tp["group_size"] == 2 and tp["groups"] == [[0, 1], [2, 3]]
    _check_rows(tp, 2)
    assert tp["ops"]["all_gather"][0]["count"] == 128  # 1K over 2 ranks, not 4
    assert bus_factor("all_reduce", 2) == 1.0


def test_pp_axis_sends_between_consecutive_stages(reports):
    pp = reports["pp"]
    assert list(pp["ops"]) == ["send_recv"] and pp["groups"] == [[0, 2], [1, 3]]
    _check_rows(pp, 2)


def test_bf16_and_min_busbw_failure(reports):
    bf16 = reports["bf16"]
    _check_rows(bf16, 4)
    assert bf16["ops"]["all_reduce"][0]["count"] == 512 and bf16["dtype"] == "bfloat16"
    assert not bf16["passed"] and len(bf16["failures"]) == 2
