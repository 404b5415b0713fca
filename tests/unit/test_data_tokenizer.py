"""Tokenizers: exact round trips (also non-ASCII and unseen text), the vocabulary bound, and the
BPE cache that makes the second run load instead of train."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dstrain.data.corpus import corpus_from_texts
from dstrain.data.tokenizer import EOS_TOKEN, BPETokenizer, ByteTokenizer, build_tokenizer
from dstrain.errors import UserError

TEXTS = [
    "def add(x, y):\n    return x + y\n",
    "class Point:\n    def __init__(self, x):\n        self.x = x\n",
    "Grüße aus Köln — naïve café, 日本語のテキスト, emoji 🙂🚀, ñ",
    "literal <|eos|> inside a document stays text",
] * 20
CORPUS = corpus_from_texts(TEXTS, "tiny")


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> BPETokenizer:
    return build_tokenizer("bpe", 300, CORPUS, tmp_path_factory.mktemp("cache"))


@given(st.text())
def test_bytes_round_trip(text):
    tokenizer = ByteTokenizer()
    ids = tokenizer.encode(text)
    assert all(0 <= i < 256 for i in ids)
    assert tokenizer.decode(ids) == text


def test_bytes_eos():
    tokenizer = ByteTokenizer()
    assert (tokenizer.vocab_size, tokenizer.eos_id) == (257, 256)
    ids = tokenizer.encode("é") + [256] + tokenizer.encode("b")
    assert tokenizer.decode(ids) == f"é{EOS_TOKEN}b"


def test_bpe_round_trips_the_corpus(bpe):
    for text in TEXTS[:4]:
        ids = bpe.encode(text)
        assert bpe.eos_id not in ids
        assert bpe.decode(ids) == text
    assert [bpe.decode(ids) for ids in bpe.encode_batch(TEXTS[:4])] == TEXTS[:4]


@settings(max_examples=50, deadline=None)
@given(st.text())
def test_bpe_round_trips_unseen_text(bpe, text):
    assert bpe.decode(bpe.encode(text)) == text


def test_bpe_learns_merges_within_the_vocabulary(bpe):
    assert bpe.name == "bpe-300"
    assert 257 < bpe.vocab_size <= 300
    assert 0 <= bpe.eos_id < 300
    ids = [i for text in TEXTS[:4] for i in bpe.encode(text)]
    assert max(ids) < 300
    assert len(ids) < sum(len(text.encode()) for text in TEXTS[:4]) * 0.8  # it did merge
    assert bpe.decode(bpe.encode("a") + [bpe.eos_id]) == "a" + EOS_TOKEN


def test_bpe_second_build_loads_the_cache(tmp_path, monkeypatch):
    first = build_tokenizer("bpe", 280, CORPUS, tmp_path)
    (path,) = (tmp_path / "tokenizers").iterdir()
    assert path.name == f"bpe-280-{CORPUS.fingerprint[:16]}.json"
    mtime = path.stat().st_mtime_ns

    def no_training(*args, **kwargs):
        raise AssertionError("retrained despite the cache")

    monkeypatch.setattr(BPETokenizer, "train", no_training)
    second = build_tokenizer("bpe", 280, CORPUS, tmp_path)
    assert path.stat().st_mtime_ns == mtime
    assert second.fingerprint == first.fingerprint
    assert second.encode(TEXTS[2]) == first.encode(TEXTS[2])


def test_bpe_training_is_deterministic(tmp_path):
    one = build_tokenizer("bpe", 280, CORPUS, tmp_path / "a")
    two = build_tokenizer("bpe", 280, CORPUS, tmp_path / "b")
    assert one.fingerprint == two.fingerprint


def test_corrupt_cache_is_retrained(tmp_path):
    path = tmp_path / "tokenizers" / f"bpe-280-{CORPUS.fingerprint[:16]}.json"
    path.parent.mkdir()
    path.write_text("{not json")
    tokenizer = build_tokenizer("bpe", 280, CORPUS, tmp_path)
    assert tokenizer.decode(tokenizer.encode(TEXTS[0])) == TEXTS[0]
    assert path.read_text().startswith("{")


@pytest.mark.parametrize("kind", ["bytes", "bpe"])
def test_vocabulary_too_small(tmp_path, kind):
    with pytest.raises(UserError, match="at least 257") as info:
        build_tokenizer(kind, 256, CORPUS, tmp_path)
    assert "model.vocab_size=257" in str(info.value)


def test_bytes_fits_any_vocabulary_of_257_or_more(tmp_path):
    assert build_tokenizer("bytes", 257, CORPUS, tmp_path).vocab_size == 257
    assert not (tmp_path / "tokenizers").exists()
