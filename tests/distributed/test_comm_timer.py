"""comm/exposed_fraction's source: the time a rank blocks in a collective. Rank 1 comes LATE
seconds late to each kind of collective; rank 0 must measure about LATE on the right axis."""

import pytest

from tests.distributed.harness import run_ranks
from tests.distributed.workers.comm_timer import LATE

pytestmark = pytest.mark.slow

CASES = {  # case -> axis it is filed under, bytes rank 0 handed to it
    "blocking": ("world", 4000),
    "async": ("world", 4000),
    "functional": ("tp", 4000),
    "ddp": ("dp", 2 * (8 * 8 + 8) * 4),
}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks(2, "comm_timer", tmp_path_factory.mktemp("comm"))


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_waiting_rank_measures_the_delay(ranks, case):
    axis, size = CASES[case]
    waiting, late = ranks[0][case], ranks[1][case]
    assert LATE * 0.8 <= waiting["exposed"][axis] <= LATE * 2
    assert late["exposed"][axis] < LATE / 3  # the late rank did not wait
    others = {a: s for a, s in waiting["exposed"].items() if a != axis}
    assert sum(others.values()) < 0.05, others
    assert waiting["bytes"][axis] == size


def test_paused_and_unsynchronized_collectives_count_nothing(ranks):
    for case in ("paused", "ddp_no_sync"):
        for rank in ranks:
            assert sum(rank[case]["exposed"].values()) < 0.05, (case, rank[case])
            assert sum(rank[case]["bytes"].values()) == 0, (case, rank[case])
