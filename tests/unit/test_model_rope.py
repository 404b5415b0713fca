"""RoPE with YaRN: frequencies and attention factor against transformers' own YaRN code, and the
rotation's defining properties (a rotation of interleaved pairs; scores depend only on the
position difference)."""

import math

import pytest
import torch

from dstrain.config.model_args import ModelArgs
from dstrain.model.rope import RotaryEmbedding, apply_rope, inverse_frequencies

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import _compute_yarn_parameters  # noqa: E402
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (  # noqa: E402
    DeepseekV3RotaryEmbedding,
)

YARN_CASES = {
    # DeepSeek-V3's published numbers (mscale = mscale_all_dim: attention factor 1).
    "v3": dict(dim=64, rope_factor=40.0, original_seq_len=4096, mscale=1.0, mscale_all_dim=1.0),
    "v2-lite": dict(
        dim=16, rope_factor=4.0, original_seq_len=16, mscale=0.707, mscale_all_dim=0.707
    ),
    # mscale != mscale_all_dim: the attention factor is their ratio of YaRN temperatures.
    "ratio": dict(
        dim=16,
        rope_factor=8.0,
        original_seq_len=64,
        beta_fast=16.0,
        beta_slow=2.0,
        mscale_all_dim=0.5,
    ),
    # No mscale_all_dim: the plain YaRN temperature 0.1 ln(factor) + 1.
    "plain": dict(dim=32, rope_factor=8.0, original_seq_len=64, rope_theta=50000.0),
}


def _args(**changes) -> ModelArgs:
    return ModelArgs(**{**ModelArgs(max_seq_len=64).model_dump(), **changes})


def _case(case: str | None) -> tuple[ModelArgs, int]:
    """(args, rope dim) of a YARN_CASES entry; None: plain RoPE of width 16."""
    changes = dict(YARN_CASES[case]) if case else {"dim": 16}
    dim = changes.pop("dim")
    return _args(**changes), dim


def _hf_config(args: ModelArgs, dim: int):
    return transformers.DeepseekV3Config(
        hidden_size=64,
        num_attention_heads=4,
        qk_rope_head_dim=dim,  # DeepseekV3Config's head_dim for RoPE
        max_position_embeddings=int(args.rope_factor * args.original_seq_len),
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": args.rope_theta,
            "factor": args.rope_factor,
            "original_max_position_embeddings": args.original_seq_len,
            "beta_fast": args.beta_fast,
            "beta_slow": args.beta_slow,
            "mscale": args.mscale,
            "mscale_all_dim": args.mscale_all_dim,
        },
    )


@pytest.mark.parametrize("case", list(YARN_CASES))
def test_yarn_inverse_frequencies_match_transformers(case):
    args, dim = _case(case)
    expected_inv_freq, expected_factor = _compute_yarn_parameters(_hf_config(args, dim))
    inv_freq, factor = inverse_frequencies(args, dim)
    # Both in fp32; theta**e / factor and 1 / (factor * theta**e) differ by an ulp or two:
    # measured 1.1e-7 (v3; the other cases bit for bit) on AVX512 and AVX2 kernels; bound 1e-6.
    torch.testing.assert_close(inv_freq, expected_inv_freq, rtol=1e-6, atol=0)
    assert factor == pytest.approx(expected_factor, rel=1e-12)
    # YaRN is active: some frequencies are interpolated, the highest is kept.
    plain, _ = inverse_frequencies(_args(rope_theta=args.rope_theta), dim)
    assert inv_freq[0] == plain[0]
    assert inv_freq[-1] == pytest.approx(plain[-1].item() / args.rope_factor, rel=1e-6)


def test_yarn_attention_factors_are_the_documented_values():
    assert inverse_frequencies(*_case("v3"))[1] == 1.0  # mscale == mscale_all_dim
    assert inverse_frequencies(*_case("plain"))[1] == pytest.approx(0.1 * math.log(8) + 1)
    ratio = (0.1 * math.log(8) + 1) / (0.1 * 0.5 * math.log(8) + 1)
    assert inverse_frequencies(*_case("ratio"))[1] == pytest.approx(ratio)


