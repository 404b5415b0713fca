"""The DeepSeekMoE router: affinities, biased top-k choice, unbiased gate weights, group-limited
routing, the auxiliary-loss-free bias update and the load counts it learns from.

Legend: T tokens, D dim, E routed experts, K activated experts, G groups.
"""

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from dstrain.config.model_args import ModelArgs
from dstrain.model.moe import MoE, Router

BASE = ModelArgs(
    dim=16,
    num_routed_experts=8,
    num_activated_experts=2,
    num_shared_experts=1,
    moe_inter_dim=8,
    n_group=1,
    topk_group=1,
)
T = 24


def _variant(**changes) -> ModelArgs:
    return ModelArgs(**{**BASE.model_dump(), **changes})


def _router(args: ModelArgs, bias_std: float = 0.0, seed: int = 0) -> Router:
    torch.manual_seed(seed)
    router = Router(args)
    with torch.no_grad():
        router.gate.weight.normal_(0, 0.5)
        if bias_std:
            router.expert_bias.normal_(0, bias_std)
    return router


def _x(args: ModelArgs, seed: int = 1, tokens: int = T) -> torch.Tensor:
    return torch.randn(tokens, args.dim, generator=torch.Generator().manual_seed(seed))


def _identity_router(args: ModelArgs) -> Router:
    """dim == E and gate = I: the router logits are the input rows themselves."""
    router = Router(args)
    with torch.no_grad():
        router.gate.weight.copy_(torch.eye(args.num_routed_experts))
    return router


@pytest.mark.parametrize("score_func", ["sigmoid", "softmax"])
def test_affinities_are_sigmoid_or_softmax_of_the_gate_logits(score_func):
    args = _variant(score_func=score_func)
    router, x = _router(args), _x(args)
    _, _, scores_TE = router(x)
    logits_TE = x @ router.gate.weight.T
    expected = logits_TE.sigmoid() if score_func == "sigmoid" else logits_TE.softmax(-1)
    assert scores_TE.dtype == torch.float32
    torch.testing.assert_close(scores_TE, expected)


@pytest.mark.parametrize("score_func", ["sigmoid", "softmax"])
def test_topk_picks_the_highest_biased_affinities(score_func):
    args = _variant(score_func=score_func, num_activated_experts=3)
    router, x = _router(args, bias_std=0.3), _x(args)
    _, experts_TK, scores_TE = router(x)
    biased_TE = scores_TE + router.expert_bias
    chosen = torch.zeros_like(biased_TE, dtype=torch.bool).scatter_(1, experts_TK, True)
    assert (chosen.sum(-1) == 3).all()  # K distinct experts per token
    lowest_chosen = biased_TE.masked_fill(~chosen, float("inf")).amin(-1)
    highest_other = biased_TE.masked_fill(chosen, float("-inf")).amax(-1)
    assert (lowest_chosen > highest_other).all()
    # Non-vacuous: the bias changed the choice of some tokens.
    unbiased = scores_TE.topk(3, dim=-1).indices.sort(-1).values
    assert (unbiased != experts_TK.sort(-1).values).any()


@pytest.mark.parametrize("norm_topk_prob", [True, False])
@pytest.mark.parametrize("score_func", ["sigmoid", "softmax"])
def test_gate_weights_use_the_unbiased_affinities(score_func, norm_topk_prob):
    args = _variant(score_func=score_func, norm_topk_prob=norm_topk_prob, route_scale=2.5)
    router, x = _router(args, bias_std=0.3), _x(args)
    weights_TK, experts_TK, scores_TE = router(x)
    expected = scores_TE.gather(1, experts_TK)
    if norm_topk_prob:
        expected = expected / expected.sum(-1, keepdim=True)
    torch.testing.assert_close(weights_TK, 2.5 * expected)
    if norm_topk_prob:
        torch.testing.assert_close(weights_TK.sum(-1), torch.full((T,), 2.5))
    # Shifting every bias by one constant keeps the choice; the weights ignore the bias.
    with torch.no_grad():
        router.expert_bias -= 0.05
    again_TK, same_experts_TK, _ = router(x)
    assert torch.equal(same_experts_TK, experts_TK)
    assert torch.equal(again_TK, weights_TK)


def test_bias_changes_the_choice_but_gate_weights_follow_the_unbiased_scores():
    args = _variant(dim=8, n_group=1, num_activated_experts=2, norm_topk_prob=False)
    router = _identity_router(args)
    s = torch.tensor([[0.9, 0.8, 0.7, 0.1, 0.1, 0.1, 0.1, 0.1]])
    x = torch.logit(s)
    with torch.no_grad():
        router.expert_bias[1] = -0.5  # expert 1 drops out of the top 2; 0 and 2 are chosen
    weights_TK, experts_TK, _ = router(x)
    assert sorted(experts_TK[0].tolist()) == [0, 2]
    got = dict(zip(experts_TK[0].tolist(), weights_TK[0].tolist(), strict=True))
    assert got == pytest.approx({0: 0.9, 2: 0.7})  # s, not s + b


