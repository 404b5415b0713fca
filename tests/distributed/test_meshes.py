"""The meshes' process groups: which ranks each axis joins."""

import pytest

from tests.distributed.harness import run_ranks

pytestmark = pytest.mark.slow


def test_axes_group_the_right_ranks(tmp_path):
    ranks = run_ranks(4, "meshes", tmp_path)
    r1 = ranks[1]
    assert r1["dp_shard2_tp2"]["tp"] == [0, 1] and r1["dp_shard2_tp2"]["dp"] == [1, 3]
    # ep borrows the innermost ranks of dp_shard x tp: here the tp pairs.
    assert r1["dp_shard2_tp2_ep2"]["ep"] == [0, 1] and r1["dp_shard2_tp2_ep2"]["efsdp"] == [1, 3]
    hsdp = r1["hsdp2x2_ep2"]
    assert hsdp["dp_shard"] == [0, 1] and hsdp["dp_replicate"] == [1, 3]
    assert hsdp["dp"] == [0, 1, 2, 3] and hsdp["ep"] == [0, 1]
