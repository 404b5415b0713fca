"""The trainer's parts: schedules, loss scaling, parameter groups, loss normalization."""

import math

import pytest
import torch

from dstrain.config.schema import LossScaleConfig, LRConfig, OptimConfig
from dstrain.model.transformer import Transformer
from dstrain.train.loss import IGNORE_INDEX, TokenCounts, loss_terms, split_targets
from dstrain.train.loss_scale import LossScaler
from dstrain.train.lr import lr_factor
from dstrain.train.optim import build_optimizer, param_groups
from tests.unit.tiny import tiny_args


@pytest.mark.parametrize("schedule", ["constant", "cosine", "linear", "wsd"])
def test_schedules_warm_up_then_end_at_the_floor(schedule):
    cfg = LRConfig(schedule=schedule, warmup_steps=10, min_lr_ratio=0.1, wsd_decay_ratio=0.2)
    factors = [lr_factor(s, cfg, 100) for s in range(100)]
    assert factors[0] == pytest.approx(0.1) and factors[9] == pytest.approx(1.0)
    assert all(a < b for a, b in zip(factors[:9], factors[1:10], strict=True))
    end = lr_factor(100, cfg, 100)
    assert end == pytest.approx(1.0 if schedule == "constant" else 0.1)
    if schedule == "wsd":  # stable until the last 20% of the post-warmup steps
        assert factors[10:82] == [1.0] * 72 and factors[90] < 1.0
    if schedule == "cosine":
        assert factors[55] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))


def test_loss_scaler_follows_deepspeed():
    scaler = LossScaler(
        LossScaleConfig(
            initial_scale_power=4, loss_scale_window=3, hysteresis=2, min_loss_scale=2.0
        ),
        enabled=True,
    )
    param = torch.nn.Parameter(torch.ones(2))

    def step(grad):
        param.grad = torch.tensor(grad) * scaler.scale
        finite = not scaler.unscale([param], param.device).item()
        scaler.update(finite)
        return finite

    assert scaler.scale == 16
    assert step([1.0, 2.0]) and torch.equal(param.grad, torch.tensor([1.0, 2.0]))
    assert not step([math.inf, 0.0]) and scaler.scale == 16  # hysteresis absorbs the first
    assert not step([math.nan, 0.0]) and scaler.scale == 8  # the second halves
    assert not step([math.inf, 0.0]) and scaler.scale == 4  # and the next ones too
    for _ in range(2):
        assert step([1.0, 1.0]) and scaler.scale == 4  # the window counts from the overflow
    assert step([1.0, 1.0]) and scaler.scale == 8  # doubled after a clean window, not before
    for _ in range(6):
        step([math.inf, 0.0])
    assert scaler.scale == 2.0  # never below min_loss_scale
    restored = LossScaler(LossScaleConfig(), enabled=True)
    restored.load_state_dict(scaler.state_dict())
    assert restored.state_dict() == scaler.state_dict()


def test_static_loss_scale_never_changes():
    scaler = LossScaler(LossScaleConfig(loss_scale=128.0), enabled=True)
    param = torch.nn.Parameter(torch.ones(1))
    param.grad = torch.tensor([math.inf])
    assert scaler.unscale([param], param.device).item() == 1
    scaler.update(False)
    assert scaler.scale == 128.0


def test_no_weight_decay_on_vectors():
    model = Transformer(tiny_args())
    decay, no_decay = param_groups(model, 0.1)
    assert all(p.dim() >= 2 for p in decay["params"]) and decay["weight_decay"] == 0.1
    assert all(p.dim() == 1 for p in no_decay["params"]) and no_decay["weight_decay"] == 0.0
    norms = {id(m.weight) for n, m in model.named_modules() if n.endswith("norm")}
    assert norms <= {id(p) for p in no_decay["params"]}
    optimizer = build_optimizer(model, OptimConfig())
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]


def test_loss_is_normalized_by_global_token_count():
    torch.manual_seed(0)
    logits = torch.randn(4, 6, 11)
    labels = torch.randint(0, 11, (4, 6))
    labels[0, :2] = IGNORE_INDEX
    whole = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX
    )
    counts = TokenCounts.of([labels[:2], labels[2:]], num_mtp=0)
    assert counts.per_depth == (22,)
    halves = sum(loss_terms(logits[i : i + 2], labels[i : i + 2], counts, 0.3)[0] for i in (0, 2))
    # fp32, measured bit for bit on AVX512 and AVX2 kernels. 1e-6 is 4 ulps at this loss (2.7):
    # the tightest bound short of exact for sums taken in another order.
    assert torch.allclose(halves, whole, atol=1e-6, rtol=0)


def test_mtp_loss_weights_each_depth_by_its_own_count():
    torch.manual_seed(0)
    main, mtp1 = torch.randn(2, 5, 7), torch.randn(2, 4, 7)
    labels = torch.randint(0, 7, (2, 5))
    counts = TokenCounts.of([labels], num_mtp=1)
    total, parts = loss_terms((main, mtp1), labels, counts, mtp_weight=0.3)
    ce = torch.nn.functional.cross_entropy
    expected_mtp = ce(mtp1.flatten(0, 1), labels[:, 1:].flatten())
    # fp32, measured bit for bit on AVX512 and AVX2 kernels. 1e-6 is 4 ulps at these losses
    # (2.3 and 2.7): the tightest bound short of exact for sums taken in another order.
    assert torch.allclose(parts["mtp"], expected_mtp, atol=1e-6)
    assert torch.allclose(
        total, ce(main.flatten(0, 1), labels.flatten()) + 0.3 * expected_mtp, atol=1e-6
    )


def test_a_tuple_of_the_main_logits_alone_is_the_main_loss():
    torch.manual_seed(0)
    logits, labels = torch.randn(2, 5, 7), torch.randint(0, 7, (2, 5))
    counts = TokenCounts.of([labels], num_mtp=0)
    total, parts = loss_terms((logits,), labels, counts, mtp_weight=0.3)
    assert torch.equal(total, loss_terms(logits, labels, counts, mtp_weight=0.3)[0])
    assert parts.keys() == {"main"}


@pytest.mark.parametrize("num_mtp", [1, 2])
def test_split_targets_give_every_depth_its_shifted_labels(num_mtp):
    """Under context parallelism each depth's targets are cut to the sequence's length (ignored
    past its end) before the split: depth k's target at position i is token i + k + 1."""
    labels = torch.arange(10, 16).view(1, 6)
    targets = split_targets(labels, num_mtp, split=lambda x: x)
    assert len(targets) == num_mtp + 1
    for k, target in enumerate(targets):
        assert target.tolist() == [[*range(10 + k, 16), *[IGNORE_INDEX] * k]], k


def test_the_loss_scale_first_grows_after_a_whole_clean_window():
    scaler = LossScaler(LossScaleConfig(initial_scale_power=4, loss_scale_window=3), enabled=True)
    for step in range(1, 7):
        scaler.update(True)
        assert scaler.scale == (16 if step < 3 else 32 if step < 6 else 64), step
