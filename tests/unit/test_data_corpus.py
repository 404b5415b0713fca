"""Corpus inputs: the embedded stdlib corpus, .txt/.jsonl/.parquet files and directories, and
the UserError each bad input gets."""

import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dstrain.data.corpus import EMBEDDED_MAX_BYTES, embedded_corpus, open_corpus
from dstrain.errors import UserError


def _documents(source: Path, tmp_path: Path, text_field: str = "text") -> list[str]:
    corpus = open_corpus(str(source), text_field=text_field, cache_dir=tmp_path / "cache")
    return list(corpus.documents())


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def test_embedded_corpus_is_deterministic_and_capped():
    first, second = embedded_corpus(), embedded_corpus()
    assert first.fingerprint == second.fingerprint
    docs = list(first.documents())
    assert len(docs) > 100
    assert EMBEDDED_MAX_BYTES <= first.num_bytes < EMBEDDED_MAX_BYTES + 1_000_000
    assert docs[0] == list(second.documents())[0]
    assert all(doc for doc in docs)


def test_txt_file_is_one_document(tmp_path):
    text = "line one\nline two — ünïcode 日本\n"
    (tmp_path / "a.txt").write_text(text, encoding="utf-8")
    assert _documents(tmp_path / "a.txt", tmp_path) == [text]


def test_jsonl_is_one_document_per_line(tmp_path):
    path = _jsonl(tmp_path / "a.jsonl", [{"text": "first"}, {"text": ""}, {"text": "ß", "id": 3}])
    path.write_text(path.read_text() + "\n\n")  # blank lines are allowed
    assert _documents(path, tmp_path) == ["first", "ß"]


def test_jsonl_text_field(tmp_path):
    path = _jsonl(tmp_path / "a.jsonl", [{"body": "x", "text": "no"}, {"body": "y"}])
    assert _documents(path, tmp_path, text_field="body") == ["x", "y"]


def test_parquet_column(tmp_path):
    path = tmp_path / "a.parquet"
    pq.write_table(pa.table({"text": ["p", None, "q"], "n": [1, 2, 3]}), path)
    assert _documents(path, tmp_path) == ["p", "q"]


def test_directory_is_read_recursively_in_sorted_order(tmp_path):
    (tmp_path / "data" / "b").mkdir(parents=True)
    (tmp_path / "data" / ".hidden").mkdir()
    (tmp_path / "data" / "b" / "c.txt").write_text("c")
    (tmp_path / "data" / "a.txt").write_text("a")
    (tmp_path / "data" / "notes.md").write_text("ignored")
    (tmp_path / "data" / ".hidden" / "h.txt").write_text("hidden")
    _jsonl(tmp_path / "data" / "b" / "a.jsonl", [{"text": "j1"}, {"text": "j2"}])
    pq.write_table(pa.table({"text": ["pq"]}), tmp_path / "data" / "z.parquet")
    assert _documents(tmp_path / "data", tmp_path) == ["a", "j1", "j2", "c", "pq"]


def test_fingerprint_follows_content_and_text_field(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("one")
    cache = tmp_path / "cache"
    before = open_corpus(str(path), cache_dir=cache).fingerprint
    assert open_corpus(str(path), cache_dir=cache).fingerprint == before
    assert open_corpus(str(path), text_field="body", cache_dir=cache).fingerprint != before
    path.write_text("two!")
    os.utime(path, ns=(1, 1))
    assert open_corpus(str(path), cache_dir=cache).fingerprint != before


def test_datasets_runs_offline(tmp_path):
    _documents(_jsonl(tmp_path / "a.jsonl", [{"text": "x"}]), tmp_path)
    assert os.environ["HF_DATASETS_OFFLINE"] and os.environ["HF_HUB_OFFLINE"]


def _error(source: Path, tmp_path: Path, text_field: str = "text") -> str:
    with pytest.raises(UserError) as info:
        _documents(source, tmp_path, text_field)
    return str(info.value)


def test_missing_path(tmp_path):
    message = _error(tmp_path / "nope.jsonl", tmp_path)
    assert "nope.jsonl does not exist" in message and "embedded" in message


def test_directory_without_supported_files(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x.csv").write_text("a,b")
    message = _error(tmp_path / "d", tmp_path)
    assert "no supported file" in message
    assert all(suffix in message for suffix in (".txt", ".jsonl", ".parquet"))


def test_unsupported_extension(tmp_path):
    (tmp_path / "x.csv").write_text("a,b")
    assert "unsupported file type `.csv`" in _error(tmp_path / "x.csv", tmp_path)


def test_jsonl_without_the_text_field(tmp_path):
    path = _jsonl(tmp_path / "a.jsonl", [{"content": "x", "id": 1}])
    message = _error(path, tmp_path)
    assert "no `text` field" in message and "content, id" in message
    assert "--set data.text_field=NAME" in message


def test_parquet_without_the_text_field(tmp_path):
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "a.parquet")
    message = _error(tmp_path / "a.parquet", tmp_path)
    assert "columns are: body" in message and "data.text_field" in message


def test_text_field_that_is_not_text(tmp_path):
    path = _jsonl(tmp_path / "a.jsonl", [{"text": 1}, {"text": 2}])
    assert "not text" in _error(path, tmp_path)


def test_malformed_jsonl_names_the_line(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text('{"text": "ok"}\n\n{"text": oops}\n')
    assert "a.jsonl:3: malformed JSON" in _error(path, tmp_path)


def test_jsonl_line_that_is_not_an_object(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text('{"text": "ok"}\n["a list"]\n')
    assert "a.jsonl:2: a JSON list, not an object" in _error(path, tmp_path)


@pytest.mark.parametrize("content", ["", "\n\n", '{"text": ""}\n{"text": null}\n'])
def test_empty_corpus(tmp_path, content):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.jsonl").write_text(content)
    (tmp_path / "d" / "b.txt").write_text("")
    assert "no non-empty document" in _error(tmp_path / "d", tmp_path)


def test_unreadable_parquet(tmp_path):
    (tmp_path / "a.parquet").write_bytes(b"not parquet at all")
    assert "cannot read" in _error(tmp_path / "a.parquet", tmp_path)


def test_jsonl_with_mixed_types_is_reported_not_raised(tmp_path):
    path = _jsonl(tmp_path / "a.jsonl", [{"text": "a"}, {"text": {"nested": 1}}])
    assert "a.jsonl" in _error(path, tmp_path)
