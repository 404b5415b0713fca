"""The integrity manifest of a checkpoint folder: `manifest.json`, written last, read first.

A DCP folder alone cannot say whether it is complete: a save killed mid-write, a full disk or a
flipped bit leaves files that load into garbage or fail deep inside DCP. So rank 0 writes
`manifest.json` after every rank's shards are on disk, and before the folder is renamed into place:

    {"format": 1, <meta: kind, step, layout, model, ...>,
     "files": {"<relative path>": {"size": bytes, "sha256": hex}}, "total_bytes": bytes}

A checkpoint is valid only when its manifest parses, lists DCP's `.metadata`, and every listed
file is present with its size and (in a full check) its sha256.

Plain Python (no torch), so `dstrain ckpt inspect` and `diff` read checkpoints in milliseconds.
"""

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
FORMAT = 1
NO_MANIFEST = "no manifest.json: written before integrity manifests or interrupted"
HASH_BELOW_BYTES = 2 << 30  # verify(quick=None) hashes checkpoints smaller than this (2 GiB)
_CHUNK = 8 << 20  # bytes hashed per read: large enough to stream at disk speed


@dataclass(frozen=True)
class Verdict:
    ok: bool
    reason: str  # why not, or what was checked ("sha256 checked", "sizes checked")


def write_manifest(folder: Path, meta: dict[str, Any]) -> None:
    """Hash and fsync every file under `folder`, then write `manifest.json` atomically.

    Call it only once every rank's files are complete: the manifest vouches for what it lists.
    """
    paths = _files(folder)
    files, total = {}, 0
    for path in paths:
        size, digest = _hash(path, sync=True)
        files[path.relative_to(folder).as_posix()] = {"size": size, "sha256": digest}
        total += size
    for directory in sorted({folder, *(p.parent for p in paths)}):
        fsync_dir(directory)
    body = {**meta, "format": FORMAT, "files": files, "total_bytes": total}
    # default=str: meta is for people and tools; a Path or a dtype in it should not fail a save
    write_atomic(folder / MANIFEST, json.dumps(body, indent=1, sort_keys=True, default=str) + "\n")


def verify(
    folder: Path, *, quick: bool | None = False, hash_below_bytes: int = HASH_BELOW_BYTES
) -> Verdict:
    """Is `folder` a complete, intact checkpoint?

    quick=False reads every byte and compares sha256; quick=True compares sizes only, which
    catches missing, truncated and half-written files (what a crash or a full disk leaves) but not
    flipped bits; quick=None hashes checkpoints under `hash_below_bytes` and checks the sizes of
    larger ones, so choosing a checkpoint to resume from costs seconds, not the hour it takes to
    read back a DeepSeek-V3 checkpoint (~8 TB of fp32 weights and Adam state).
    """
    manifest, problem = _read(folder)
    if manifest is None:
        return Verdict(False, problem)
    files = manifest["files"]
    if ".metadata" not in files:
        return Verdict(False, "manifest.json does not list DCP's .metadata")
    if quick is None:
        quick = _total(manifest) >= hash_below_bytes
    for rel, expected in sorted(files.items()):
        problem = _check_file(folder / rel, rel, expected, quick)
        if problem:
            return Verdict(False, problem)
    return Verdict(True, "sizes checked" if quick else "sha256 checked")


def read_meta(folder: Path) -> dict[str, Any]:
    """The manifest without its file list: format, kind, step, layout, model, total_bytes...
    Raises ValueError (with the reason) when there is no readable manifest."""
    manifest, problem = _read(folder)
    if manifest is None:
        raise ValueError(f"{folder}: {problem}")
    return {k: v for k, v in manifest.items() if k != "files"}


def write_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` so that a reader sees the old file or the new one, never a part:
    a temporary file, fsync, rename over, fsync of the folder (so the rename survives a crash)."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    """Make a folder's entries (new files, renames) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _files(folder: Path) -> list[Path]:
    skip = {MANIFEST, f".{MANIFEST}.tmp"}
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name not in skip)


def _read(folder: Path) -> tuple[dict[str, Any] | None, str]:
    """The parsed manifest, or None and why not."""
    if not folder.is_dir():
        return None, "not a folder"
    path = folder / MANIFEST
    if not path.is_file():
        return None, NO_MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        return None, f"manifest.json is unreadable ({exc})"
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        return None, "manifest.json has no file list"
    if manifest.get("format") != FORMAT:
        return None, (
            f"manifest.json has format {manifest.get('format')!r}; this dstrain reads 1 (the "
            "checkpoint comes from another dstrain version: resume it with that version)"
        )
    return manifest, ""


def _total(manifest: dict[str, Any]) -> int:
    total = manifest.get("total_bytes")
    if isinstance(total, int):
        return total
    return sum(e.get("size", 0) for e in manifest["files"].values() if isinstance(e, dict))


def _check_file(path: Path, rel: str, expected: Any, quick: bool) -> str:
    """Why the file does not match its manifest entry; "" when it does."""
    if not isinstance(expected, dict) or not {"size", "sha256"} <= expected.keys():
        return f"manifest.json entry for {rel} is malformed"
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return f"{rel} is missing"
    if size != expected["size"]:
        return (
            f"{rel} is {size} bytes, the manifest says {expected['size']} (truncated or rewritten)"
        )
    if quick:
        return ""
    try:
        _, digest = _hash(path)
    except OSError as exc:
        return f"{rel} cannot be read ({exc.strerror or exc})"
    if digest != expected["sha256"]:
        return (
            f"{rel} does not match its sha256 (corrupted): expected {expected['sha256'][:12]}..., "
            f"got {digest[:12]}..."
        )
    return ""


def _hash(path: Path, *, sync: bool = False) -> tuple[int, str]:
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
        if sync:  # DCP fsyncs its own files; this covers anything else in the folder
            os.fsync(f.fileno())
    return size, digest.hexdigest()
