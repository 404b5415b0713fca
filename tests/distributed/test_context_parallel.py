"""Context parallelism at the model (issue 32, first step): cp 2 and cp 4, MLA (with and without
the query bottleneck, with YaRN), GQA and a dense model, against one process on the whole
sequences. The loss summed over the cp ranks, each rank's logits at its positions, and the
gradients summed over the ranks match, fp32: losses 1e-5 relative, logits and gradients 1e-5
of their tensor's largest value. Each rank holds chunks r and 2N-1-r, and so does the same
attention work."""

import pytest

from tests.distributed.harness import run_ranks
from tests.distributed.workers.context_parallel import cases

pytestmark = pytest.mark.slow

CASES = list(cases())


@pytest.fixture(scope="module", params=[2, 4], ids=["cp2", "cp4"])
def ranks(request, tmp_path_factory):
    cp = request.param
    return cp, run_ranks(cp, "context_parallel", tmp_path_factory.mktemp(f"cp{cp}"))


@pytest.mark.parametrize("case", CASES)
def test_matches_one_process(ranks, case):
    cp, results = ranks
    for rank, result in enumerate(results):
        report = result[case]
        print(
            f"cp{cp} {case} rank {rank}: loss {report['loss']:.6f} vs {report['ref_loss']:.6f}, "
            f"logits {report['logits_diff']:.1e}, gradients {report['grad_diff']['rel']:.1e} rel"
        )
        assert abs(report["loss"] - report["ref_loss"]) <= 1e-5 * abs(report["ref_loss"])
        assert report["logits_diff"] <= 1e-5
        assert report["grad_names"] and report["grad_diff"]["rel"] <= 1e-5, report["grad_diff"]


def test_head_tail_chunks_balance_the_work(ranks):
    cp, results = ranks
    chunk = 4
    for rank, result in enumerate(results):
        positions = result["mla"]["positions"]
        head = list(range(rank * chunk, (rank + 1) * chunk))
        tail_start = (2 * cp - 1 - rank) * chunk
        assert positions == head + list(range(tail_start, tail_start + chunk))
    pairs = [r["mla"]["attention_pairs"] for r in results]
    assert len(set(pairs)) == 1, pairs  # the same causal work on every rank
    seq = 2 * cp * chunk
    assert sum(pairs) == seq * (seq + 1) // 2
