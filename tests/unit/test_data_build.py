"""The trainer's entry point on the default data: embedded corpus -> BPE(2048) -> shards."""

import numpy as np
import pytest

from dstrain.config.schema import DataConfig
from dstrain.data.build import build_dataset
from dstrain.data.corpus import embedded_corpus


@pytest.mark.slow  # 3-6 s: trains the real BPE and tokenizes ~6 MB
def test_embedded_corpus_end_to_end_then_cached(tmp_path, capsys):
    cfg = DataConfig(cache_dir=tmp_path)
    tokenizer, dataset = build_dataset(cfg, vocab_size=2048, seq_len=128)
    err = capsys.readouterr().err
    assert "training a byte-level BPE" in err and "tokenizing" in err
    assert tokenizer.vocab_size == 2048 and dataset.shards.manifest.dtype == "uint16"

    stream = dataset.shards.read(0, dataset.shards.total_tokens)
    assert int(stream.max()) < 2048
    ends = np.flatnonzero(stream == tokenizer.eos_id)
    starts = np.concatenate([[0], ends[:-1] + 1])
    decoded = [tokenizer.decode(stream[a:b].tolist()) for a, b in zip(starts, ends, strict=True)]
    assert decoded == list(embedded_corpus().documents())
    assert dataset.num_samples == (len(stream) - 1) // 128

    tokenizer2, dataset2 = build_dataset(cfg, vocab_size=2048, seq_len=128)
    assert capsys.readouterr().err == ""
    assert tokenizer2.fingerprint == tokenizer.fingerprint
    assert dataset2.shards.directory == dataset.shards.directory