def _allowed_groups(biased_TE: torch.Tensor, args: ModelArgs) -> torch.Tensor:
    """[T, G] bool: the topk_group best groups by the V3 (sigmoid) or V2 (softmax) rule."""
    grouped = biased_TE.view(biased_TE.size(0), args.n_group, -1)
    if args.score_func == "sigmoid":
        group_score = grouped.sort(-1, descending=True).values[..., :2].sum(-1)
    else:
        group_score = grouped.max(-1).values
    best = group_score.topk(args.topk_group, dim=-1).indices
    return torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, best, True)


@pytest.mark.parametrize("score_func", ["sigmoid", "softmax"])
@pytest.mark.parametrize("seed", range(4))
def test_group_limited_routing_stays_in_the_best_groups(score_func, seed):
    args = _variant(
        score_func=score_func,
        num_routed_experts=16,
        num_activated_experts=4,
        n_group=4,
        topk_group=2,
    )
    router, x = _router(args, bias_std=0.2, seed=seed), _x(args, seed=seed + 10)
    _, experts_TK, scores_TE = router(x)
    biased_TE = scores_TE + router.expert_bias
    allowed_TG = _allowed_groups(biased_TE, args)
    group_of_TK = experts_TK // (16 // 4)
    assert allowed_TG.gather(1, group_of_TK).all()
    # Within the allowed groups the choice is the plain biased top-k.
    allowed_TE = allowed_TG.repeat_interleave(16 // 4, dim=1)
    expected = biased_TE.masked_fill(~allowed_TE, float("-inf")).topk(4, dim=-1).indices
    assert torch.equal(expected.sort(-1).values, experts_TK.sort(-1).values)
    # Non-vacuous: without the group limit some tokens would pick an expert elsewhere.
    free = biased_TE.topk(4, dim=-1).indices
    assert (~allowed_TG.gather(1, free // 4)).any()


@pytest.mark.parametrize(
    "score_func,expected",
    [("sigmoid", [4, 5]), ("softmax", [0, 1])],
    ids=["sigmoid-top2-sum", "softmax-max"],
)
def test_group_score_rule(score_func, expected):
    """Group A = experts 0-3 holds the single best expert, group B = 4-7 the best pair: V3 sums
    each group's two best affinities (B wins), V2 takes each group's best (A wins)."""
    args = _variant(dim=8, score_func=score_func, n_group=2, topk_group=1, num_activated_experts=2)
    router = _identity_router(args)
    if score_func == "sigmoid":
        x = torch.logit(torch.tensor([[0.95, 0.3, 0.1, 0.1, 0.8, 0.8, 0.1, 0.1]]))
    else:
        x = torch.tensor([[3.0, 1.0, 0.0, 0.0, 2.5, 2.5, 0.0, 0.0]])
    _, experts_TK, _ = router(x)
    assert sorted(experts_TK[0].tolist()) == expected


def test_update_bias_moves_each_expert_by_exactly_speed_towards_balance():
    router = _router(_variant())
    speed = 2.0**-10  # a power of two: the updates below are exact in fp32
    start = torch.tensor([3, -1, 0, 2, 5, 0, -4, 1], dtype=torch.float32) * speed
    with torch.no_grad():
        router.expert_bias.copy_(start)
    load = torch.tensor([10, 2, 6, 6, 0, 12, 6, 6])  # mean 6
    router.update_bias(load, speed)
    step = router.expert_bias - start
    # Under-loaded experts (load < mean) go up, over-loaded ones down, balanced ones stay.
    expected = torch.tensor([-1, 1, 0, 0, 1, -1, 0, 0], dtype=torch.float32) * speed
    assert torch.equal(step, expected)


def test_update_bias_with_zero_speed_is_a_no_op():
    router = _router(_variant(), bias_std=0.1)
    before = router.expert_bias.clone()
    router.update_bias(torch.tensor([9, 0, 1, 2, 3, 4, 5, 6]), 0.0)
    assert torch.equal(router.expert_bias, before)


def test_tokens_per_expert_counts_every_assignment_and_accumulates():
    args = _variant()
    router, x = _router(args), _x(args)
    _, experts_TK, _ = router(x)
    assert router.tokens_per_expert.sum() == 0  # the MoE counts, on all of its tokens
    router.count(experts_TK)
    expected = torch.bincount(experts_TK.flatten(), minlength=8).float()
    assert torch.equal(router.tokens_per_expert, expected)
    assert router.tokens_per_expert.sum() == T * args.num_activated_experts
    router.count(experts_TK)
    assert torch.equal(router.tokens_per_expert, 2 * expected)


def test_tokens_per_expert_is_not_double_counted_under_activation_checkpointing():
    args = _variant(n_group=2, topk_group=1)
    torch.manual_seed(0)
    moe = MoE(args)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.2)
    calls = []
    moe.router.register_forward_hook(lambda *_: calls.append(1))
    x = torch.randn(2, T // 2, args.dim, requires_grad=True)
    out = checkpoint(moe, x, use_reentrant=False)
    after_forward = moe.router.tokens_per_expert.clone()
    assert after_forward.sum() == T * args.num_activated_experts
    out.square().sum().backward()
    assert len(calls) == 2  # the router did run again inside backward (recomputation)
    assert torch.equal(moe.router.tokens_per_expert, after_forward)
    assert moe.router.gate.weight.grad is not None and x.grad is not None
