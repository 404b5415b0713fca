"""nccl-tests' size/count columns and bus-bandwidth factors, with n = the group's size."""

from dataclasses import astuple

import pytest
import torch

from dstrain.bench.ops import BUS_FACTORS, bus_factor, count_wrong, layout, pattern
from dstrain.bench.spec import OP_NAMES, check_axis, parse_ops
from dstrain.config.parallel_dims import ParallelDims
from dstrain.errors import UserError


def test_bus_factors_follow_nccl_tests():
    assert bus_factor("all_reduce", 2) == 1.0
    assert bus_factor("all_reduce", 8) == pytest.approx(2 * 7 / 8)
    for op in ("all_gather", "reduce_scatter", "all_to_all"):
        assert bus_factor(op, 4) == pytest.approx(3 / 4)
    assert bus_factor("broadcast", 8) == bus_factor("send_recv", 8) == 1.0
    assert set(OP_NAMES) == set(BUS_FACTORS)


def test_factor_uses_the_group_not_the_world():
    # 4 ranks with tp=2: a tp all_reduce runs on groups of 2, so its factor is 2(2-1)/2 = 1.
    dims = ParallelDims.resolve(dp_replicate=1, dp_shard=-1, cp=1, tp=2, pp=1, ep=1, world_size=4)
    n = check_axis(dims, "tp")
    assert n == 2 and bus_factor("all_reduce", n) == 1.0
    assert check_axis(dims, "dp") == 2


def test_size_column_is_the_full_buffer_and_count_the_call_argument():
    # (bytes, count, input elements, output elements) for 1 MiB of float on 4 ranks
    mib, quarter = 1 << 20, 1 << 16
    assert astuple(layout("all_reduce", mib, 4, 4)) == (mib, 4 * quarter, 4 * quarter, 4 * quarter)
    assert astuple(layout("all_gather", mib, 4, 4)) == (mib, quarter, quarter, 4 * quarter)
    assert astuple(layout("reduce_scatter", mib, 4, 4)) == (mib, quarter, 4 * quarter, quarter)
    assert astuple(layout("all_to_all", mib, 4, 4)) == (mib, quarter, 4 * quarter, 4 * quarter)
    assert astuple(layout("broadcast", mib, 4, 4)) == (mib, 4 * quarter, 4 * quarter, 4 * quarter)
    assert layout("send_recv", 4096, 2, 2).count == 2048  # bf16


def test_split_ops_round_down_to_a_multiple_of_n():
    ag = layout("all_gather", 1000, 3, 4)  # 250 elements -> 83 per rank
    assert (ag.count, ag.bytes) == (83, 83 * 3 * 4)
    assert layout("all_to_all", 8, 4, 4).numel_in == 0  # too small: skipped by the sweep


def test_parse_ops():
    assert parse_ops("all") == OP_NAMES
    assert parse_ops("all", axis="pp") == ("send_recv",)
    assert parse_ops("all_reduce, send_recv,all_reduce") == ("all_reduce", "send_recv")
    with pytest.raises(UserError) as exc:
        parse_ops("allreduce")
    assert "did you mean `all_reduce`" in exc.value.message and "all_gather" in exc.value.fix


def test_an_axis_of_size_one_is_one_clear_error():
    dims = ParallelDims.resolve(dp_replicate=1, dp_shard=-1, cp=1, tp=1, pp=1, ep=1, world_size=2)
    with pytest.raises(UserError) as exc:
        check_axis(dims, "tp")
    assert "1 rank" in exc.value.message and "parallel.tp=2" in exc.value.fix


def test_an_illegal_layout_is_reported_with_its_fix():
    dims = ParallelDims.resolve(dp_replicate=1, dp_shard=1, cp=1, tp=4, pp=1, ep=1, world_size=2)
    with pytest.raises(UserError) as exc:
        check_axis(dims, "tp")
    assert "world size" in exc.value.message and exc.value.fix


def test_wrong_elements_are_counted_per_dtype():
    expected = pattern(1, 10, torch.device("cpu"))  # 2 + (i % 5)
    assert expected[:6].tolist() == [2, 3, 4, 5, 6, 2]
    corrupted = expected.clone()
    corrupted[3] += 1
    assert count_wrong(expected.clone(), expected) == 0
    assert count_wrong(corrupted, expected) == 1
    assert count_wrong(expected.bfloat16(), expected) == 0
