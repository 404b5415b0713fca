"""Where text comes from: the embedded standard-library corpus or the user's own files.

A `Corpus` is a lazy, ordered stream of non-empty documents plus a `fingerprint` that changes
whenever the documents may have changed; tokenizers and shards are cached under it, so a second
run with the same corpus reads nothing but the fingerprint's inputs.
"""

import hashlib
import json
import os
import sys
import sysconfig
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from dstrain.data.instructions import Record, is_instruction_file, read_records
from dstrain.data.readers import SUPPORTED_SUFFIXES, Piece, read_documents
from dstrain.errors import UserError

EMBEDDED = "embedded"
# The embedded corpus is the first files (in sorted order) up to this many bytes: big enough to
# train a 2k-vocabulary BPE and a debug model, small enough to tokenize in seconds.
EMBEDDED_MAX_BYTES = 6_000_000
_EMBEDDED_SKIP_DIRS = frozenset({"site-packages", "test", "tests", "idlelib", "lib2to3"})
# Text per tokenization batch: the Rust tokenizer holds ~50 bytes per byte of its batch while it
# encodes (measured with benchmarks/tokenize_large.py), so 2 MiB bounds it near 100 MB.
BATCH_BYTES = 1 << 21
# Bump when the way documents are read changes, so that caches built by older code are not reused.
_READER_VERSION = 1


@dataclass(frozen=True)
class Corpus:
    """An ordered stream of documents, identified by `fingerprint` (a sha256 hex digest)."""

    name: str
    fingerprint: str
    num_bytes: int
    _read: Callable[[], Iterator[Piece]] = field(repr=False, compare=False)
    chat: bool = False  # documents are instruction `Record`s, not text

    def pieces(self) -> Iterator[Piece]:
        """The non-empty documents in order, as (text, starts a document, ends it): a long .txt
        file comes in pieces, every other document whole. Raises UserError at the end if there
        was no document."""
        found = False
        for piece in self._read():
            if piece[0]:
                found = True
                yield piece
        if not found:
            raise UserError(
                f"the corpus {self.name} has no non-empty document",
                fix="point data.source at files that contain text (and check data.text_field)",
                exit_code=1,
            )

    def documents(self) -> Iterator[str]:
        """The texts in order (a long document's pieces one by one): what a tokenizer trains on."""
        return (piece[0] for piece in self.pieces())

    def batches(self, size: int, max_bytes: int = BATCH_BYTES) -> Iterator[tuple[list[Piece], int]]:
        """(pieces, their bytes): lists of up to `size` pieces and about `max_bytes` bytes, for
        batched tokenization at bounded memory."""
        batch: list[Piece] = []
        total = 0
        for piece in self.pieces():
            batch.append(piece)
            total += _num_bytes(piece[0])
            if len(batch) == size or total >= max_bytes:
                yield batch, total
                batch, total = [], 0
        if batch:
            yield batch, total


def _num_bytes(document: "str | Record") -> int:
    if isinstance(document, str):
        return len(document.encode("utf-8", errors="surrogatepass"))
    return sum(len(str(value)) for value in document.data.values())  # about its line's length


def open_corpus(
    source: str, *, text_field: str = "text", cache_dir: Path, data_format: str = "auto"
) -> Corpus:
    """`embedded` or a path to a .txt/.jsonl/.parquet file or a directory of them;
    `data_format` says whether they are text or instruction data (`data/instructions.py`).

    Only lists and stats the files: reading (and its errors: missing text field, malformed
    JSONL, empty corpus) happens when `documents()` is iterated.
    """
    if source == EMBEDDED:
        return embedded_corpus()
    files = find_files(Path(source))
    auto = data_format == "auto"
    chat = data_format == "chat" or (auto and all(map(is_instruction_file, files)))
    if chat:
        bad = [p for p in files if p.suffix != ".jsonl"]
        if bad:
            raise UserError(
                f"data.format=chat: {bad[0]} is not .jsonl", "instruction data is JSONL", 1
            )
        read = lambda: ((record, True, True) for record in read_records(files))  # noqa: E731
    else:
        read = lambda: read_documents(files, text_field, Path(cache_dir) / "datasets")  # noqa: E731
    return Corpus(
        name=source,
        fingerprint=_stat_fingerprint(files, text_field if not chat else "chat"),
        num_bytes=sum(path.stat().st_size for path in files),
        _read=read,
        chat=chat,
    )


