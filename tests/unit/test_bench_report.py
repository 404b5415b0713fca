"""The report from every rank's records: nccl-tests' columns, stragglers, pass/fail, the text."""

import pytest

from dstrain.bench import results
from dstrain.bench.table import format_time, op_table, render


def _records(times_per_rank, wrong=0, tflops=(1.0, 1.0)):
    """Records of ranks with these seconds per call for one all_reduce size."""
    return [
        {
            "rank": r,
            "host": f"node{r // 2}",
            "pid": 100 + r,
            "device": "cpu",
            "group": [0, 1],
            "ops": {"all_reduce": [{"time_s": t, "wrong": wrong}]},
            "gemm_tflops": tflops[r % len(tflops)],
        }
        for r, t in enumerate(times_per_rank)
    ]


SIZE = {"bytes": 1 << 20, "count": 1 << 18, "numel_in": 1 << 18, "numel_out": 1 << 18}


def _rows(records, factor=1.0, ratio=1.2):
    return results.op_rows(
        "all_reduce", [SIZE], records, dtype="float", factor=factor, redop="sum", root=-1,
        ratio=ratio,
    )  # fmt: skip


def test_time_is_the_mean_over_ranks_and_bandwidths_follow_it():
    (row,) = _rows(_records([1e-3, 3e-3]), factor=1.5)
    assert row["time_us"] == pytest.approx(2000)
    assert row["algbw"] == pytest.approx((1 << 20) / 2e-3 / 1e9)
    assert row["busbw"] == pytest.approx(1.5 * row["algbw"])
    assert row["rank_time_us"] == pytest.approx([1000, 3000])


def test_a_rank_above_ratio_times_the_median_is_a_straggler():
    assert results.find_stragglers([1.0, 1.0, 1.0, 1.3], ratio=1.2) == [3]
    assert results.find_stragglers([1.0, 1.1, 1.0, 1.19], ratio=1.2) == []
    (row,) = _rows(_records([1.0, 1.0, 1.0, 2.0]))
    assert row["stragglers"] == [{"rank": 3, "host": "node1", "ratio": pytest.approx(2.0)}]
    summary = results.straggler_summary({"all_reduce": [row]})
    assert summary[0]["rank"] == 3 and summary[0]["sizes"] == 1 and summary[0]["of_sizes"] == 1


def test_slow_gemm_devices_are_flagged():
    gemm = results.gemm_summary(_records([1, 1, 1, 1], tflops=(10, 10, 10, 5)), ratio=1.2)
    assert gemm["median_tflops"] == 10 and [s["rank"] for s in gemm["slow"]] == [3]


def test_min_busbw_is_checked_at_the_largest_size():
    small = {"bytes": 1024, "busbw": 0.01, "wrong": 0}
    large = {"bytes": 1 << 26, "busbw": 2.0, "wrong": 0}
    assert results.verdict({"all_reduce": [small, large]}, 1.5)["passed"]
    failed = results.verdict({"all_reduce": [small, large]}, 3.0)
    assert not failed["passed"] and "below --min-busbw 3" in failed["failures"][0]
    assert "doctor" in failed["fix"]
    assert results.verdict({"all_reduce": [large]}, None)["passed"]


def test_wrong_results_always_fail():
    bad = results.verdict({"all_gather": [{"bytes": 1024, "busbw": 9.0, "wrong": 3}]}, None)
    assert not bad["passed"] and bad["failures"] == ["all_gather: 3 wrong elements"]


def test_time_format_is_nccl_tests():
    assert format_time(12.345) == "  12.35"
    assert format_time(123.45) == "  123.5"
    assert format_time(12345.6) == "  12346"


def test_op_table_columns_and_footer():
    rows = _rows(_records([1e-3, 1e-3]))
    lines = op_table("all_reduce", rows)
    assert lines[1].split() == [
        "#", "size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong"
    ]  # fmt: skip
    assert lines[3].split() == ["1048576", "262144", "float", "sum", "-1", "1000.0", "1.05",
                                "1.05", "0"]  # fmt: skip
    assert lines[-2] == "# Out of bounds values : 0 OK"
    assert lines[-1].startswith("# Avg bus bandwidth    : 1.04858")


def _report(records, min_busbw=None):
    ops = {"all_reduce": _rows(records)}
    return {
        "world_size": len(records),
        "backend": "gloo",
        "device": "cpu",
        "axis": "tp",
        "layout": "tp2 = 2 ranks",
        "group_size": 2,
        "groups": [[0, 1]],
        "warmup": None,
        "iters": 20,
        "straggler_ratio": 1.2,
        "ranks": records,
        "ops": ops,
        "stragglers": results.straggler_summary(ops),
        "gemm": {"dtype": "fp32", "size": 1024, "peak_tflops": None}
        | results.gemm_summary(records, 1.2),
    } | results.verdict(ops, min_busbw)


def test_render_names_stragglers_gemm_and_the_verdict():
    text = render(_report(_records([1e-3, 1e-3, 1e-3, 5e-3], tflops=(2, 2, 2, 1)), 100.0))
    assert "axis tp of tp2 = 2 ranks" in text and "n=2" in text
    assert "#   all_reduce: rank 3 (node1) at 1 of 1 sizes, worst" in text
    assert "slow device: rank 3 (node1)" in text
    assert "# Result: FAIL" in text and "fix:" in text
    assert all(line == line.rstrip() for line in text.splitlines())


def test_render_ok():
    text = render(_report(_records([1e-3, 1e-3])))
    assert "Stragglers (a rank's own time > 1.2x the median of the ranks): none" in text
    assert "# Result: OK" in text
