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


def read_documents(files: list[Path], text_field: str, cache_dir: Path) -> Iterator[str]:
    """Every document of `files` in order: a .txt file is one document, a .jsonl line or a
    .parquet row is one (its `text_field`). Empty and null texts are skipped."""
    for path in files:
        if path.suffix == ".txt":
            # Undecodable bytes become U+FFFD rather than failing a long tokenization run.
            yield path.read_text(encoding="utf-8", errors="replace")
        else:
            yield from _read_table(path, text_field, cache_dir)


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
    """Records in a .jsonl file; raises UserError naming the first line that is not an object."""
    records = 0
    with path.open(encoding="utf-8", errors="replace") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as exc:
                raise UserError(
                    f"{path}:{number}: malformed JSON ({exc.msg} at column {exc.colno})",
                    fix=_JSONL_FIX,
                ) from None
            if not isinstance(value, dict):
                kind = type(value).__name__
                raise UserError(
                    f"{path}:{number}: a JSON {kind} where an object was expected", fix=_JSONL_FIX
                )
            records += 1
    return records


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
