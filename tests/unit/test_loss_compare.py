"""`dstrain loss-compare`: matching runs, the first divergence, and unreadable input."""

import json


def _run(folder, losses):
    folder.mkdir(parents=True)
    rows = [{"step": i + 1, "loss/main": v} for i, v in enumerate(losses)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def test_matching_runs(cli, tmp_path):
    a = _run(tmp_path / "a", [7.0, 6.5, 6.0])
    b = _run(tmp_path / "b", [7.0, 6.5 * (1 + 1e-7), 6.0])
    result = cli("loss-compare", a, b)
    assert result.code == 0 and "MATCH" in result.out and "3 common steps" in result.out


def test_first_divergence_is_named(cli, tmp_path):
    a = _run(tmp_path / "a", [7.0, 6.5, 6.0, 5.5])
    b = _run(tmp_path / "b", [7.0, 6.5, 6.1, 5.0])
    result = cli("loss-compare", a, b, "--rtol", "1e-3")
    assert result.code == 1 and "DIVERGED at step 3: 6.0 vs 6.1" in result.out
    data = cli("loss-compare", a, b, "--json").json()
    assert data["first_divergence"] == [3, 6.0, 6.1] and data["matches"] is False


def test_bad_inputs(cli, tmp_path):
    assert cli("loss-compare", tmp_path / "x", tmp_path / "y").code == 2
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "metrics.jsonl").write_text('{"step": 1, "loss/main": 7.0}\n{"step": 2, "lo')
    result = cli("loss-compare", broken, broken)
    assert result.code == 2 and "line 2 is not JSON" in result.err
    other = _run(tmp_path / "other", [1.0])
    assert cli("loss-compare", other, other, "--key", "loss/nope").code == 1
