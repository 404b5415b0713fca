"""Tokenizing once per cache: on 4 ranks posing as 2 nodes, `shared` has rank 0 build and every
other rank wait for it; `node` has local rank 0 of each node build for its node; a builder's bad
input reaches every rank as the same message (no rank hangs or tokenizes on its own)."""

import pytest

from tests.distributed.harness import run_ranks

pytestmark = pytest.mark.slow


def test_one_builder_per_cache_and_the_others_wait(tmp_path):
    ranks = run_ranks(4, "data_once", tmp_path, timeout=300)
    assert [r["shared"]["builder"] for r in ranks] == [0, 0, 0, 0]
    assert [r["node"]["builder"] for r in ranks] == [0, 0, 2, 2]
    for scope, builders in (("shared", {0}), ("node", {0, 2})):
        for rank, result in enumerate(ranks):
            if rank in builders:
                assert result[scope] == {"builder": rank, "built": True}
            else:
                assert result[scope]["saw_marker"] is True, (scope, rank, result)
    assert sorted(p.name for p in tmp_path.glob("*-built-by-*")) == [
        "node-built-by-0",
        "node-built-by-2",
        "shared-built-by-0",
    ]
    expected = ["data.source x.jsonl:3: malformed JSON", "fix the line", 1]
    assert [r["bad"] for r in ranks] == [expected] * 4
