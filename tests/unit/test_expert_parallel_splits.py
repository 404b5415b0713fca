"""The expert-parallel dispatch's host-side arithmetic, without ranks: the balanced routing's
split sizes (dry runs and benchmarks route as if perfectly balanced) and the permutation that
re-sorts received rows by local expert."""

import itertools

import pytest
import torch

from dstrain.parallel.expert_parallel import _balanced_splits, _by_local_expert


@pytest.mark.parametrize(("T", "W", "L"), itertools.product([1, 7, 16, 30], [1, 2, 3, 4], [1, 3]))
def test_balanced_splits_are_as_even_as_whole_rows_allow(T, W, L):
    recv_WL, send_W, recv_W, sizes_L = _balanced_splits(torch.zeros(T, 4), W, L)
    assert sum(send_W) == T and max(send_W) - min(send_W) <= 1
    assert send_W == sorted(send_W, reverse=True)  # the remainder goes to the first ranks
    assert recv_W == send_W  # every rank routes the same way: it receives what it sends
    assert recv_WL.shape == (W, L) and recv_WL.sum(1).tolist() == send_W
    for row in recv_WL.tolist():
        assert max(row) - min(row) <= 1
    assert sizes_L == recv_WL.sum(0).tolist() and sum(sizes_L) == T


def test_received_rows_are_grouped_by_local_expert_keeping_the_source_order():
    # rank 0 sent 2 rows for expert 0 and 1 for expert 1; rank 1 sent 1 and 3
    recv_WL = torch.tensor([[2, 1], [1, 3]])
    expert = [0, 0, 1, 0, 1, 1, 1]  # the received rows' local experts, as they arrive
    order, inverse = _by_local_expert(recv_WL, 7)
    assert order.tolist() == [0, 1, 3, 2, 4, 5, 6]  # expert 0's rows, then 1's, each in order
    assert [expert[i] for i in order.tolist()] == sorted(expert)
    assert order[inverse].tolist() == list(range(7))
