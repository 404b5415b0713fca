"""The checkpoint store in one process (DCP needs no process group): publishing, choosing the
checkpoint to resume from, pruning, async saves, and failed saves that publish nothing. One
2-rank torchrun launch checks what only several ranks can show."""

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.filesystem import FileSystem

from dstrain.checkpoint import manifest, store
from dstrain.errors import UserError
from tests.distributed.harness import free_port

REPO = Path(__file__).resolve().parents[2]
# Single-process DCP warns that it assumes a single process; the store filters it, pytest resets.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _state(value: float) -> dict:
    return {
        "model": {"w": torch.full((4, 3), value), "b": torch.arange(5.0) + value},
        "train": {"step": int(value), "name": "run", "history": [1, 2, 3]},
    }


def _writer(folder: Path, keep_last_k: int = 0, async_save: bool = False):
    return store.CheckpointWriter(
        folder, keep_last_k=keep_last_k, async_save=async_save, is_main=True
    )


def _published(folder: Path, kind: str = "full") -> list[str]:
    return [p.name for p in store.checkpoints(folder, kind)]


def _leftovers(folder: Path) -> list[Path]:
    return list(folder.rglob(".step-*"))


def test_save_load_roundtrip_with_tensors_and_plain_values(tmp_path):
    writer = _writer(tmp_path)
    path = writer.save(3, _state(3.0), {"tokens_seen": 96, "optimizer": "adamw"})
    writer.close()
    assert path == tmp_path / "step-3" and _published(tmp_path) == ["step-3"]
    state = _state(0.0)
    state["train"] = {"step": 0, "name": "", "history": []}
    store.load(path, state, verify=True)
    assert torch.equal(state["model"]["w"], torch.full((4, 3), 3.0))
    assert torch.equal(state["model"]["b"], torch.arange(5.0) + 3)
    assert state["train"] == {"step": 3, "name": "run", "history": [1, 2, 3]}
    meta = manifest.read_meta(path)
    assert meta["kind"] == "full" and meta["step"] == 3 and meta["tokens_seen"] == 96
    assert (tmp_path / "latest").read_text() == "step-3\n" and not _leftovers(tmp_path)


