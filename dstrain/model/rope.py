"""Rotary position embedding with YaRN context extension, on interleaved pairs.

DeepSeek rotates adjacent pairs (x0, x1), (x2, x3), ... (its reference code views them as complex
numbers); HF's `rope_interleave=True` path is the same rotation. YaRN follows Peng et al. 2023
(arXiv:2309.00071) as DeepSeek-V2/V3 and transformers implement it: frequencies below the
correction range are interpolated by `rope_factor`, those above are kept, with a linear ramp
between; cos/sin are scaled by the attention factor mscale(factor, mscale)/mscale(factor, all).
"""

import math

import torch
from torch import nn

from dstrain.config.model_args import ModelArgs


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN attention-temperature correction: 0.1 * mscale * ln(factor) + 1, or 1 if factor <= 1."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def softmax_scale(args: ModelArgs, head_dim: int) -> float:
    """1/sqrt(head_dim), times mscale(factor, mscale_all_dim)^2 under YaRN (DeepSeek-V2 3.1)."""
    scale = head_dim**-0.5
    if args.rope_factor > 1 and args.mscale_all_dim:
        scale *= yarn_mscale(args.rope_factor, args.mscale_all_dim) ** 2
    return scale


def inverse_frequencies(args: ModelArgs, dim: int) -> tuple[torch.Tensor, float]:
    """Per-pair inverse frequencies [dim/2] and the cos/sin scale."""
    exponents = torch.arange(0, dim, 2, dtype=torch.float32) / dim
    extrapolated = 1.0 / (args.rope_theta**exponents)
    if args.rope_factor <= 1:
        return extrapolated, 1.0
    interpolated = extrapolated / args.rope_factor
    low, high = _correction_range(args, dim)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # 1 where the frequency is high enough to keep as is
    inv_freq = interpolated * (1 - keep) + extrapolated * keep
    if args.mscale and args.mscale_all_dim:
        scale = yarn_mscale(args.rope_factor, args.mscale) / yarn_mscale(
            args.rope_factor, args.mscale_all_dim
        )
    else:
        scale = yarn_mscale(args.rope_factor)
    return inv_freq, scale


def _correction_range(args: ModelArgs, dim: int) -> tuple[float, float]:
    def dim_for(rotations: float) -> float:
        turns = args.original_seq_len / (rotations * 2 * math.pi)
        return dim * math.log(turns) / (2 * math.log(args.rope_theta))

    low = max(math.floor(dim_for(args.beta_fast)), 0)
    high = min(math.ceil(dim_for(args.beta_slow)), dim - 1)
    return low, high if high != low else high + 0.001


class RotaryEmbedding(nn.Module):
    """cos/sin tables [max_seq_len, dim/2], rebuilt by `reset_parameters` (not checkpointed)."""

    def __init__(self, args: ModelArgs, dim: int) -> None:
        super().__init__()
        self.args, self.dim = args, dim
        self.register_buffer("cos", torch.empty(args.max_seq_len, dim // 2), persistent=False)
        self.register_buffer("sin", torch.empty(args.max_seq_len, dim // 2), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        inv_freq, scale = inverse_frequencies(self.args, self.dim)
        positions = torch.arange(self.args.max_seq_len, dtype=torch.float32)
        angles = torch.outer(positions, inv_freq.to(positions.device))
        self.cos.copy_(angles.cos() * scale)
        self.sin.copy_(angles.sin() * scale)

    def forward(
        self, seq_len: int, positions_BS: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The tables for positions 0..seq_len-1 [S, dim/2], or for each token's own position
        [B, S, dim/2] (under document masking, positions restart at each document)."""
        if positions_BS is not None:
            return self.cos[positions_BS], self.sin[positions_BS]
        return self.cos[:seq_len], self.sin[:seq_len]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs of the last dim of x [B, S, H, dim] by the angles of each position: tables
    [S, dim/2] (positions 0..S-1) or [B, S, dim/2] (each sequence's own positions)."""
    dtype = x.dtype
    pairs = x.to(torch.promote_types(dtype, torch.float32)).unflatten(-1, (-1, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    if cos.dim() == 2:
        cos, sin = cos[None], sin[None]
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return rotated.flatten(-2).to(dtype)
