"""Tokenizing at bounded memory: a long .txt file is read in pieces that end at line breaks, and
its tokens equal those of the whole text (the built-in BPE, and a DeepSeek-style pre-tokenizer);
batches are bounded in bytes; the progress sees every byte and token; a file that is not UTF-8
is one message naming its first bad line, even far past the reader's decode-ahead. The RSS and
rate on a 1 GB corpus are measured by benchmarks/tokenize_large.py."""

import sysconfig
from pathlib import Path

import pytest

from dstrain.data import readers
from dstrain.data.corpus import open_corpus
from dstrain.data.readers import read_text_file
from dstrain.data.shards import build_shards
from dstrain.data.tokenizer import build_tokenizer
from dstrain.errors import UserError

STDLIB = Path(sysconfig.get_paths()["stdlib"])


@pytest.fixture(scope="module")
def long_text():
    """A few hundred kB of real text: code with indented lines, blank lines and unicode."""
    parts = [(STDLIB / name).read_text() for name in ("textwrap.py", "difflib.py", "calendar.py")]
    return "\n".join(parts) + "\nγάμμα δέλτα 日本語\n  indented tail"


def test_pieces_end_at_line_breaks_and_join_to_the_text(tmp_path, long_text):
    path = tmp_path / "long.txt"
    path.write_text(long_text)
    pieces = list(read_text_file(path, piece_chars=4096))
    assert len(pieces) > 5
    assert "".join(text for text, _, _ in pieces) == long_text
    assert [first for _, first, _ in pieces] == [True] + [False] * (len(pieces) - 1)
    assert [last for _, _, last in pieces] == [False] * (len(pieces) - 1) + [True]
    for text, _, _ in pieces[:-1]:
        assert text.endswith("\n") and len(text) >= 4096
    for text, _, _ in pieces[1:]:
        assert not text[0].isspace()  # never inside indentation or a run of blank lines


def _deepseek_style_bpe(texts):
    """A byte-level BPE with a DeepSeek-V3-like split pattern (digits, letters, punctuation and
    newline runs apart), trained here on the texts."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    pattern = r"\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+|[\p{L}\p{M}]+"
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=["<｜end▁of▁sentence｜>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer)
    return tok


@pytest.mark.parametrize("kind", ["builtin", "deepseek_pattern"])
def test_tokens_in_pieces_equal_the_whole_texts(tmp_path, long_text, monkeypatch, kind):
    path = tmp_path / "data" / "long.txt"
    path.parent.mkdir()
    path.write_text(long_text)
    corpus = open_corpus(str(path.parent), cache_dir=tmp_path / "cache")
    if kind == "builtin":
        tokenizer = build_tokenizer("bpe", 600, corpus, tmp_path / "cache")
    else:
        tokenizer_file = tmp_path / "tokenizer.json"
        _deepseek_style_bpe([long_text]).save(str(tokenizer_file))
        tokenizer = build_tokenizer(str(tokenizer_file), 600, corpus, tmp_path / "cache")
    whole = tokenizer.encode(long_text)
    monkeypatch.setattr(readers, "PIECE_CHARS", 2048)
    seen = []
    shards = build_shards(
        corpus, tokenizer, tmp_path / "cache", progress=lambda b, t: seen.append((b, t))
    )
    stream = shards.read(0, shards.total_tokens).tolist()
    bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    assert stream == bos + whole + [tokenizer.eos_id]
    assert shards.manifest.num_documents == 1
    assert sum(b for b, _ in seen) == len(long_text.encode()) == corpus.num_bytes
    assert sum(t for _, t in seen) == shards.total_tokens


def test_batches_are_bounded_in_bytes(tmp_path):
    folder = tmp_path / "docs"
    folder.mkdir()
    for i in range(40):
        (folder / f"{i:02d}.txt").write_text(f"document {i} " * 100)
    corpus = open_corpus(str(folder), cache_dir=tmp_path / "cache")
    batches = list(corpus.batches(256, max_bytes=5000))
    assert sum(len(pieces) for pieces, _ in batches) == 40
    assert all(size < 5000 + 1300 for _, size in batches)  # at most one document past the bound
    assert sum(size for _, size in batches) == corpus.num_bytes


@pytest.mark.parametrize("suffix", [".txt", ".jsonl"])
def test_not_utf8_names_the_first_bad_line(tmp_path, suffix, cli):
    good = '{"text": "fine line number %d"}\n' if suffix == ".jsonl" else "fine line number %d\n"
    lines = [good % i for i in range(2000)]  # far past the text reader's decode-ahead
    path = tmp_path / f"bad{suffix}"
    payload = "".join(lines[:1500]).encode() + b"caf\xe9\n" + "".join(lines[1500:]).encode()
    path.write_bytes(payload)
    corpus = open_corpus(str(path), cache_dir=tmp_path / "cache")
    with pytest.raises(UserError) as raised:
        build_shards(corpus, build_tokenizer("bytes", 512, corpus, tmp_path), tmp_path / "cache")
    assert f"{path}:1501: not UTF-8" in raised.value.message, raised.value.message
    assert raised.value.exit_code == 1 and "UTF-8" in raised.value.fix
    assert not list((tmp_path / "cache" / "shards").glob("*"))  # nothing half-written left
    result = cli(
        "train",
        "--set",
        f"data.source={path}",
        "--set",
        f"data.cache_dir={tmp_path / 'cache2'}",
        "--set",
        "data.tokenizer=bytes",
        "--set",
        "model.vocab_size=512",
    )
    assert result.code == 1 and f"{path.name}:1501: not UTF-8" in result.err
    assert "Traceback" not in result.err


def test_an_empty_corpus_leaves_nothing_in_the_cache(tmp_path):
    path = tmp_path / "empty.txt"
    path.write_text("")
    corpus = open_corpus(str(path), cache_dir=tmp_path / "cache")
    with pytest.raises(UserError, match="no non-empty document"):
        build_shards(corpus, build_tokenizer("bytes", 512, corpus, tmp_path), tmp_path / "cache")
    assert not list((tmp_path / "cache" / "shards").glob("*"))
