"""The integrity manifest: what it records, and the precise reason each kind of damage gives."""

import json

import pytest

from dstrain.checkpoint.manifest import (
    MANIFEST,
    NO_MANIFEST,
    read_meta,
    verify,
    write_manifest,
)


@pytest.fixture
def ckpt(tmp_path):
    """A folder shaped like a DCP checkpoint (two shards and .metadata, one in a subfolder)."""
    folder = tmp_path / "step-7"
    (folder / "extra").mkdir(parents=True)
    (folder / ".metadata").write_bytes(b"metadata" * 10)
    (folder / "__0_0.distcp").write_bytes(bytes(range(256)) * 40)
    (folder / "extra" / "__1_0.distcp").write_bytes(b"\x01" * 5000)
    write_manifest(folder, {"kind": "full", "step": 7, "layout": {"tp": 2}})
    return folder


def test_roundtrip_records_sizes_hashes_and_meta(ckpt):
    body = json.loads((ckpt / MANIFEST).read_text())
    assert sorted(body["files"]) == [".metadata", "__0_0.distcp", "extra/__1_0.distcp"]
    assert body["files"]["__0_0.distcp"]["size"] == 256 * 40
    assert len(body["files"]["__0_0.distcp"]["sha256"]) == 64
    assert body["total_bytes"] == 80 + 256 * 40 + 5000
    assert verify(ckpt) == verify(ckpt, quick=False)
    assert verify(ckpt).ok and verify(ckpt).reason == "sha256 checked"
    assert verify(ckpt, quick=True).reason == "sizes checked"
    meta = read_meta(ckpt)
    assert meta == {
        "format": 1,
        "kind": "full",
        "step": 7,
        "layout": {"tp": 2},
        "total_bytes": body["total_bytes"],
    }
    assert not list(ckpt.glob(".*.tmp"))  # the atomic write left nothing behind


def test_rewriting_the_manifest_does_not_list_itself(ckpt):
    write_manifest(ckpt, {"step": 8})
    assert MANIFEST not in json.loads((ckpt / MANIFEST).read_text())["files"]
    assert read_meta(ckpt)["step"] == 8 and verify(ckpt).ok


def test_a_flipped_byte_fails_the_full_check_only(ckpt):
    shard = ckpt / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[100] ^= 0x01
    shard.write_bytes(bytes(data))
    verdict = verify(ckpt)
    assert not verdict.ok
    assert verdict.reason.startswith("__0_0.distcp does not match its sha256 (corrupted)")
    assert verify(ckpt, quick=True).ok  # sizes alone cannot see bit rot: the documented trade


def test_a_truncated_file_fails_both_checks(ckpt):
    shard = ckpt / "extra" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:1000])
    for quick in (False, True):
        verdict = verify(ckpt, quick=quick)
        assert not verdict.ok
        assert verdict.reason == (
            "extra/__1_0.distcp is 1000 bytes, the manifest says 5000 (truncated or rewritten)"
        )


def test_a_missing_file(ckpt):
    (ckpt / "__0_0.distcp").unlink()
    assert verify(ckpt, quick=True) == verify(ckpt)
    assert verify(ckpt).reason == "__0_0.distcp is missing"


def test_a_missing_manifest_says_why(ckpt):
    (ckpt / MANIFEST).unlink()
    verdict = verify(ckpt)
    assert not verdict.ok and verdict.reason == NO_MANIFEST
    assert "written before integrity manifests or interrupted" in verdict.reason
    with pytest.raises(ValueError, match="no manifest.json"):
        read_meta(ckpt)


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("{not json", "manifest.json is unreadable"),
        ('{"format": 1}', "manifest.json has no file list"),
        ('{"format": 99, "files": {}}', "manifest.json has format 99; this dstrain reads 1"),
        ('{"format": 1, "files": {}}', "manifest.json does not list DCP's .metadata"),
        ('{"format": 1, "files": {".metadata": 3}}', "entry for .metadata is malformed"),
    ],
)
def test_a_broken_manifest(ckpt, text, reason):
    (ckpt / MANIFEST).write_text(text)
    verdict = verify(ckpt)
    assert not verdict.ok and reason in verdict.reason


def test_not_a_folder(tmp_path):
    assert verify(tmp_path / "nope") == verify(tmp_path / "nope", quick=True)
    assert verify(tmp_path / "nope").reason == "not a folder"


def test_auto_mode_hashes_small_checkpoints_and_sizes_large_ones(ckpt):
    total = read_meta(ckpt)["total_bytes"]
    assert verify(ckpt, quick=None, hash_below_bytes=total + 1).reason == "sha256 checked"
    assert verify(ckpt, quick=None, hash_below_bytes=total).reason == "sizes checked"
    assert verify(ckpt, quick=None).reason == "sha256 checked"  # default threshold: 2 GiB
