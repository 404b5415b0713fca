"""`data.tokenizer` as a pretrained tokenizer: a tokenizer.json file or a Hugging Face tokenizer
folder (its BOS/EOS and chat template taken from tokenizer_config.json), built here with the
`tokenizers` library (no download)."""

import json

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from dstrain.config.load import load_config
from dstrain.data.build import build_dataset
from dstrain.data.pretrained import load_pretrained
from dstrain.errors import UserError

TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"


@pytest.fixture
def tokenizer_dir(tmp_path):
    """A 300-id byte-level BPE with <s>, </s> and role tokens, as a Hugging Face folder."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<s>", "</s>", "<|user|>", "<|assistant|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(["hello world, the quick brown fox " * 50], trainer)
    folder = tmp_path / "tok"
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": {"content": "</s>"}, "add_bos_token": True}
    (folder / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": TEMPLATE}))
    return folder


def test_special_tokens_and_template_come_from_the_folder(tokenizer_dir):
    tok = load_pretrained(tokenizer_dir, model_vocab=512)
    raw = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    assert tok.eos_id == raw.token_to_id("</s>") and tok.bos_id == raw.token_to_id("<s>")
    assert tok.chat_template == TEMPLATE and tok.vocab_size == raw.get_vocab_size()
    assert tok.decode(tok.encode("hello world")) == "hello world"
    file_only = load_pretrained(tokenizer_dir / "tokenizer.json", model_vocab=512)
    assert file_only.eos_id == tok.eos_id


def test_documents_get_bos_and_eos_in_the_shards(tokenizer_dir, tmp_path):
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("\n".join(json.dumps({"text": f"hello fox number {i}"}) for i in range(20)))
    config = load_config(
        None,
        [f"data.source={corpus}", f"data.tokenizer={tokenizer_dir}", f"data.cache_dir={tmp_path}"],
    ).config
    tok, dataset = build_dataset(config.data, vocab_size=512, seq_len=8)
    stream = dataset.shards.read(0, dataset.shards.total_tokens)
    assert stream[0] == tok.bos_id
    ends = np.flatnonzero(stream == tok.eos_id)
    assert len(ends) == 20 and all(stream[e + 1] == tok.bos_id for e in ends[:-1])


def test_a_vocabulary_larger_than_the_embedding_is_an_error(tokenizer_dir):
    vocab = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).get_vocab_size()
    with pytest.raises(UserError) as caught:
        load_pretrained(tokenizer_dir, model_vocab=256)
    assert "more than the model's vocab_size=256" in caught.value.message
    assert f"model.vocab_size={vocab}" in caught.value.fix


def test_bad_tokenizer_paths_are_one_message(tmp_path, cli):
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(UserError, match="not a tokenizers JSON file"):
        load_pretrained(tmp_path / "broken.json", model_vocab=512)
    result = cli("check", "--set", f"data.tokenizer={tmp_path / 'missing'}")
    assert result.code == 1 and "tokenizer not found" in result.text
