"""A long wait (checkpoint save or load) shows its progress: the elapsed time and the bytes so
far, and one closing line with the rate."""

import time

from dstrain.train import progress
from dstrain.train.progress import bytes_under, waiting


def test_a_wait_in_a_log_ends_with_its_time_size_and_rate(tmp_path, capsys):
    folder = tmp_path / ".step-3.tmp"
    folder.mkdir()
    with waiting("saving checkpoint step-3", bytes_under(tmp_path, ".step-3.tmp", "step-3")):
        (folder / "shard").write_bytes(b"x" * 3 * 2**20)
        folder.rename(tmp_path / "step-3")  # published under its final name before the end
    err = capsys.readouterr().err
    assert "saving checkpoint step-3:" in err and "3.0 MiB" in err and "MiB/s" in err
    assert err.count("\n") == 1  # a quick wait is one line in a log


def test_a_long_wait_in_a_log_says_it_is_still_going(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(progress, "_LINE_EVERY_S", 0.2)
    with waiting("loading checkpoint step-9"):
        time.sleep(1.2)
    lines = capsys.readouterr().err.splitlines()
    assert any(line.endswith("so far") for line in lines), lines
    assert lines[-1].endswith("done")


def test_other_ranks_stay_quiet(capsys):
    with waiting("saving checkpoint step-1", show=False):
        pass
    assert capsys.readouterr().err == ""
