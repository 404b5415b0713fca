"""Cutting the model into pipeline stages (no process group needed): the split, the placement of
stages on ranks, carving the chunks, and the names the union of a rank's chunks keeps."""

import torch

from dstrain.config.flavors import flavor_args
from dstrain.model.flops import stage_forward_flops_per_token
from dstrain.model.transformer import build_model
from dstrain.parallel.pipeline import (
    PipelineModel,
    balanced_split,
    carve_stage,
    split_layers,
    stage_indices,
)
from tests.unit.tiny import tiny_args


def test_split_layers_trims_the_ends():
    assert split_layers(61, 16, 1, 2) == [range(0, 3)] + [
        range(3 + 4 * i, 7 + 4 * i) for i in range(14)
    ] + [range(59, 61)]
    assert [len(r) for r in split_layers(8, 4, 0, 0)] == [2, 2, 2, 2]


def test_stage_placement_looped_and_v_shaped():
    assert stage_indices("1f1b", 4, 1, 2) == [2]
    assert stage_indices("interleaved-1f1b", 4, 2, 1) == [1, 5]
    assert stage_indices("zbv", 4, 2, 0) == [0, 7]
    assert stage_indices("dualpipev", 4, 2, 3) == [3, 4]


def test_default_split_balances_flops_per_rank():
    debug8 = flavor_args("debug").model_copy(update={"num_layers": 8})
    split = balanced_split(debug8, 128, "1f1b", 2, 1)
    assert [len(r) for r in split] == [6, 2]  # head + MTP cost about four of these blocks
    costs = [
        stage_forward_flops_per_token(debug8, 128, r, last=i == 1) for i, r in enumerate(split)
    ]
    assert max(costs) / min(costs) < 1.3
    # V-shaped: rank 0 holds both ends, so the middle stages take the blocks.
    assert [len(r) for r in balanced_split(debug8, 128, "zbv", 2, 2)] == [1, 3, 3, 1]
    v3 = balanced_split(flavor_args("deepseek-v3"), 4096, "1f1b", 16, 1)
    assert [len(r) for r in v3] == [4] * 15 + [1] and v3[-1] == range(60, 61)
    assert all(len(r) >= 1 for r in balanced_split(flavor_args("debug"), 32, "1f1b", 4, 1))


def test_v3_over_32_dualpipev_stages_leaves_the_last_the_head_alone():
    """61 layers over pp16 x 2 V-shaped stages: no split gives every stage a block, so an end
    stage holds none, as `check` allows (the published layout: first 1 less, last 2 less). It
    was an empty split once, and `plan --emit-config`'s V3 config crashed the dry run."""
    split = balanced_split(flavor_args("deepseek-v3"), 4096, "dualpipev", 16, 2)
    assert len(split) == 32 and sum(len(r) for r in split) == 61
    assert [len(split[0]), len(split[-1])] == [1, 0] and {len(r) for r in split[1:-1]} == {2}


def test_carved_stages_share_modules_and_keep_the_model_names():
    args = tiny_args(num_layers=4, num_mtp_modules=1)
    model = build_model(args)
    names = {n for n, _ in model.named_parameters()}
    split = split_layers(4, 2, 0, 0)
    first = carve_stage(model, split[0], first=True, last=False)
    last = carve_stage(model, split[1], first=False, last=True)
    assert first.layers["0"] is model.layers["0"] and first.head is None and first.mtp is None
    assert last.embed is None and last.mtp is model.mtp and last.head is model.head
    assert torch.equal(last.mtp_embed.weight, model.embed.weight)
    assert last.mtp_embed.weight is not model.embed.weight  # a copy: the tied pair
    rank0 = {n for n, _ in PipelineModel([first]).named_parameters()}
    rank1 = {n for n, _ in PipelineModel([last]).named_parameters()}
    assert rank0 | (rank1 - {"mtp_embed.weight"}) == names and not rank0 & rank1


def test_two_stages_compose_to_the_whole_model():
    args = tiny_args(num_layers=4, num_mtp_modules=1)
    model = build_model(args)
    split = split_layers(4, 2, 0, 2)  # 3 + 1 layers
    first = carve_stage(model, split[0], first=True, last=False)
    last = carve_stage(model, split[1], first=False, last=True)
    tokens = torch.randint(0, args.vocab_size, (2, 17))
    whole = model(tokens[:, :-1])
    staged = last(first(tokens[:, :-1]), next_tokens=tokens[:, 1:])
    for a, b in zip(whole, staged, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
