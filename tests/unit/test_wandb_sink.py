"""The W&B sink writes an offline run whose history holds what was logged, at the logged steps."""

import json
import os
import struct
import sys
from pathlib import Path

import pytest

from dstrain.errors import UserError
from dstrain.metrics.wandb_sink import WandbSink

BLOCK = 32768  # the .wandb file is a LevelDB-style log: 32 KiB blocks of framed records


def wandb_records(path: Path) -> list[bytes]:
    """The protobuf records of a run-*.wandb file (W&B ships no Python reader for it)."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", "not a .wandb file"
    records, pos, pending = [], 7, b""  # a 7-byte file header, then 7-byte record headers
    while pos + 7 <= len(data):
        if BLOCK - pos % BLOCK < 7:  # a block's tail too short for a header is padding
            pos += BLOCK - pos % BLOCK
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL, or LAST of a record split over blocks
            records.append(pending)
            pending = b""
    return records


def history(path: Path) -> tuple[dict[int, dict[str, object]], list[str]]:
    """({step: {key: value}} from the history records, the record types seen). A step's values
    may also sit in the `partial_history` request the run sent, when the file keeps those."""
    from wandb.proto import wandb_internal_pb2

    rows: dict[int, dict[str, object]] = {}
    kinds = []
    for raw in wandb_records(path):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        kind = record.WhichOneof("record_type")
        if kind == "request":
            kind = f"request.{record.request.WhichOneof('request_type')}"
        kinds.append(kind)
        if kind == "history":
            rows.setdefault(record.history.step.num, {}).update(_items(record.history.item))
        elif kind == "request.partial_history":
            partial = record.request.partial_history
            rows.setdefault(partial.step.num, {}).update(_items(partial.item))
    return rows, kinds


def _items(items) -> dict[str, object]:
    return {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in items}


def test_an_offline_run_holds_the_logged_history(tmp_path):
    pytest.importorskip("wandb")
    sink = WandbSink(tmp_path / "run", run="unit", config={"model": {"dim": 8}})
    for step in (10, 20, 30):
        sink.write(step, {"loss/main": 3.0 - step / 10, "moe/layer1/tokens_per_expert": [3, 0, 5]})
    sink.rewind(10)
    sink.write(20, {"loss/main": 99.0})  # a recomputed step: W&B keeps the first value
    sink.write(40, {"loss/main": 0.5})
    sink.close()

    (run_file,) = (tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb")
    rows, kinds = history(run_file)
    assert sorted(rows) == [10, 20, 30, 40], (run_file.stat().st_size, kinds)
    assert [rows[step]["loss/main"] for step in (10, 20, 30, 40)] == [2.0, 1.0, 0.0, 0.5]
    assert rows[10]["moe/layer1/tokens_per_expert/values"] == [3, 0, 5]
    assert rows[10]["moe/layer1/tokens_per_expert/bins"] == [0, 1, 2, 3]


def test_without_wandb_installed_it_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    with pytest.raises(UserError, match="metrics.wandb") as caught:
        WandbSink(tmp_path, run="unit", config={})
    assert "pip install wandb" in caught.value.fix


def test_a_service_another_process_started_is_not_used(tmp_path, monkeypatch):
    """A token handed down by a launcher that used wandb names the launcher's pid: the sink
    starts a service of its own, so the run survives the launcher."""
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SERVICE", f"3-{os.getppid()}-unix-{tmp_path}/no-such-socket")
    sink = WandbSink(tmp_path / "run", run="unit", config={})
    sink.write(1, {"loss/main": 1.0})
    sink.close()
    # Gone, or (when this test starts wandb here first) naming this process's own service.
    assert os.environ.get("WANDB_SERVICE", f"3-{os.getpid()}").split("-")[1] == str(os.getpid())
    (run_file,) = (tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb")
    assert history(run_file)[0][1]["loss/main"] == 1.0


def test_closing_one_of_two_sinks_leaves_the_other_logging(tmp_path):
    """The last sink to close stops the wandb service (that closes the files); an earlier one
    must not, or the other run would lose what it logs after."""
    pytest.importorskip("wandb")
    first = WandbSink(tmp_path / "first", run="first", config={})
    second = WandbSink(tmp_path / "second", run="second", config={})
    first.write(1, {"loss/main": 1.0})
    first.close()
    second.write(1, {"loss/main": 2.0})
    second.write(2, {"loss/main": 3.0})
    second.close()
    for name, expected in (("first", {1: 1.0}), ("second", {1: 2.0, 2: 3.0})):
        (run_file,) = (tmp_path / name / "wandb").glob("offline-run-*/run-*.wandb")
        rows = history(run_file)[0]
        assert {step: row["loss/main"] for step, row in rows.items()} == expected
