"""Tokenizers: raw UTF-8 bytes, or a byte-level BPE trained locally on the corpus and cached.

Both are lossless: `decode(encode(text)) == text` for any text. EOS is never produced by
`encode` (text that spells `<|eos|>` stays text); the shard writer appends it after each document,
and `decode` renders it as `<|eos|>`.
"""

import hashlib
import itertools
import os
import sys
import tempfile
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from dstrain.data.corpus import Corpus
from dstrain.data.instructions import as_text
from dstrain.errors import UserError

EOS_TOKEN = "<|eos|>"
# BPE trains on at most this many characters of the corpus (in order): merges learnt on ~50 MB
# barely change with more text, and training time grows linearly with it.
BPE_TRAIN_MAX_CHARS = 50_000_000
_MIN_VOCAB = 257  # 256 byte values + EOS


class Tokenizer(ABC):
    """What the data pipeline needs of a tokenizer. Ids are in `[0, vocab_size)`."""

    name: str  # identifies the kind and size in cache paths and manifests, e.g. "bpe-2048"
    vocab_size: int
    eos_id: int
    bos_id: int | None = None  # written before each document when set (pretrained tokenizers)
    chat_template: str | None = None  # Jinja, for instruction data (pretrained tokenizers)
    fingerprint: str  # changes whenever encode() could give different ids

    @abstractmethod
    def encode(self, text: str) -> list[int]: ...

    @abstractmethod
    def decode(self, ids: Sequence[int]) -> str: ...

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(text) for text in texts]

    def encode_markup(self, text: str) -> list[int]:
        """Text a chat template rendered: its special tokens (role markers) are tokens."""
        return self.encode(text)


class ByteTokenizer(Tokenizer):
    """Ids 0..255 are the UTF-8 bytes, 256 is EOS."""

    name = "bytes"
    vocab_size = 257
    eos_id = 256
    fingerprint = "bytes-v1"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        # A window may cut a multi-byte character: such bytes decode to U+FFFD.
        parts = []
        for is_eos, group in itertools.groupby(ids, key=lambda i: i == self.eos_id):
            if is_eos:
                parts.append(EOS_TOKEN * len(list(group)))
            else:
                parts.append(bytes(group).decode("utf-8", errors="replace"))
        return "".join(parts)


class BPETokenizer(Tokenizer):
    """A `tokenizers` byte-level BPE with the special token `<|eos|>`."""

    def __init__(self, tokenizer: HFTokenizer, name: str, eos_id: int | None = None) -> None:
        """`eos_id` None = the id of `<|eos|>`; pre-tokenized shards may name another."""
        # Documents that contain the literal text "<|eos|>" must round-trip as text, not
        # silently gain a document boundary.
        tokenizer.encode_special_tokens = True
        self._tokenizer = tokenizer
        self.name = name
        self.vocab_size = tokenizer.get_vocab_size()
        self.eos_id = tokenizer.token_to_id(EOS_TOKEN) if eos_id is None else eos_id
        self.fingerprint = hashlib.sha256(tokenizer.to_str().encode()).hexdigest()

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int, name: str) -> "BPETokenizer":
        """Train on `texts` (at most BPE_TRAIN_MAX_CHARS of them) to at most `vocab_size` ids."""
        tokenizer = HFTokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[EOS_TOKEN],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            # The Rust trainer's own bars (pre-processing, counting pairs, merges) on a
            # terminal; a log file gets the start and end lines of `load_tokenizer` instead.
            show_progress=sys.stderr.isatty(),
        )
        # A list, not a generator: errors while reading the corpus (UserError) then surface
        # from our own code instead of from inside the Rust trainer.
        tokenizer.train_from_iterator(list(_take_chars(texts, BPE_TRAIN_MAX_CHARS)), trainer)
        assert tokenizer.get_vocab_size() <= vocab_size, tokenizer.get_vocab_size()
        return cls(tokenizer, name)

    @classmethod
    def load(cls, path: Path, name: str, eos_id: int | None = None) -> "BPETokenizer":
        return cls(HFTokenizer.from_file(str(path)), name, eos_id)

    def save(self, path: Path) -> None:
        """Write atomically: a crash or a concurrent writer never leaves a half-written file."""
        write_atomic(path, self._tokenizer.to_str())

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        # Parallel over documents in Rust threads; `_fast` skips the character offsets, which
        # halves the time and the memory (the ids are the same).
        encodings = self._tokenizer.encode_batch_fast(list(texts), add_special_tokens=False)
        return [encoding.ids for encoding in encodings]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=False)

    def encode_markup(self, text: str) -> list[int]:
        self._tokenizer.encode_special_tokens = False
        try:
            return self._tokenizer.encode(text, add_special_tokens=False).ids
        finally:
            self._tokenizer.encode_special_tokens = True


def build_tokenizer(kind: str, vocab_size: int, corpus: Corpus, cache_dir: Path) -> Tokenizer:
    """`bytes`, `bpe` trained on `corpus` to at most `vocab_size` ids (the model's vocabulary)
    and cached at `cache_dir/tokenizers/bpe-<vocab>-<fingerprint[:16]>.json`, or a pretrained
    tokenizer's path (`data/pretrained.py`)."""
    if kind not in ("bpe", "bytes"):
        from dstrain.data.pretrained import load_pretrained

        return load_pretrained(Path(kind), vocab_size)
    if vocab_size < _MIN_VOCAB:
        raise UserError(
            f"data.tokenizer={kind} needs a vocabulary of at least {_MIN_VOCAB} ids "
            f"(256 bytes + EOS); the model has vocab_size={vocab_size}",
            fix=f"--set model.vocab_size={_MIN_VOCAB} (or more)",
            exit_code=1,
        )
    if kind == "bytes":
        return ByteTokenizer()
    if kind != "bpe":
        raise UserError(f"unknown tokenizer `{kind}`", fix="use data.tokenizer=bpe or bytes")
    name = f"bpe-{vocab_size}"
    path = Path(cache_dir) / "tokenizers" / f"{name}-{corpus.fingerprint[:16]}.json"
    if path.exists():
        try:
            return BPETokenizer.load(path, name)
        except Exception:  # a corrupt cache entry is rebuilt, not reported
            pass
    print(
        f"dstrain: training a byte-level BPE ({vocab_size} ids) on {corpus.name} -> {path}",
        file=sys.stderr,
    )
    texts = (as_text(d) if corpus.chat else d for d in corpus.documents())
    started = time.perf_counter()
    tokenizer = BPETokenizer.train(texts, vocab_size, name)
    tokenizer.save(path)
    print(
        f"dstrain: trained the BPE ({tokenizer.vocab_size} ids) in "
        f"{time.perf_counter() - started:,.1f} s",
        file=sys.stderr,
    )
    return tokenizer


def write_atomic(path: Path, text: str) -> None:
    """Write `text` to a temporary file beside `path`, then rename it over `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as file:
            file.write(text)
        os.chmod(tmp, 0o644)  # mkstemp makes it private; caches are read by other processes
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _take_chars(texts: Iterable[str], max_chars: int) -> Iterator[str]:
    total = 0
    for text in texts:
        yield text
        total += len(text)
        if total >= max_chars:
            return
