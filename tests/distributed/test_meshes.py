"""The meshes' process groups: which ranks each axis joins."""

import pytest

from tests.distributed.harness import run_ranks

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks(4, "meshes", tmp_path_factory.mktemp("meshes"))


def test_axes_group_the_right_ranks(ranks):
    r1 = ranks[1]
    assert r1["dp_shard2_tp2"]["tp"] == [0, 1] and r1["dp_shard2_tp2"]["dp"] == [1, 3]
    # ep borrows the innermost ranks of dp_shard x tp: here the tp pairs.
    assert r1["dp_shard2_tp2_ep2"]["ep"] == [0, 1] and r1["dp_shard2_tp2_ep2"]["efsdp"] == [1, 3]
    hsdp = r1["hsdp2x2_ep2"]
    assert hsdp["dp_shard"] == [0, 1] and hsdp["dp_replicate"] == [1, 3]
    assert hsdp["dp"] == [0, 1, 2, 3] and hsdp["ep"] == [0, 1]


def test_a_peer_stuck_outside_a_sub_group_collective_is_timed_out_by_comm_timeout(ranks):
    """torch gives sub-groups their backend's default timeout (30 min for gloo), not the world
    group's; the meshes set theirs (2 s here), so the waiting ranks fail in seconds."""
    waits = [r["stalled_ep_wait_s"] for r in ranks if r["stalled_ep_wait_s"] is not None]
    assert len(waits) == 2, ranks
    assert all(1.5 <= wait < 8 for wait in waits), waits
