"""The loader: windows, per-epoch order, and the global-position contract that makes a step's
data independent of dp_size and micro_batch_size, also across a resume."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dstrain.config.schema import DataConfig
from dstrain.data.build import build_dataset
from dstrain.data.loader import DataLoader, TokenDataset
from dstrain.errors import UserError

SEQ_LEN = 4


class ArangeShards:
    """Token t of the stream is t: every window says where it came from."""

    def __init__(self, total_tokens: int) -> None:
        self.total_tokens = total_tokens
        self._tokens = np.arange(total_tokens, dtype=np.uint32)

    def read(self, start: int, stop: int) -> np.ndarray:
        return self._tokens[start:stop]

    def read_mask(self, start: int, stop: int) -> None:
        return None  # text: every token carries loss


def _dataset(num_samples: int = 37) -> TokenDataset:
    return TokenDataset(ArangeShards(num_samples * SEQ_LEN + 1), SEQ_LEN)


def _loader(dataset: TokenDataset, gbs: int, micro: int, rank: int, dp: int) -> DataLoader:
    return DataLoader(
        dataset, global_batch_size=gbs, micro_batch_size=micro, dp_rank=rank, dp_size=dp, seed=7
    )


def _step(loaders: list[DataLoader]) -> torch.Tensor:
    """One optimizer step over all ranks, concatenated rank-major."""
    return torch.cat([batch for loader in loaders for batch in loader.next_step()])


def test_windows_overlap_by_one_token():
    dataset = TokenDataset(ArangeShards(4 * SEQ_LEN + 3), SEQ_LEN)
    assert len(dataset) == 4
    assert dataset[0].tolist() == [0, 1, 2, 3, 4]
    assert dataset[3].tolist() == [12, 13, 14, 15, 16]


def test_too_few_tokens_for_one_sample():
    with pytest.raises(UserError, match="has 4 tokens; one sample of train.seq_len=4 needs 5"):
        TokenDataset(ArangeShards(4), SEQ_LEN)


def test_micro_batches_are_long_tensors_of_windows():
    batches = _loader(_dataset(), gbs=8, micro=2, rank=0, dp=2).next_step()
    assert len(batches) == 2
    for batch in batches:
        assert batch.dtype == torch.long and batch.shape == (2, SEQ_LEN + 1)
        assert torch.equal(batch[:, 1:] - batch[:, :-1], torch.ones(2, SEQ_LEN, dtype=torch.long))


def test_order_is_a_fresh_permutation_every_epoch():
    dataset = _dataset()
    loader = _loader(dataset, gbs=1, micro=1, rank=0, dp=1)
    n = len(dataset)
    epochs = [[loader.order(p) for p in range(e * n, (e + 1) * n)] for e in range(3)]
    assert all(sorted(epoch) == list(range(n)) for epoch in epochs)
    assert epochs[0] != epochs[1] != epochs[2]
    expected = np.random.default_rng(7 + 2).permutation(n).tolist()
    assert epochs[2] == expected


def test_loader_is_deterministic_and_seeded():
    def run(seed: int) -> list[torch.Tensor]:
        loader = DataLoader(
            _dataset(), global_batch_size=6, micro_batch_size=3, dp_rank=0, dp_size=1, seed=seed
        )
        return [torch.cat(loader.next_step()) for _ in range(4)]

    assert all(torch.equal(a, b) for a, b in zip(run(1), run(1), strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(run(1), run(2), strict=True))


def test_steps_wrap_around_epochs():
    dataset = _dataset(num_samples=10)
    loader = _loader(dataset, gbs=4, micro=4, rank=0, dp=1)
    starts = [loader.next_step()[0][:, 0] // SEQ_LEN for _ in range(5)]  # 20 samples: 2 epochs
    samples = torch.cat(starts).tolist()
    assert sorted(samples[:10]) == sorted(samples[10:]) == list(range(10))
    assert loader.epoch == 2 and loader.sample_position == 20


def test_global_batch_larger_than_an_epoch():
    loader = _loader(_dataset(num_samples=3), gbs=8, micro=8, rank=0, dp=1)
    samples = (loader.next_step()[0][:, 0] // SEQ_LEN).tolist()
    assert sorted(samples[:3]) == sorted(samples[3:6]) == [0, 1, 2]


@settings(max_examples=40, deadline=None)
@given(
    dp=st.sampled_from([1, 2, 4]),
    per_rank_micros=st.integers(1, 3),
    micro=st.integers(1, 3),
    steps=st.integers(1, 6),
)
def test_a_step_does_not_depend_on_dp_size_or_micro_batch_size(dp, per_rank_micros, micro, steps):
    dataset = _dataset()
    gbs = dp * per_rank_micros * micro
    reference = _loader(dataset, gbs=gbs, micro=gbs, rank=0, dp=1)
    ranks = [_loader(dataset, gbs=gbs, micro=micro, rank=r, dp=dp) for r in range(dp)]
    for _ in range(steps):
        assert torch.equal(_step(ranks), _step([reference]))


@settings(max_examples=40, deadline=None)
@given(
    saved_dp=st.sampled_from([1, 2, 4]),
    resumed_dp=st.sampled_from([1, 2, 4]),
    micro=st.sampled_from([1, 2]),
    k=st.integers(0, 12),
)
def test_resume_continues_exactly_across_a_dp_change(saved_dp, resumed_dp, micro, k):
    dataset, gbs = _dataset(), 8
    uninterrupted = _loader(dataset, gbs=gbs, micro=gbs, rank=0, dp=1)
    saved = [_loader(dataset, gbs=gbs, micro=micro, rank=r, dp=saved_dp) for r in range(saved_dp)]
    for _ in range(k):
        assert torch.equal(_step(saved), _step([uninterrupted]))
    states = [loader.state_dict() for loader in saved]
    assert all(state == states[0] for state in states)  # global, not per rank
    resumed = [
        _loader(dataset, gbs=gbs, micro=micro, rank=r, dp=resumed_dp) for r in range(resumed_dp)
    ]
    for loader in resumed:
        loader.load_state_dict(states[0])
    for _ in range(6):
        assert torch.equal(_step(resumed), _step([uninterrupted]))


def test_state_from_other_data_is_refused():
    loader = _loader(_dataset(), gbs=2, micro=1, rank=0, dp=1)
    state = {**loader.state_dict(), "num_samples": 99}
    with pytest.raises(UserError, match="num_samples=99"):
        loader.load_state_dict(state)
    with pytest.raises(UserError, match="seed=3"):
        loader.load_state_dict({**loader.state_dict(), "seed": 3})


@pytest.mark.parametrize(
    ("gbs", "micro", "rank", "dp", "match"),
    [
        (6, 1, 0, 4, "not divisible by the data-parallel size 4"),
        (8, 3, 0, 2, "4 samples per step, not divisible by micro_batch_size=3"),
        (8, 1, 2, 2, "dp_rank=2"),
        (0, 1, 0, 1, "global_batch_size=0"),
    ],
)
def test_bad_batch_layouts(gbs, micro, rank, dp, match):
    with pytest.raises(UserError, match=match):
        _loader(_dataset(), gbs=gbs, micro=micro, rank=rank, dp=dp)


def test_negative_seed():
    with pytest.raises(UserError, match="seed must be >= 0"):
        DataLoader(
            _dataset(), global_batch_size=1, micro_batch_size=1, dp_rank=0, dp_size=1, seed=-1
        )


def test_loader_over_real_shards(tmp_path):
    (tmp_path / "a.txt").write_text("héllo wörld, " * 40)
    cfg = DataConfig(source=str(tmp_path / "a.txt"), tokenizer="bytes", cache_dir=tmp_path)
    tokenizer, dataset = build_dataset(cfg, vocab_size=512, seq_len=16)
    stream = dataset.shards.read(0, dataset.shards.total_tokens)
    loader = DataLoader(
        dataset, global_batch_size=4, micro_batch_size=2, dp_rank=1, dp_size=2, seed=0
    )
    (batch,) = loader.next_step()  # rank 1 of 2: positions 2 and 3
    index = loader.order(3)
    assert batch[1].tolist() == stream[index * 16 : index * 16 + 17].tolist()
    assert tokenizer.decode(stream.tolist()) == "héllo wörld, " * 40 + "<|eos|>"


def test_too_few_tokens_through_build_dataset(tmp_path):
    (tmp_path / "a.txt").write_text("tiny")
    cfg = DataConfig(source=str(tmp_path / "a.txt"), tokenizer="bytes", cache_dir=tmp_path)
    with pytest.raises(UserError, match="has 5 tokens; one sample of train.seq_len=16 needs 17"):
        build_dataset(cfg, vocab_size=512, seq_len=16)
