"""One call for the trainer: data config -> (tokenizer, dataset), cached under `data.cache_dir`."""

import sys
from pathlib import Path

from dstrain.config.schema import DataConfig, EvalConfig
from dstrain.data.corpus import EMBEDDED, open_corpus
from dstrain.data.loader import TokenDataset
from dstrain.data.shards import Shards, build_shards, is_shard_dir, open_shards
from dstrain.data.tokenizer import Tokenizer, build_tokenizer
from dstrain.errors import UserError


def build_dataset(
    cfg: DataConfig, *, vocab_size: int, seq_len: int
) -> tuple[Tokenizer, TokenDataset]:
    """Corpus -> tokenizer -> shards -> dataset. `vocab_size` is the model's: every token id is
    below it. The first run trains the BPE and tokenizes (one line on stderr each); later runs
    only fingerprint the corpus and map the cached shards.

    Every rank may call this at once (writes are atomic, the last rename wins), but each would
    tokenize: let one rank per node build first when the corpus is large.
    """
    source = Path(cfg.source)
    if cfg.source != EMBEDDED and is_shard_dir(source):
        shards = open_shards(source)
        tokenizer = _pretokenized_tokenizer(shards, cfg, vocab_size)
    else:
        corpus = open_corpus(
            cfg.source, text_field=cfg.text_field, cache_dir=cfg.cache_dir, data_format=cfg.format
        )
        tokenizer = build_tokenizer(cfg.tokenizer, vocab_size, corpus, cfg.cache_dir)
        shards = build_shards(corpus, tokenizer, cfg.cache_dir)
    return tokenizer, TokenDataset(shards, seq_len)


def split_eval(
    cfg: EvalConfig, data: DataConfig, tokenizer: Tokenizer, train: TokenDataset, min_samples: int
) -> tuple[TokenDataset, TokenDataset | None]:
    """(training samples, validation samples or None): `eval.source`'s own files, tokenized
    with the training tokenizer, or the last `eval.fraction` of the training windows (then no
    longer trained on). `min_samples`: one validation batch, which the split must hold."""
    if cfg.source is not None:
        corpus = open_corpus(
            cfg.source,
            text_field=data.text_field,
            cache_dir=data.cache_dir,
            data_format=data.format,
        )
        held = TokenDataset(build_shards(corpus, tokenizer, data.cache_dir), train.seq_len)
    elif cfg.fraction > 0:
        count = int(train.num_samples * cfg.fraction)
        if count < min_samples or count >= train.num_samples:
            raise UserError(
                f"eval.fraction={cfg.fraction} of {train.num_samples} samples is {count}: "
                f"validation needs {min_samples} (one global batch) and training at least one",
                "raise eval.fraction, lower train.global_batch_size, or give eval.source files",
                exit_code=1,
            )
        kept = train.num_samples - count
        held = TokenDataset(train.shards, train.seq_len, train.first + kept, count)
        train = TokenDataset(train.shards, train.seq_len, train.first, kept)
    else:
        return train, None
    if held.num_samples < min_samples:
        raise UserError(
            f"eval.source holds {held.num_samples} samples of train.seq_len={train.seq_len}; "
            f"one validation batch needs {min_samples}",
            "give more validation text, or lower train.global_batch_size",
            exit_code=1,
        )
    return train, held


def _pretokenized_tokenizer(shards: Shards, cfg: DataConfig, vocab_size: int) -> Tokenizer:
    """The shards' own tokenizer; data.tokenizer does not apply to pre-tokenized data."""
    manifest = shards.manifest
    if manifest.vocab_size > vocab_size:
        raise UserError(
            f"{shards.directory} was tokenized with {manifest.tokenizer} ({manifest.vocab_size} "
            f"ids), more than the model's vocab_size={vocab_size}",
            fix=f"--set model.vocab_size={manifest.vocab_size}",
            exit_code=1,
        )
    tokenizer = shards.tokenizer()
    if not tokenizer.name.startswith(cfg.tokenizer):
        print(
            f"dstrain: data.tokenizer={cfg.tokenizer} is ignored: {shards.directory} is already "
            f"tokenized with {tokenizer.name}",
            file=sys.stderr,
        )
    return tokenizer
