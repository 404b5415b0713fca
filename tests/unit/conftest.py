"""The unit tier's tensors are tiny: a second intra-op thread only adds wake-up latency (up to
10x slower on a busy 2-core runner), so these tests run single-threaded."""

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