@pytest.mark.parametrize("case", ["v2-lite", "ratio"])
def test_rotary_tables_match_transformers(case):
    args, dim = _case(case)
    config = _hf_config(args, dim)
    positions = torch.arange(args.max_seq_len)[None]
    hf_cos, hf_sin = DeepseekV3RotaryEmbedding(config)(
        torch.zeros(1, dtype=torch.float32), positions
    )
    cos, sin = RotaryEmbedding(args, dim)(args.max_seq_len)
    # HF lays the table out as cat(freqs, freqs) for rotate_half; ours holds one angle per pair.
    # Bit for bit (measured on AVX512 and AVX2 kernels): these cases' frequencies match bit for
    # bit (above) and each angle is one fp32 product through the same cos and sin. An ulp off in
    # a frequency would already move the angle at position 63 by up to ~2e-6.
    torch.testing.assert_close(cos, hf_cos[0, :, : dim // 2], rtol=0, atol=0)
    torch.testing.assert_close(sin, hf_sin[0, :, : dim // 2], rtol=0, atol=0)


def test_plain_rope_frequencies():
    inv_freq, factor = inverse_frequencies(_args(rope_theta=500.0), 8)
    expected = 500.0 ** (-torch.arange(0, 8, 2, dtype=torch.float64) / 8)
    torch.testing.assert_close(inv_freq.double(), expected, rtol=1e-7, atol=0)
    assert factor == 1.0


def _at_every_position(v: torch.Tensor, seq_len: int) -> torch.Tensor:
    """v [dim] repeated as x [1, seq_len, 1, dim], so apply_rope rotates it to every position."""
    return v.expand(1, seq_len, 1, -1)


def test_apply_rope_rotates_interleaved_pairs_as_complex_numbers():
    args, dim = _args(), 16
    cos, sin = RotaryEmbedding(args, dim)(args.max_seq_len)
    x = torch.randn(2, args.max_seq_len, 3, dim, generator=torch.Generator().manual_seed(0))
    got = apply_rope(x, cos, sin)
    # DeepSeek's reference: view_as_complex over (x0, x1), (x2, x3), ... times e^{i m theta_j}.
    turn = torch.polar(torch.ones_like(cos), torch.atan2(sin, cos))[None, :, None]
    expected = torch.view_as_real(torch.view_as_complex(x.unflatten(-1, (-1, 2))) * turn).flatten(
        -2
    )
    # Measured: worst element 4.8e-7 absolute, 1.9e-6 relative, a sixth of what rtol + atol
    # allow it, on AVX512 and AVX2 kernels alike.
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", [None, "v2-lite", "plain"])
def test_apply_rope_scales_each_pair_by_the_attention_factor(case):
    """A rotation: every pair keeps its length (times the YaRN attention factor, 1 without)."""
    args, dim = _case(case)
    _, factor = inverse_frequencies(args, dim)
    cos, sin = RotaryEmbedding(args, dim)(args.max_seq_len)
    x = torch.randn(2, args.max_seq_len, 3, dim)
    rotated = apply_rope(x, cos, sin)
    pair_norm = x.unflatten(-1, (-1, 2)).norm(dim=-1)
    torch.testing.assert_close(rotated.unflatten(-1, (-1, 2)).norm(dim=-1), factor * pair_norm)
    assert not torch.allclose(rotated[:, 1:], x[:, 1:] * factor)  # it does turn the pairs


@pytest.mark.parametrize("case", [None, "v2-lite"])
def test_rope_scores_depend_only_on_the_position_difference(case):
    args, dim = _case(case)
    cos, sin = RotaryEmbedding(args, dim)(args.max_seq_len)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(dim, generator=g), torch.randn(dim, generator=g)
    q_at = apply_rope(_at_every_position(q / q.norm(), args.max_seq_len), cos, sin)[0, :, 0]
    k_at = apply_rope(_at_every_position(k / k.norm(), args.max_seq_len), cos, sin)[0, :, 0]

    def score(m: int, n: int) -> float:
        return (q_at[m] @ k_at[n]).item()

    # fp32 angles m * theta_j (theta_j <= 1) are off by at most m * 2**-24 ~ 4e-6 rad at m = 63,
    # so scores of unit vectors could drift by ~4e-6; these positions' spread is measured 1.2e-7
    # on AVX512 and AVX2 kernels; bound 5e-7.
    for offset in (0, 3, -5):
        scores = [score(m, m - offset) for m in range(max(offset, 0), 64 + min(offset, 0), 7)]
        print(f"rope {case} offset {offset}: score spread {max(scores) - min(scores):.1e}")
        assert max(scores) - min(scores) <= 5e-7, (offset, scores)
    assert abs(score(10, 7) - score(10, 5)) > 1e-3  # and they do depend on the difference


def test_apply_rope_keeps_fp64_precision():
    angles = torch.outer(torch.arange(8, dtype=torch.float64), torch.rand(4, dtype=torch.float64))
    x = torch.randn(1, 8, 2, 8, dtype=torch.float64)
    turn = torch.polar(torch.ones_like(angles), angles)[None, :, None]
    expected = torch.view_as_real(torch.view_as_complex(x.unflatten(-1, (-1, 2))) * turn).flatten(
        -2
    )
    got = apply_rope(x, angles.cos(), angles.sin())
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
