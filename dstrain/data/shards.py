"""Tokenize once into memory-mapped shards; every later run (and every rank) just maps them.

On disk (see docs/data.md): a directory with `manifest.json`, the flat token stream split into
`shard-00000.bin`, `shard-00001.bin`, ... (raw little-endian uint16, or uint32 when the vocabulary
exceeds 65536 ids), and for BPE the `tokenizer.json` that produced it. Each document is followed by
EOS (and preceded by BOS where the tokenizer has one). Instruction data (`data/instructions.py`)
adds `shard-00000.mask` ..., one uint8 per token: 1 where the token carries loss as a target.
Directories are written under a temporary name and renamed into place, so a reader never sees a
half-written one.
"""

import json
import os
import shutil
import sys
import tempfile
from bisect import bisect_right
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dstrain.data.corpus import Corpus
from dstrain.data.instructions import pieces, render
from dstrain.data.progress import TokenizeProgress
from dstrain.data.readers import Piece
from dstrain.data.tokenizer import BPETokenizer, ByteTokenizer, Tokenizer, write_atomic
from dstrain.errors import UserError

FORMAT = "dstrain-shards"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
TOKENIZER_FILE = "tokenizer.json"
# 2**27 tokens = 256 MiB per uint16 shard: few files, each comfortably below filesystem limits.
SHARD_TOKENS = 1 << 27
# Documents per encode_batch call: enough to keep the Rust threads busy, little memory.
_ENCODE_BATCH_DOCS = 256
# Called after each tokenized batch with (its bytes of text, its tokens).
Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class Manifest:
    """The contents of `manifest.json`."""

    dtype: str
    tokenizer: str
    tokenizer_fingerprint: str
    vocab_size: int
    eos_id: int
    fingerprint: str
    num_documents: int
    total_tokens: int
    shards: list[dict[str, Any]]  # [{"file": "shard-00000.bin", "num_tokens": int}, ...]
    format: str = FORMAT
    version: int = FORMAT_VERSION
    loss_mask: bool = False  # a .mask file beside each shard (instruction data)


