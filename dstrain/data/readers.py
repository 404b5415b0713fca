"""Per-format document readers: .txt by hand, .jsonl and .parquet through `datasets`.

`datasets` converts each file to Arrow once (cached under `cache_dir/datasets`) and then reads it
memory-mapped, so a corpus larger than RAM streams through the tokenizer.
"""

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from dstrain.errors import UserError

SUPPORTED_SUFFIXES = (".jsonl", ".parquet", ".txt")
_BATCH_ROWS = 1024
_JSONL_FIX = 'each line of a .jsonl file must be one JSON object, e.g. {"text": "..."}'


# A .txt file is read and tokenized in pieces of about this many characters, so that a file
# larger than memory is not held whole.
PIECE_CHARS = 1 << 18
_UTF8_FIX = "save the file as UTF-8 (e.g. iconv -f LATIN1 -t UTF-8 FILE > FILE.utf8)"

# A piece of a document: (text, starts the document, ends it). Most documents are one piece.
Piece = tuple[str, bool, bool]


def read_documents(files: list[Path], text_field: str, cache_dir: Path) -> Iterator[Piece]:
    """Every document of `files` in order, as pieces: a .txt file is one document, a .jsonl line
    or a .parquet row is one (its `text_field`). Empty and null texts are skipped."""
    for path in files:
        if path.suffix == ".txt":
            yield from read_text_file(path)
        else:
            yield from ((text, True, True) for text in _read_table(path, text_field, cache_dir))


def read_text_file(path: Path, piece_chars: int | None = None) -> Iterator[Piece]:
    """One .txt document, streamed in pieces of about `piece_chars` characters. A piece ends
    just before a line that starts with a non-space character: byte-level pre-tokenizers (GPT-2's
    and DeepSeek's patterns) split there anyway, so the pieces' tokens are the whole text's.
    (A single line longer than memory cannot be split and is read whole.)"""
    piece_chars = piece_chars or PIECE_CHARS
    buffer: list[str] = []
    size, first, number = 0, True, 0
    with path.open(encoding="utf-8", errors="strict") as lines:
        try:
            for number, line in enumerate(lines, 1):  # noqa: B007 (number: in the error)
                if size >= piece_chars and not line[:1].isspace():
                    yield "".join(buffer), first, False
                    buffer, size, first = [], 0, False
                buffer.append(line)
                size += len(line)
        except UnicodeDecodeError as exc:
            raise not_utf8(path, exc) from None
    if buffer or not first:
        yield "".join(buffer), first, True


def not_utf8(path: Path, exc: UnicodeDecodeError) -> UserError:
    """The error for a file that is not UTF-8, naming its first undecodable line (a text-mode
    reader decodes ahead of the line it returns, so its own count can be a few lines short)."""
    with path.open("rb") as lines:
        for number, line in enumerate(lines, 1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as bad:
                return UserError(
                    f"{path}:{number}: not UTF-8 ({bad.reason} at byte {bad.start} of the line)",
                    _UTF8_FIX,
                    exit_code=1,
                )
    return UserError(f"{path}: not UTF-8 ({exc.reason})", _UTF8_FIX, exit_code=1)


def _read_table(path: Path, text_field: str, cache_dir: Path) -> Iterator[str]:
    dataset = _load(path, cache_dir)
    if dataset is None:
        return
    _check_text_column(dataset, path, text_field)
    for batch in dataset.select_columns([text_field]).iter(batch_size=_BATCH_ROWS):
        yield from (text for text in batch[text_field] if text)


def _load(path: Path, cache_dir: Path) -> Any:
    """The file as a `datasets.Dataset`, or None for a .jsonl file without records."""
    builder = "json" if path.suffix == ".jsonl" else "parquet"
    datasets = _import_datasets()
    try:
        with _quiet(datasets):
            return datasets.load_dataset(
                builder, data_files=[str(path)], split="train", cache_dir=str(cache_dir)
            )
    except Exception as exc:  # datasets wraps every parser error in its own exception types
        if builder == "json" and _count_jsonl_records(path) == 0:
            return None
        raise UserError(
            f"cannot read {path}: {_root_cause(exc)}",
            fix=_JSONL_FIX if builder == "json" else "check that the file is valid parquet",
            exit_code=1,
        ) from exc


def _import_datasets() -> Any:
    # Local files only: without these, `datasets` may ask the Hugging Face Hub about builders
    # and hang (or fail slowly) on a machine without network. They must be set before import.
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import datasets

    return datasets


@contextmanager
def _quiet(datasets: Any) -> Iterator[None]:
    """No progress bars or logged errors from `datasets`: its failures become our UserError."""
    logging = datasets.utils.logging
    bars_were_off = datasets.utils.are_progress_bars_disabled()
    verbosity = logging.get_verbosity()
    datasets.disable_progress_bars()
    logging.set_verbosity(logging.CRITICAL + 1)
    try:
        yield
    finally:
        logging.set_verbosity(verbosity)
        if not bars_were_off:
            datasets.enable_progress_bars()


def _count_jsonl_records(path: Path) -> int:
    """Records in a .jsonl file; raises UserError naming the first line that is not UTF-8 or not
    a JSON object."""
    records = 0
    with path.open(encoding="utf-8", errors="strict") as lines:
        try:
            for number, line in enumerate(lines, 1):
                if line.strip():
                    _json_object(line, path, number)
                    records += 1
        except UnicodeDecodeError as exc:
            raise not_utf8(path, exc) from None
    return records


def _json_object(line: str, path: Path, number: int) -> None:
    try:
        value = json.loads(line)
    except json.JSONDecodeError as exc:
        raise UserError(
            f"{path}:{number}: malformed JSON ({exc.msg} at column {exc.colno})", _JSONL_FIX, 1
        ) from None
    if not isinstance(value, dict):
        kind = type(value).__name__
        raise UserError(f"{path}:{number}: a JSON {kind}, not an object", _JSONL_FIX, 1)


def _check_text_column(dataset: Any, path: Path, text_field: str) -> None:
    what = "keys" if path.suffix == ".jsonl" else "columns"
    if text_field not in dataset.column_names:
        existing = ", ".join(dataset.column_names) or "(none)"
        raise UserError(
            f"{path} has no `{text_field}` field; its {what} are: {existing}",
            fix="name the field that holds the text: --set data.text_field=NAME",
            exit_code=1,
        )
    dtype = getattr(dataset.features[text_field], "dtype", None)
    if dtype not in ("string", "large_string", "null"):
        raise UserError(
            f"{path}: field `{text_field}` holds {dataset.features[text_field]}, not text",
            fix="name the field that holds the text: --set data.text_field=NAME",
            exit_code=1,
        )


def _root_cause(exc: BaseException) -> str:
    while exc.__cause__ is not None:
        exc = exc.__cause__
    return str(exc) or type(exc).__name__
