"""One call for the trainer: data config -> (tokenizer, dataset), cached under `data.cache_dir`."""

import sys
from pathlib import Path

from dstrain.config.schema import DataConfig
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