class Shards:
    """The read side: one shard directory's token stream, memory-mapped."""

    def __init__(self, directory: Path, manifest: Manifest) -> None:
        self.directory = directory
        self.manifest = manifest
        self.total_tokens = manifest.total_tokens
        self._maps = [
            np.memmap(directory / s["file"], dtype=_dtype(manifest.dtype), mode="r")
            for s in manifest.shards
        ]
        self._starts = np.cumsum([0] + [s["num_tokens"] for s in manifest.shards]).tolist()
        self._masks = (
            [
                np.memmap(directory / _mask_file(s["file"]), dtype=np.uint8, mode="r")
                for s in manifest.shards
            ]
            if manifest.loss_mask
            else None
        )

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens `[start, stop)` of the flat stream; a view of the map unless it spans shards."""
        return _read(self._maps, self._starts, start, stop)

    def read_mask(self, start: int, stop: int) -> np.ndarray | None:
        """Whether each token of `[start, stop)` carries loss as a target; None: every one."""
        return None if self._masks is None else _read(self._masks, self._starts, start, stop)

    def tokenizer(self) -> Tokenizer:
        """The tokenizer these shards were written with."""
        if self.manifest.tokenizer == ByteTokenizer.name:
            return ByteTokenizer()
        path = self.directory / TOKENIZER_FILE
        if not path.exists():
            raise UserError(
                f"{self.directory}: tokenizer `{self.manifest.tokenizer}` has no {TOKENIZER_FILE}",
                fix="re-create the shards with dstrain (it stores the BPE tokenizer beside them)",
            )
        return BPETokenizer.load(path, self.manifest.tokenizer, self.manifest.eos_id)


def _read(maps: list[np.ndarray], starts: list[int], start: int, stop: int) -> np.ndarray:
    shard = bisect_right(starts, start) - 1
    offset = starts[shard]
    if stop <= starts[shard + 1]:
        return maps[shard][start - offset : stop - offset]
    head = maps[shard][start - offset :]
    return np.concatenate([head, _read(maps, starts, starts[shard + 1], stop)])


def _mask_file(shard_file: str) -> str:
    return shard_file.removesuffix(".bin") + ".mask"


def is_shard_dir(path: Path) -> bool:
    """Whether `path` is a directory holding a dstrain `manifest.json`."""
    try:
        return json.loads((path / MANIFEST).read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def open_shards(directory: Path) -> Shards:
    """Pre-tokenized shards given as `data.source`; UserError if they are not usable."""
    try:
        manifest = _read_manifest(directory)
        _check_files(directory, manifest)
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise UserError(
            f"{directory} is not a usable dstrain shard directory: {exc}",
            fix="point data.source at the original text instead, to tokenize it again",
        ) from None
    return Shards(directory, manifest)


def build_shards(
    corpus: Corpus,
    tokenizer: Tokenizer,
    cache_dir: Path,
    *,
    shard_tokens: int = SHARD_TOKENS,
    progress: Progress | None = None,
) -> Shards:
    """The shards of `corpus` under `cache_dir/shards/<tokenizer>-<fingerprint[:16]>/`: reused
    when their manifest matches this corpus and tokenizer, else written (atomically), streaming:
    one batch of text and its tokens in memory at a time. `progress`: told of each batch (by
    default a `TokenizeProgress` bar on stderr)."""
    root = Path(cache_dir) / "shards"
    directory = root / f"{tokenizer.name}-{corpus.fingerprint[:16]}"
    existing = _open_current(directory, corpus, tokenizer)
    if existing is not None:
        return existing
    print(f"dstrain: tokenizing {corpus.name} -> {directory}", file=sys.stderr)
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".tmp-{directory.name}-"))
    tmp.chmod(0o755)  # mkdtemp makes it private; the shards are read by every rank's process
    bar = TokenizeProgress(corpus.name, corpus.num_bytes) if progress is None else None
    try:
        manifest = _write(corpus, tokenizer, tmp, shard_tokens, progress or bar)
        _publish(tmp, directory, corpus, tokenizer)
    finally:
        if bar is not None:
            bar.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return Shards(directory, manifest)


def _write(
    corpus: Corpus,
    tokenizer: Tokenizer,
    directory: Path,
    shard_tokens: int,
    progress: Progress | None,
) -> Manifest:
    dtype = "uint16" if tokenizer.vocab_size <= 1 << 16 else "uint32"
    writer = _ShardWriter(directory, _dtype(dtype), shard_tokens, masks=corpus.chat)
    num_documents = 0
    for batch, num_bytes in corpus.batches(_ENCODE_BATCH_DOCS):
        encoded = _encode_chat(batch, tokenizer) if corpus.chat else _encode_text(batch, tokenizer)
        tokens = np.array(encoded[0], dtype=_dtype(dtype))
        assert int(tokens.max()) < tokenizer.vocab_size, (tokenizer.name, int(tokens.max()))
        writer.add(tokens, None if encoded[1] is None else np.array(encoded[1], dtype=np.uint8))
        num_documents += sum(last for _, _, last in batch)
        if progress is not None:
            progress(num_bytes, len(tokens))
    shards = writer.close()
    if isinstance(tokenizer, BPETokenizer):
        tokenizer.save(directory / TOKENIZER_FILE)
    manifest = Manifest(
        dtype=dtype,
        tokenizer=tokenizer.name,
        tokenizer_fingerprint=tokenizer.fingerprint,
        vocab_size=tokenizer.vocab_size,
        eos_id=tokenizer.eos_id,
        fingerprint=corpus.fingerprint,
        num_documents=num_documents,
        total_tokens=sum(s["num_tokens"] for s in shards),
        shards=shards,
        loss_mask=corpus.chat,
    )
    # format and version first, for a reader who opens the file.
    fields = {"format": FORMAT, "version": FORMAT_VERSION, **asdict(manifest)}
    write_atomic(directory / MANIFEST, json.dumps(fields, indent=2) + "\n")
    return manifest


def _encode_text(batch: list[Piece], tokenizer: Tokenizer) -> tuple[list[int], None]:
    """BOS (where the tokenizer has one) before a document's first piece, EOS after its last."""
    flat: list[int] = []
    encoded = tokenizer.encode_batch([text for text, _, _ in batch])
    for (_, first, last), ids in zip(batch, encoded, strict=True):
        if first and tokenizer.bos_id is not None:
            flat.append(tokenizer.bos_id)
        flat += ids
        if last:
            flat.append(tokenizer.eos_id)
    return flat, None


def _encode_chat(batch: list[Piece], tokenizer: Tokenizer) -> tuple[list[int], list[int]]:
    """Rendered records, piece by piece: (tokens, 1 where a token carries loss as a target)."""
    flat: list[int] = []
    mask: list[int] = []
    for record, _, _ in batch:
        rendered = render(record, tokenizer.chat_template)
        if tokenizer.bos_id is not None:
            flat.append(tokenizer.bos_id)
            mask.append(0)
        for piece, loss in pieces(rendered):
            ids = tokenizer.encode_markup(piece)
            flat += ids
            mask += [int(loss)] * len(ids)
        flat.append(tokenizer.eos_id)
        mask.append(int(rendered.ends_with_response))
    return flat, mask


