"""Shards: the memory-mapped stream equals the documents joined by EOS; manifests are reused,
rebuilt when stale, and a shard directory works as `data.source`."""

import json
from collections.abc import Sequence

import numpy as np
import pytest

from dstrain.config.schema import DataConfig
from dstrain.data.build import build_dataset
from dstrain.data.corpus import corpus_from_texts
from dstrain.data.shards import MANIFEST, build_shards, is_shard_dir, open_shards
from dstrain.data.tokenizer import ByteTokenizer, Tokenizer, build_tokenizer
from dstrain.errors import UserError

TEXTS = ["alpha beta", "", "γάμμα δέλτα 日本", "def f():\n    return 1\n", "z"]
CORPUS = corpus_from_texts(TEXTS, "tiny")
DOCS = [text for text in TEXTS if text]


class WideTokenizer(Tokenizer):
    """Bytes shifted past 65535, to exercise uint32 shards."""

    name = "wide"
    vocab_size = 70_000
    eos_id = 69_999
    fingerprint = "wide-v1"

    def encode(self, text: str) -> list[int]:
        return [66_000 + b for b in text.encode()]

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i - 66_000 for i in ids if i != self.eos_id).decode()


def _expected(tokenizer: Tokenizer) -> list[int]:
    return [i for doc in DOCS for i in [*tokenizer.encode(doc), tokenizer.eos_id]]


def test_byte_shards_hold_documents_joined_by_eos(tmp_path):
    shards = build_shards(CORPUS, ByteTokenizer(), tmp_path)
    assert shards.directory.name == f"bytes-{CORPUS.fingerprint[:16]}"
    assert shards.read(0, shards.total_tokens).tolist() == _expected(ByteTokenizer())
    manifest = json.loads((shards.directory / MANIFEST).read_text())
    assert manifest["dtype"] == "uint16" and manifest["num_documents"] == len(DOCS)
    assert manifest["total_tokens"] == len(_expected(ByteTokenizer()))


def test_bpe_shards_decode_to_the_documents(tmp_path):
    tokenizer = build_tokenizer("bpe", 300, CORPUS, tmp_path)
    shards = build_shards(CORPUS, tokenizer, tmp_path)
    stream = shards.read(0, shards.total_tokens).tolist()
    assert stream[-1] == tokenizer.eos_id
    eos = [i for i, token in enumerate(stream) if token == tokenizer.eos_id]
    pieces = [stream[a + 1 : b] for a, b in zip([-1, *eos], eos, strict=False)]
    assert [tokenizer.decode(piece) for piece in pieces] == DOCS
    assert (shards.directory / "tokenizer.json").exists()


def test_uint32_when_the_vocabulary_exceeds_uint16(tmp_path):
    shards = build_shards(CORPUS, WideTokenizer(), tmp_path)
    assert shards.manifest.dtype == "uint32"
    assert shards.read(0, shards.total_tokens).tolist() == _expected(WideTokenizer())


def test_reads_across_shard_boundaries(tmp_path):
    shards = build_shards(CORPUS, ByteTokenizer(), tmp_path, shard_tokens=7)
    expected = np.array(_expected(ByteTokenizer()))
    assert len(shards.manifest.shards) == -(-len(expected) // 7)
    assert max(s["num_tokens"] for s in shards.manifest.shards) == 7
    for start in range(len(expected)):
        for stop in range(start, min(len(expected), start + 20) + 1):
            assert shards.read(start, stop).tolist() == expected[start:stop].tolist()


def test_matching_manifest_is_reused(tmp_path, capsys):
    first = build_shards(CORPUS, ByteTokenizer(), tmp_path)
    mtime = (first.directory / MANIFEST).stat().st_mtime_ns
    capsys.readouterr()
    second = build_shards(CORPUS, ByteTokenizer(), tmp_path)
    assert (second.directory / MANIFEST).stat().st_mtime_ns == mtime
    assert "tokenizing" not in capsys.readouterr().err
    assert [p.name for p in (tmp_path / "shards").iterdir()] == [first.directory.name]


def test_stale_manifest_is_rebuilt(tmp_path):
    shards = build_shards(CORPUS, ByteTokenizer(), tmp_path)
    path = shards.directory / MANIFEST
    manifest = json.loads(path.read_text())
    path.write_text(json.dumps({**manifest, "tokenizer_fingerprint": "old"}))
    rebuilt = build_shards(CORPUS, ByteTokenizer(), tmp_path)
    assert rebuilt.manifest.tokenizer_fingerprint == ByteTokenizer.fingerprint
    assert rebuilt.read(0, rebuilt.total_tokens).tolist() == _expected(ByteTokenizer())
    assert [p.name for p in (tmp_path / "shards").iterdir()] == [shards.directory.name]


def test_shard_directory_as_data_source(tmp_path):
    (tmp_path / "a.txt").write_text("some text to tokenize, twice over. " * 20)
    cfg = DataConfig(source=str(tmp_path / "a.txt"), cache_dir=tmp_path / "cache")
    tokenizer, dataset = build_dataset(cfg, vocab_size=300, seq_len=8)
    assert is_shard_dir(dataset.shards.directory)
    again = DataConfig(source=str(dataset.shards.directory), cache_dir=tmp_path / "other")
    tokenizer2, dataset2 = build_dataset(again, vocab_size=512, seq_len=8)
    assert tokenizer2.fingerprint == tokenizer.fingerprint
    assert dataset2[3].tolist() == dataset[3].tolist()
    assert not (tmp_path / "other").exists()


def test_shard_directory_with_a_larger_vocabulary_than_the_model(tmp_path):
    shards = build_shards(CORPUS, ByteTokenizer(), tmp_path)
    cfg = DataConfig(source=str(shards.directory), tokenizer="bytes")
    with pytest.raises(UserError, match="model.vocab_size=257"):
        build_dataset(cfg, vocab_size=256, seq_len=4)


def test_truncated_shard_is_reported(tmp_path):
    shards = build_shards(CORPUS, ByteTokenizer(), tmp_path)
    path = shards.directory / shards.manifest.shards[0]["file"]
    path.write_bytes(path.read_bytes()[:-2])
    with pytest.raises(UserError, match="not a usable dstrain shard directory"):
        open_shards(shards.directory)