def test_latest_valid_skips_a_corrupted_newest_checkpoint_and_reports_it(tmp_path):
    writer = _writer(tmp_path)
    for step in (1, 2, 3):
        writer.save(step, _state(step), {})
    shard = next((tmp_path / "step-3").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    (tmp_path / "step-2" / "manifest.json").unlink()  # as written by the first version
    reports: list[str] = []
    assert store.latest_valid(tmp_path, reports.append) == tmp_path / "step-1"
    assert (tmp_path / "latest").read_text().strip() == "step-3"  # the pointer is only a hint
    assert reports == [
        f"skipping {tmp_path / 'step-3'}: {shard.name} does not match its sha256 (corrupted): "
        + reports[0].split("(corrupted): ")[1],
        f"skipping {tmp_path / 'step-2'}: no manifest.json: written before integrity manifests "
        "or interrupted",
    ]
    assert store.latest(tmp_path) == tmp_path / "step-1"  # the first version's name
    with pytest.raises(UserError, match="step-3 is not a valid checkpoint: .* sha256"):
        store.load(tmp_path / "step-3", _state(0.0), verify=True)


def test_an_interrupted_save_is_never_chosen_and_the_next_save_clears_it(tmp_path):
    writer = _writer(tmp_path)
    writer.save(1, _state(1.0), {})
    (tmp_path / ".step-2.tmp").mkdir()  # a crash mid-save
    (tmp_path / ".step-2.tmp" / "__0_0.distcp").write_bytes(b"half")
    assert store.latest_valid(tmp_path) == tmp_path / "step-1"
    writer.save(3, _state(3.0), {})
    assert _published(tmp_path) == ["step-1", "step-3"] and not _leftovers(tmp_path)


def test_keep_last_k_prunes_and_model_only_checkpoints_are_pruned_apart(tmp_path):
    writer = _writer(tmp_path, keep_last_k=2)
    for step in range(1, 6):
        writer.save(step, _state(step), {})
        if step % 2 == 0:
            writer.save(step, {"model": _state(step)["model"]}, {}, kind="model")
    writer.save(6, {"model": _state(6)["model"]}, {}, kind="model")
    assert _published(tmp_path) == ["step-4", "step-5"]
    assert _published(tmp_path, "model") == ["step-4", "step-6"]
    assert (tmp_path / "latest").read_text().strip() == "step-5"
    assert (tmp_path / "model" / "latest").read_text().strip() == "step-6"
    assert manifest.read_meta(tmp_path / "model" / "step-6")["kind"] == "model"
    assert store.latest_valid(tmp_path, kind="model") == tmp_path / "model" / "step-6"


def test_async_saves_stage_a_copy_and_the_second_waits_for_the_first(tmp_path):
    writer = _writer(tmp_path, async_save=True)
    state = _state(1.0)
    assert writer.save(1, state, {"tokens_seen": 1}) == tmp_path / "step-1"
    state["model"]["w"].add_(100.0)  # training goes on at once
    writer.save(2, state, {"tokens_seen": 2})  # waits for step-1 and publishes it first
    assert _published(tmp_path)[0] == "step-1"
    assert writer.wait() == tmp_path / "step-2"  # rank 0 learns what it published
    assert writer.poll() is None and writer.wait() is None
    writer.close()
    assert _published(tmp_path) == ["step-1", "step-2"] and not _leftovers(tmp_path)
    assert all(manifest.verify(tmp_path / f"step-{s}").ok for s in (1, 2))
    first = _state(0.0)
    store.load(tmp_path / "step-1", first)
    assert torch.equal(first["model"]["w"], torch.full((4, 3), 1.0))
    second = _state(0.0)
    store.load(tmp_path / "step-2", second)
    assert torch.equal(second["model"]["w"], torch.full((4, 3), 101.0))


def test_poll_publishes_a_finished_async_save(tmp_path):
    writer = _writer(tmp_path, async_save=True)
    writer.save(1, _state(1.0), {})
    writer._pending.future.result(timeout=60)  # let it finish without wait()
    assert writer.poll() == tmp_path / "step-1"
    assert writer.poll() is None
    writer.close()


def _refuse_writes(monkeypatch, tmp_path: Path) -> None:
    """An unwritable checkpoints folder. Root writes through chmod, so there DCP's mkdir fails
    the way a read-only folder makes it fail."""
    tmp_path.chmod(0o500)
    probe = tmp_path / ".probe"
    try:
        probe.mkdir()
    except PermissionError:
        return
    probe.rmdir()
    tmp_path.chmod(0o700)

    def denied(self, path):
        raise PermissionError(errno.EACCES, "Permission denied", str(path))

    monkeypatch.setattr(FileSystem, "mkdir", denied)


def _no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def _assert_nothing_published(tmp_path: Path) -> None:
    assert _published(tmp_path) == ["step-1"] and not _leftovers(tmp_path)
    assert (tmp_path / "latest").read_text().strip() == "step-1"
    assert store.latest_valid(tmp_path) == tmp_path / "step-1"


def test_a_save_into_an_unwritable_folder_publishes_nothing(tmp_path, monkeypatch):
    writer = _writer(tmp_path)
    writer.save(1, _state(1.0), {})
    _refuse_writes(monkeypatch, tmp_path)
    try:
        with pytest.raises(store.CheckpointSaveError, match="step-2 was not saved: .*denied"):
            writer.save(2, _state(2.0), {})
    finally:
        tmp_path.chmod(0o700)
    _assert_nothing_published(tmp_path)


def test_a_file_where_the_folder_should_be(tmp_path):
    writer = _writer(tmp_path)
    writer.save(1, _state(1.0), {})
    (tmp_path / "model").write_text("in the way")
    with pytest.raises(store.CheckpointSaveError, match="model/step-1 was not saved") as info:
        writer.save(1, {"model": _state(1.0)["model"]}, {}, kind="model")
    assert info.value.exit_code == 1 and "free disk space" in info.value.fix
    _assert_nothing_published(tmp_path)


@pytest.mark.parametrize(
    "where", ["dcp_write", "manifest", "rename", "pointer"], ids=lambda w: f"enospc_{w}"
)
def test_no_space_left_publishes_nothing(tmp_path, monkeypatch, where):
    writer = _writer(tmp_path)
    writer.save(1, _state(1.0), {})
    if where == "dcp_write":
        monkeypatch.setattr(FileSystem, "create_stream", _no_space)
    elif where == "manifest":
        monkeypatch.setattr(manifest, "write_manifest", _no_space)
    elif where == "rename":
        monkeypatch.setattr(store.os, "replace", _no_space)
    else:
        real = manifest.write_atomic
        monkeypatch.setattr(
            manifest,
            "write_atomic",
            lambda path, text: _no_space() if path.name == "latest" else real(path, text),
        )
    with pytest.raises(store.CheckpointSaveError, match="No space left on device"):
        writer.save(2, _state(2.0), {})
    monkeypatch.undo()
    _assert_nothing_published(tmp_path)
    writer.save(3, _state(3.0), {})  # and the writer keeps working once there is space again
    assert store.latest_valid(tmp_path) == tmp_path / "step-3"


def test_an_async_failure_is_raised_by_wait_and_the_next_save_still_runs(tmp_path, monkeypatch):
    writer = _writer(tmp_path, async_save=True)
    writer.save(1, _state(1.0), {})
    writer.wait()
    monkeypatch.setattr(FileSystem, "create_stream", _no_space)
    writer.save(2, _state(2.0), {})
    writer._pending.future.exception(timeout=60)
    assert writer.poll() is None  # poll never raises: ranks poll at different moments
    with pytest.raises(store.CheckpointSaveError, match="step-2 was not saved: .*No space"):
        writer.wait()
    writer.wait()  # raised once
    _assert_nothing_published(tmp_path)
    writer.save(3, _state(3.0), {})  # fails in the background...
    writer._pending.future.exception(timeout=60)
    monkeypatch.undo()
    with pytest.raises(store.CheckpointSaveError, match="step-3 was not saved"):
        writer.save(4, _state(4.0), {})  # ...and the next save raises it, after starting its own
    writer.close()
    assert _published(tmp_path) == ["step-1", "step-4"] and not _leftovers(tmp_path)


def test_a_bug_is_not_disguised_as_a_save_error(tmp_path):
    with pytest.raises(ValueError, match="kind"):
        _writer(tmp_path).save(1, _state(1.0), {}, kind="weights")  # type: ignore[arg-type]


@pytest.mark.slow
def test_two_ranks_publish_async_saves_and_share_failures(tmp_path):
    """One torchrun launch (~6 s): async saves published by rank 0 while training collectives
    run; a failure on rank 0 alone (sync and async) or on rank 1 alone raises on both ranks."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        str(REPO / "tests" / "unit" / "ckpt_ranks_worker.py"),
        str(tmp_path),
    ]
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
    }
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for result in ranks:
        assert result["async"]["step1_value"] == 1.0  # staged before training changed it
        assert result["async"]["valid"] == [True, True]
        assert "step-3 was not saved" in result["rank0_publish_fails_sync"]
        assert "step-4 was not saved" in result["rank0_publish_fails_async"]["wait_raised"]
        assert result["rank0_publish_fails_async"]["step5_valid"]
        assert "step-6 was not saved: [Errno 28]" in result["rank1_write_fails"]
        assert result["published"] == ["step-1", "step-2", "step-5"]
        assert result["leftovers"] == [] and result["latest"] == "step-5"
    assert ranks[0]["async"]["published_by_poll"] == ["step-1"]  # rank 0 publishes
    assert "No space left" in ranks[0]["rank0_publish_fails_sync"]
    assert "another rank failed" in ranks[1]["rank0_publish_fails_sync"]
    assert "another rank failed" in ranks[1]["rank0_publish_fails_async"]["wait_raised"]