class _ShardWriter:
    """Appends tokens to `shard-NNNNN.bin` files of at most `shard_tokens` tokens each (and,
    with `masks`, each token's loss flag to `shard-NNNNN.mask`)."""

    def __init__(self, directory: Path, dtype: np.dtype, shard_tokens: int, masks: bool) -> None:
        self._directory = directory
        self._dtype = dtype
        self._capacity = shard_tokens
        self._masks = masks
        self._files: list[Any] = []
        self._shards: list[dict[str, Any]] = []

    def add(self, tokens: np.ndarray, mask: np.ndarray | None = None) -> None:
        while len(tokens):
            if not self._files:
                name = f"shard-{len(self._shards):05d}.bin"
                names = [name, _mask_file(name)] if self._masks else [name]
                # Closed in _end.
                self._files = [open(self._directory / n, "wb") for n in names]  # noqa: SIM115
                self._shards.append({"file": name, "num_tokens": 0})
            current = self._shards[-1]
            take = min(len(tokens), self._capacity - current["num_tokens"])
            tokens[:take].tofile(self._files[0])
            if mask is not None:
                mask[:take].tofile(self._files[1])
                mask = mask[take:]
            current["num_tokens"] += take
            tokens = tokens[take:]
            if current["num_tokens"] == self._capacity:
                self._end()

    def close(self) -> list[dict[str, Any]]:
        self._end()
        return self._shards

    def _end(self) -> None:
        for file in self._files:
            file.close()
        self._files = []


def _publish(tmp: Path, directory: Path, corpus: Corpus, tokenizer: Tokenizer) -> None:
    """Rename the finished `tmp` to `directory`, replacing a stale one."""
    if directory.exists():
        if _open_current(directory, corpus, tokenizer) is not None:
            return  # a concurrent process published the same shards first
        # Moved aside first: renaming onto a non-empty directory fails.
        stale = tmp.with_name(tmp.name + "-stale")
        os.rename(directory, stale)
        shutil.rmtree(stale, ignore_errors=True)
    try:
        os.rename(tmp, directory)
    except OSError:
        if _open_current(directory, corpus, tokenizer) is None:
            raise


def _open_current(directory: Path, corpus: Corpus, tokenizer: Tokenizer) -> Shards | None:
    """The shards at `directory` if they were written from this corpus with this tokenizer."""
    try:
        manifest = _read_manifest(directory)
        _check_files(directory, manifest)
    except (OSError, ValueError, TypeError, KeyError):
        return None
    current = (
        manifest.fingerprint == corpus.fingerprint
        and manifest.tokenizer == tokenizer.name
        and manifest.tokenizer_fingerprint == tokenizer.fingerprint
        and manifest.vocab_size == tokenizer.vocab_size
    )
    return Shards(directory, manifest) if current else None


def _read_manifest(directory: Path) -> Manifest:
    data = json.loads((directory / MANIFEST).read_text())
    if data.get("format") != FORMAT or data.get("version") != FORMAT_VERSION:
        raise ValueError(
            f"{MANIFEST} is format {data.get('format')} version {data.get('version')}, "
            f"expected {FORMAT} version {FORMAT_VERSION}"
        )
    manifest = Manifest(**data)
    _dtype(manifest.dtype)
    if manifest.total_tokens != sum(s["num_tokens"] for s in manifest.shards):
        raise ValueError("total_tokens is not the sum of the shards' num_tokens")
    return manifest


def _check_files(directory: Path, manifest: Manifest) -> None:
    itemsize = _dtype(manifest.dtype).itemsize
    for shard in manifest.shards:
        files = [(shard["file"], itemsize)]
        if manifest.loss_mask:
            files.append((_mask_file(shard["file"]), 1))
        for name, width in files:
            size = (directory / name).stat().st_size
            if size != shard["num_tokens"] * width:
                raise ValueError(
                    f"{name} has {size} bytes, the manifest says {shard['num_tokens']} tokens"
                )


def _dtype(name: str) -> np.dtype:
    if name not in ("uint16", "uint32"):
        raise ValueError(f"unsupported dtype {name!r}")
    return np.dtype(name).newbyteorder("<")