def corpus_from_texts(texts: Sequence[str], name: str = "in-memory texts") -> Corpus:
    """A corpus of the given documents, fingerprinted by their content."""
    digest = hashlib.sha256(f"texts-v{_READER_VERSION}".encode())
    for text in texts:
        data = text.encode("utf-8", errors="surrogatepass")
        digest.update(len(data).to_bytes(8, "little") + data)
    num_bytes = sum(len(text.encode("utf-8", errors="surrogatepass")) for text in texts)
    return Corpus(name, digest.hexdigest(), num_bytes, lambda: ((t, True, True) for t in texts))


def embedded_corpus() -> Corpus:
    """The Python standard library's own source, one document per file: no download.

    The same Python version gives the same corpus on every machine: files are taken in sorted
    relative-path order until `EMBEDDED_MAX_BYTES`, and the fingerprint hashes their content.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    texts = []
    total = 0
    for relative in _stdlib_sources(root):
        if total >= EMBEDDED_MAX_BYTES:
            break
        data = (root / relative).read_bytes()
        texts.append(data.decode("utf-8", errors="replace"))
        total += len(data)
    version = ".".join(map(str, sys.version_info[:3]))
    return corpus_from_texts(texts, f"embedded (Python {version} stdlib, {len(texts)} files)")


def _stdlib_sources(root: Path) -> list[str]:
    """Relative posix paths of the stdlib's .py files, sorted, without tests and site-packages."""
    found = []
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = [name for name in subdirs if name not in _EMBEDDED_SKIP_DIRS]
        base = Path(directory).relative_to(root)
        found += [(base / name).as_posix() for name in files if name.endswith(".py")]
    return sorted(found)


def find_files(path: Path) -> list[Path]:
    """The supported files at `path`: the file itself, or a directory's files, recursively and
    sorted by relative path. Hidden files and folders (`.cache`, `.git`) are skipped."""
    if not path.exists():
        raise UserError(
            f"data.source {path} does not exist",
            fix="point data.source at a .txt/.jsonl/.parquet file or a directory of them, "
            "or use `embedded`",
        )
    if path.is_file():
        _check_suffix(path)
        return [path]
    files = sorted(
        (p for p in path.rglob("*") if _visible(p, path) and p.suffix in SUPPORTED_SUFFIXES),
        key=lambda p: p.relative_to(path).as_posix(),
    )
    if not files:
        raise UserError(
            f"data.source {path} holds no supported file "
            f"(looked for {', '.join(SUPPORTED_SUFFIXES)}, recursively)",
            fix="add .txt (one document per file), .jsonl (one per line) or .parquet files",
            exit_code=1,
        )
    return files


def _check_suffix(path: Path) -> None:
    if path.suffix not in SUPPORTED_SUFFIXES:
        raise UserError(
            f"data.source {path}: unsupported file type `{path.suffix or '(none)'}`",
            fix=f"use one of {', '.join(SUPPORTED_SUFFIXES)}, or a directory of them",
            exit_code=1,
        )


def _visible(path: Path, root: Path) -> bool:
    return path.is_file() and not any(part.startswith(".") for part in path.relative_to(root).parts)


def _stat_fingerprint(files: list[Path], text_field: str) -> str:
    """Paths, sizes and modification times: cheap, and any edit or move invalidates caches."""
    entries = []
    for path in files:
        stat = path.stat()
        entries.append([str(path.resolve()), stat.st_size, stat.st_mtime_ns])
    identity = json.dumps([f"files-v{_READER_VERSION}", text_field, entries])
    return hashlib.sha256(identity.encode()).hexdigest()
