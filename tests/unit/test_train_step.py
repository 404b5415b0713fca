"""One optimizer step: gradient accumulation equals one big batch, activation checkpointing
changes nothing, and the balancing bias follows the load."""

import pytest
import torch

from dstrain.config.schema import DstrainConfig, LossScaleConfig, OptimConfig
from dstrain.model.transformer import build_model
from dstrain.parallel.parallelize import parallelize_model
from dstrain.train.loss_scale import LossScaler
from dstrain.train.optim import build_optimizer
from dstrain.train.step import backward_scale, clip_grad_norm, train_step
from tests.unit.tiny import tiny_args


def _model(seed: int = 0, **changes):
    torch.manual_seed(seed)
    return build_model(tiny_args(**changes)).double()


def _step(model, micro_batches, precision="fp32", optim="adamw", **kw):
    config = OptimConfig(name=optim, lr=1e-2, weight_decay=kw.get("weight_decay", 0.1))
    optimizer = build_optimizer(model, config)
    args = model.args
    return train_step(
        model,
        optimizer,
        micro_batches,
        scaler=LossScaler(LossScaleConfig(), False),
        precision=precision,
        grad_clip=kw.get("grad_clip", 1.0),
        mtp_weight=args.mtp_loss_weight,
        num_mtp=args.num_mtp_modules,
        bias_update_speed=kw.get("speed", args.bias_update_speed),
    )


def _batch(n: int = 8, seq: int = 17, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 64, (n, seq), generator=torch.Generator().manual_seed(seed))


def _max_diff(a, b) -> float:
    return max(
        (x - y).abs().max().item()
        for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    )


def test_grad_accumulation_4_equals_one_4x_batch():
    """Loss, gradient norm and weights agree to fp64 rounding. Adam's first update is
    ~lr * g / (|g| + eps), which would magnify the rounding of a gradient near eps; no gradient
    here is. Measured: weights 2.2e-15 (AVX512) and 2.3e-15 (AVX2 kernels) apart after AdamW,
    6.9e-18 after SGD; loss and norm 0, MTP loss 8.9e-16. Every bound is fp64's 1e-12, not a
    margin over those."""
    batch = _batch()
    for optim in ("sgd", "adamw"):
        one, four = _model(), _model()
        big = _step(one, [batch], optim=optim)
        small = _step(four, list(batch.split(2)), optim=optim)
        assert abs(big.loss.item() - small.loss.item()) < 1e-12
        assert abs(big.mtp_loss.item() - small.mtp_loss.item()) < 1e-12
        assert abs(big.grad_norm.item() - small.grad_norm.item()) < 1e-12
        assert _max_diff(one, four) < 1e-12, optim


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_activation_checkpointing_changes_nothing(mode):
    batch = _batch()
    plain = _model()
    checkpointed = parallelize_model(
        _model(),
        DstrainConfig.model_validate({"train": {"activation_checkpoint": mode}}),
        device=None,  # already materialised
    )
    a, b = _step(plain, [batch]), _step(checkpointed, [batch])
    assert a.loss.item() == b.loss.item()
    assert _max_diff(plain, checkpointed) == 0.0
    # The load counters saw each token once, not once more during recomputation.
    assert {k: v.tolist() for k, v in a.expert_load.items()} == {
        k.replace("._checkpoint_wrapped_module", ""): v.tolist() for k, v in b.expert_load.items()
    }


def test_balancing_bias_moves_against_the_load():
    model = _model()
    result = _step(model, [_batch()], speed=0.01)
    for name, load in result.expert_load.items():
        tokens = 8 * (15 if name.startswith("mtp.") else 16)  # MTP depth 1 sees one fewer
        assert load.sum().item() == tokens * 2  # tokens x top-k
        bias = model.get_submodule(name).expert_bias
        expected = 0.01 * torch.sign(load.mean() - load)
        assert torch.equal(bias, expected.to(bias.dtype))
        assert model.get_submodule(name).tokens_per_expert.sum() == 0  # reset for the next step


