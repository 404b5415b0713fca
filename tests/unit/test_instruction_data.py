"""Instruction data: JSONL `messages` (rendered with the chat template) or `prompt`/`response`,
with the loss on response tokens only; one clear error per bad line; the normalisation counts
only tokens that carry loss, so gradient accumulation matches one big batch."""

import json

import pytest
import torch

from dstrain.config.load import load_config
from dstrain.data.build import build_dataset
from dstrain.data.instructions import Record, pieces, render
from dstrain.errors import UserError
from dstrain.train.loss import IGNORE_INDEX, inputs_of, labels_of

CONVERSATIONS = [
    {
        "messages": [
            {"role": "user", "content": "add 2 and 2"},
            {"role": "assistant", "content": "4"},
        ]
    },
    {"prompt": "capital of France?", "response": "Paris"},
    {
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "colour of the sky?"},
            {"role": "assistant", "content": "blue"},
            {"role": "user", "content": "and grass?"},
            {"role": "assistant", "content": "green"},
        ]
    },
]


def _write(tmp_path, records):
    path = tmp_path / "sft.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return path


def test_spans_cover_each_response_and_its_end_of_turn():
    rendered = render(Record(CONVERSATIONS[2], "x:1"), None)
    losses = "".join(piece for piece, loss in pieces(rendered) if loss)
    assert losses == "blue\ngreen\n" and rendered.ends_with_response
    assert "".join(piece for piece, _ in pieces(rendered)) == rendered.text


@pytest.mark.parametrize("tokenizer", ["bytes", "bpe"])
def test_only_response_tokens_are_targets(tmp_path, tokenizer):
    source = _write(tmp_path, CONVERSATIONS * 20)
    overrides = [
        f"data.source={source}",
        f"data.tokenizer={tokenizer}",
        f"data.cache_dir={tmp_path}",
    ]
    config = load_config(None, overrides).config
    tok, dataset = build_dataset(config.data, vocab_size=512, seq_len=64)
    assert dataset.shards.manifest.loss_mask
    window = torch.from_numpy(dataset[0])[None]
    labels, inputs = labels_of(window)[0], inputs_of(window)[0]
    assert (inputs >= 0).all()
    targets = tok.decode([t for t in labels.tolist() if t != IGNORE_INDEX])
    assert "4" in targets and "capital" not in targets and "add 2" not in targets
    assert (labels == IGNORE_INDEX).any() and (labels != IGNORE_INDEX).any()


def test_gradient_accumulation_counts_only_loss_tokens():
    from tests.unit.test_train_step import _max_diff, _model, _step

    torch.manual_seed(0)
    batch = torch.randint(0, 64, (4, 17))
    prompt = torch.rand(4, 17) < 0.6  # 60% of the targets carry no loss
    batch = torch.where(prompt, ~batch, batch)
    one, four = _model(), _model()
    big = _step(one, [batch])
    small = _step(four, list(batch.split(1)))
    # fp64, measured: losses 8.9e-16 (AVX512) and 0 (AVX2 kernels) apart, weights after one
    # AdamW step 1.2e-14 and 3.2e-14. The bounds are fp64's 1e-12, not a margin over those.
    assert abs(big.loss.item() - small.loss.item()) < 1e-12
    assert _max_diff(one, four) < 1e-12
    assert big.tokens == int((~prompt[:, 1:]).sum())


@pytest.mark.parametrize(
    "line, words",
    [
        ('{"messages": "hi"}', "not a non-empty list"),
        ('{"messages": [{"role": "user"}]}', "without `role` and `content`"),
        ('{"question": "q", "answer": "a"}', "neither `messages` nor `prompt`/`response`"),
        ("[1, 2]", "not an object"),
        ('{"prompt": "a", ', "malformed JSON"),
    ],
)
def test_a_bad_line_is_one_error_naming_file_and_line(tmp_path, line, words):
    source = tmp_path / "bad.jsonl"
    source.write_text(json.dumps(CONVERSATIONS[1]) + "\n" + line + "\n")
    overrides = [
        f"data.source={source}",
        "data.format=chat",
        "data.tokenizer=bytes",
        f"data.cache_dir={tmp_path / 'cache'}",
    ]
    config = load_config(None, overrides).config
    with pytest.raises(UserError) as caught:
        build_dataset(config.data, vocab_size=512, seq_len=8)
    assert f"{source}:2" in caught.value.message and words in caught.value.message
    shards = tmp_path / "cache" / "shards"
    assert not shards.exists() or not any(shards.iterdir())  # nothing half-written left
