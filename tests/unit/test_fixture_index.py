"""The fixture tests' bookkeeping: a sample listed as misjudged runs as a strict xfail, so the
fix that makes it pass fails the suite until it leaves the list (today both lists are empty:
every sample is judged right, and this test keeps the mechanism honest for the next one)."""

from tests.fixture_index import sample_params


def test_a_misjudged_sample_is_a_strict_xfail_and_the_others_are_plain():
    samples = {"valid/a.json": {}, "valid/b.json": {}, "broken/c.json": {}}
    params = sample_params(samples, "valid", {"valid/b.json": "passes when it should not"})
    assert [p.id for p in params] == ["a", "b"]
    plain, misjudged = params
    assert not plain.marks
    (mark,) = misjudged.marks
    assert mark.name == "xfail" and mark.kwargs["strict"] is True
    assert "passes when it should not" in mark.kwargs["reason"]