def test_clipping_scales_the_update_by_max_norm_over_the_norm():
    """SGD's first update is -lr x gradient (momentum starts at the gradient; no weight decay):
    unclipped, it gives back the gradient; clipped to a quarter of its norm, the update must be
    that gradient x max_norm / (norm + 1e-6), and the step reports the norm before clipping."""
    lr, batch = 1e-2, _batch()
    free, clipped = _model(), _model()
    start = {n: p.detach().clone() for n, p in free.named_parameters()}
    unclipped = _step(free, [batch], optim="sgd", grad_clip=0.0, weight_decay=0.0)
    grads = {n: (start[n] - p.detach()) / lr for n, p in free.named_parameters()}
    norm = torch.stack([g.square().sum() for g in grads.values()]).sum().sqrt().item()
    # The step sums the squares in fp32 (as on every mesh): measured 5.6e-8 relative here.
    assert abs(unclipped.grad_norm.item() - norm) < 1e-6 * norm
    bound = norm / 4
    result = _step(clipped, [batch], optim="sgd", grad_clip=bound, weight_decay=0.0)
    assert abs(result.grad_norm.item() - norm) < 1e-6 * norm  # the pre-clip norm
    coef = bound / (norm + 1e-6)
    worst = max(
        (p.detach() - (start[n] - lr * coef * grads[n])).abs().max().item()
        for n, p in clipped.named_parameters()
    )
    # Measured 2.2e-12: the step's clip factor is fp32, from its fp32 norm (above).
    assert worst < 1e-11, worst
    moved = max((p.detach() - start[n]).abs().max().item() for n, p in clipped.named_parameters())
    assert moved > 1e-4  # what an unclipped update would add on top: 3x as much
    # A bound above the norm leaves the update alone (the factor is capped at 1, not scaled up).
    loose = _model()
    _step(loose, [batch], optim="sgd", grad_clip=4 * norm, weight_decay=0.0)
    assert _max_diff(loose, free) == 0.0


def test_bf16_autocast_step_is_finite():
    torch.manual_seed(0)
    model = build_model(tiny_args())
    result = _step(model, [_batch()], precision="bf16")
    assert torch.isfinite(result.loss) and not result.skipped


def test_an_uncounted_gradient_is_clipped_but_not_counted():
    """The MTP copy of a tied embedding (under PP) is clipped with the rest, but its gradient,
    the original's already counted, does not enter the norm."""
    counted, copy = torch.nn.Parameter(torch.zeros(2, 2)), torch.nn.Parameter(torch.zeros(2, 2))
    counted.grad = torch.full((2, 2), 1.5)  # norm 3
    copy.grad = torch.full((2, 2), 4.0)
    norm = clip_grad_norm([counted, copy], 1.0, uncounted=frozenset([copy]))
    assert norm.item() == pytest.approx(3.0, rel=1e-7)
    factor = 1.0 / (3.0 + 1e-6)
    assert torch.allclose(counted.grad, torch.full((2, 2), 1.5 * factor), rtol=1e-6, atol=0)
    assert torch.allclose(copy.grad, torch.full((2, 2), 4.0 * factor), rtol=1e-6, atol=0)


@pytest.mark.parametrize("fp16", [False, True])
def test_the_balance_loss_backward_adds_up_over_context_parallel_ranks(fp16):
    """Each cp rank's balance-loss term is a part of one sequence's loss: its backward is cp
    times the dp-only one's (the main loss's multiplier does not change with cp)."""
    scaler = LossScaler(LossScaleConfig(), enabled=fp16)
    alone, split = backward_scale(scaler, 4, 2, cp=1), backward_scale(scaler, 4, 2, cp=2)
    assert split.aux == 2 * alone.aux and split.loss == alone.loss and split.after == alone.after
    assert alone.aux == scaler.loss_multiplier() / (2 * (4 if fp16 else 1))
