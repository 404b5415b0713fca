"""RMSNorm and the dense feed-forward blocks against their formulas."""

import pytest
import torch
import torch.nn.functional as F

from dstrain.model.ffn import FeedForward
from dstrain.model.norm import RMSNorm


def _rms_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


def _norm(dim: int, eps: float = 1e-6) -> RMSNorm:
    norm = RMSNorm(dim, eps)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.5 * torch.randn(dim, generator=torch.Generator().manual_seed(0)))
    return norm


def test_rmsnorm_matches_its_formula_in_fp32():
    norm, x = _norm(24, eps=1e-3), torch.randn(3, 5, 24)
    got = norm(x)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, _rms_reference(x, norm.weight, 1e-3).float())


def test_rmsnorm_computes_bf16_inputs_in_fp32():
    norm = _norm(64)
    x = (torch.randn(4, 64) * 30).bfloat16()
    got = norm.bfloat16()(x)
    assert got.dtype == torch.bfloat16
    # Normalized in fp32, then rounded once to bf16 before and once after the weight: within
    # 2 bf16 ulps (2 * 2**-8 relative) of the exact value.
    expected = _rms_reference(x.float(), norm.weight.float(), 1e-6)
    torch.testing.assert_close(got.double(), expected, rtol=2**-7, atol=1e-6)


def test_rmsnorm_keeps_fp64_precision():
    norm = _norm(24).double()
    x = torch.randn(3, 24, dtype=torch.float64)
    torch.testing.assert_close(norm(x), _rms_reference(x, norm.weight, 1e-6), rtol=1e-12, atol=0)


@pytest.mark.parametrize("kind", ["swiglu", "gelu"])
def test_feed_forward_matches_its_formula(kind):
    torch.manual_seed(0)
    ffn = FeedForward(16, 24, kind).double()
    x = torch.randn(5, 16, dtype=torch.float64)
    w1, w2 = ffn.w1.weight, ffn.w2.weight
    if kind == "swiglu":
        expected = (F.silu(x @ w1.T) * (x @ ffn.w3.weight.T)) @ w2.T
    else:
        assert ffn.w3 is None  # two matrices, as flops.py counts
        inner = x @ w1.T  # tanh-approximate GELU, as GPT-2 defines it
        gelu = 0.5 * inner * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (inner + 0.044715 * inner**3)))
        expected = gelu @ w2.T
    torch.testing.assert_close(ffn(x), expected, rtol=1e-12, atol=1e-12)
