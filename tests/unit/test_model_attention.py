"""MLA and MHA/GQA against naive per-head references written here, on the same weights.

The references loop over batch, head and query position, build each key explicitly (MLA: the
shared RoPE key is rotated once per position and reused by every head) and apply the causal
softmax by hand; RoPE is applied as DeepSeek's reference does it, as complex multiplication of
interleaved pairs. Nothing from dstrain.model is reused but the weights. fp64 makes the
comparison strict; fp32 is checked against the fp64 reference with a stated bound.

Legend: B batch, S sequence, H heads, N qk_nope_head_dim, P qk_rope_head_dim, V v_head_dim,
C kv_lora_rank.
"""

import copy

import pytest
import torch

from dstrain.config.model_args import ModelArgs
from dstrain.model.attention import MHA, MLA

MLA_ARGS = ModelArgs(
    dim=32,
    num_heads=2,
    q_lora_rank=16,
    kv_lora_rank=12,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=6,
    max_seq_len=16,
    original_seq_len=16,
)
MHA_ARGS = ModelArgs(dim=32, num_heads=4, attention="mha", head_dim=8, max_seq_len=16)
B, S = 2, 7
THETA = 10000.0

# fp64 module against the fp64 reference: the same sums in a different order, so rounding at
# 2**-53 ~ 1e-16 per operation; 1e-10 of the output scale is strict and robust.
FP64 = 1e-10
# fp32 module (same weights, exactly representable) against the fp64 reference: O(1) values
# through 4-5 chained products of width <= 32 with unit roundoff 2**-24 ~ 6e-8; the textbook
# bound n * u is ~2e-6, measured ~2e-7. Any structural mistake (wrong head, pair, mask, scale
# or norm) is O(1).
FP32 = 2e-6


def _variant(base: ModelArgs, **changes) -> ModelArgs:
    return ModelArgs(**{**base.model_dump(), **changes})


def _inv_freq(dim: int) -> torch.Tensor:
    return THETA ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)


def _tables(dim: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), _inv_freq(dim))
    return angles.cos(), angles.sin()


def _rotate(v: torch.Tensor, pos: int) -> torch.Tensor:
    """DeepSeek's reference RoPE: pairs (v0, v1), (v2, v3) ... as complex numbers."""
    angles = pos * _inv_freq(v.numel())
    turn = torch.polar(torch.ones_like(angles), angles)
    return torch.view_as_real(torch.view_as_complex(v.reshape(-1, 2)) * turn).flatten()


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _attend(q_t: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], scale: float):
    """One query against the keys at positions 0..t (the causal window), by hand."""
    logits = torch.stack([q_t @ k * scale for k in keys])
    p = torch.exp(logits - logits.max())
    p = p / p.sum()
    return sum(p_s * v for p_s, v in zip(p, values, strict=True))


def naive_mla(m: MLA, args: ModelArgs, x: torch.Tensor) -> torch.Tensor:
    H, N, P, V, C = (
        args.num_heads,
        args.qk_nope_head_dim,
        args.qk_rope_head_dim,
        args.v_head_dim,
        args.kv_lora_rank,
    )
    if args.q_lora_rank:
        q = _rms(x @ m.wq_a.weight.T, m.q_norm.weight, args.norm_eps) @ m.wq_b.weight.T
    else:
        q = x @ m.wq.weight.T
    q = q.reshape(B, S, H, N + P)
    latent = x @ m.wkv_a.weight.T
    c_kv, k_pe = latent[..., :C], latent[..., C:]  # k_pe [B, S, P]: one RoPE key for all heads
    kv = (_rms(c_kv, m.kv_norm.weight, args.norm_eps) @ m.wkv_b.weight.T).reshape(B, S, H, N + V)
    scale = (N + P) ** -0.5
    out = torch.zeros(B, S, H, V, dtype=x.dtype)
    for b in range(B):
        keys = [
            torch.cat([kv[b, s, :, :N], _rotate(k_pe[b, s], s).expand(H, P)], -1) for s in range(S)
        ]
        for h in range(H):
            for t in range(S):
                q_t = torch.cat([q[b, t, h, :N], _rotate(q[b, t, h, N:], t)])
                ks = [keys[s][h] for s in range(t + 1)]
                vs = [kv[b, s, h, N:] for s in range(t + 1)]
                out[b, t, h] = _attend(q_t, ks, vs, scale)
    return out.reshape(B, S, H * V) @ m.wo.weight.T


def naive_mha(m: MHA, args: ModelArgs, x: torch.Tensor) -> torch.Tensor:
    H, Hkv, Dh = args.num_heads, args.num_kv_heads or args.num_heads, args.head_dim
    q = (x @ m.wq.weight.T).reshape(B, S, H, Dh)
    k = (x @ m.wk.weight.T).reshape(B, S, Hkv, Dh)
    v = (x @ m.wv.weight.T).reshape(B, S, Hkv, Dh)
    out = torch.zeros(B, S, H, Dh, dtype=x.dtype)
    for b in range(B):
        for h in range(H):
            g = h // (H // Hkv)  # query heads [g*H/Hkv, (g+1)*H/Hkv) share key/value head g
            for t in range(S):
                ks = [_rotate(k[b, s, g], s) for s in range(t + 1)]
                vs = [v[b, s, g] for s in range(t + 1)]
                out[b, t, h] = _attend(_rotate(q[b, t, h], t), ks, vs, Dh**-0.5)
    return out.reshape(B, S, H * Dh) @ m.wo.weight.T


def _module(cls, args: ModelArgs, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    module = cls(args).double()
    with torch.no_grad():
        for name, p in module.named_parameters():
            # Non-trivial norm weights, so q_norm/kv_norm must be applied where they belong.
            p.copy_(1 + 0.3 * torch.randn_like(p) if "norm" in name else 0.3 * torch.randn_like(p))
    return module


def _input(args: ModelArgs, seed: int = 1) -> torch.Tensor:
    return torch.randn(
        B, S, args.dim, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)
    )


def _max_rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got - ref).abs().max() / ref.abs().max()).item()


MLA_CASES = {"q_lora": MLA_ARGS, "no_q_lora": _variant(MLA_ARGS, q_lora_rank=0)}


@pytest.mark.parametrize("case", list(MLA_CASES))
def test_mla_projections_follow_q_lora_rank(case):
    names = {n for n, _ in _module(MLA, MLA_CASES[case]).named_parameters()}
    q_params = {"wq_a.weight", "q_norm.weight", "wq_b.weight", "wq.weight"}
    if case == "q_lora":
        assert names & q_params == {"wq_a.weight", "q_norm.weight", "wq_b.weight"}
    else:
        assert names & q_params == {"wq.weight"}


@pytest.mark.parametrize("case", list(MLA_CASES))
def test_mla_matches_naive_reference_in_fp64(case):
    args = MLA_CASES[case]
    m, x = _module(MLA, args), _input(args)
    cos, sin = _tables(args.qk_rope_head_dim, S)
    with torch.no_grad():
        got, ref = m(x, cos, sin), naive_mla(m, args, x)
    assert got.shape == (B, S, args.dim) and got.dtype == torch.float64
    assert _max_rel(got, ref) < FP64


@pytest.mark.parametrize("case", list(MLA_CASES))
def test_mla_fp32_matches_naive_fp64_reference(case):
    args = MLA_CASES[case]
    m32, x = _module(MLA, args).float(), _input(args)
    cos, sin = _tables(args.qk_rope_head_dim, S)
    with torch.no_grad():
        got = m32(x.float(), cos.float(), sin.float())
        ref = naive_mla(copy.deepcopy(m32).double(), args, x.float().double())
    assert got.dtype == torch.float32
    assert _max_rel(got.double(), ref) < FP32


@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_mha_grouped_query_matches_naive_reference(kv_heads):
    args = _variant(MHA_ARGS, num_kv_heads=kv_heads)
    m, x = _module(MHA, args), _input(args)
    assert m.wk.weight.shape == (kv_heads * args.head_dim, args.dim)
    cos, sin = _tables(args.head_dim, S)
    with torch.no_grad():
        assert _max_rel(m(x, cos, sin), naive_mha(m, args, x)) < FP64


@pytest.mark.parametrize(
    "cls,args",
    [(MLA, MLA_ARGS), (MLA, MLA_CASES["no_q_lora"]), (MHA, _variant(MHA_ARGS, num_kv_heads=2))],
)
@pytest.mark.parametrize("t", [0, 3, S - 1])
def test_attention_is_causal(cls, args, t):
    m, x = _module(cls, args), _input(args)
    rope_dim = args.qk_rope_head_dim if cls is MLA else args.head_dim
    cos, sin = _tables(rope_dim, S)
    changed = x.clone()
    changed[:, t] += torch.randn(
        B, args.dim, dtype=x.dtype, generator=torch.Generator().manual_seed(7)
    )
    with torch.no_grad():
        before, after = m(x, cos, sin), m(changed, cos, sin)
    # Earlier positions never see token t: the masked scores contribute exp(-inf) = 0 exactly.
    assert torch.equal(before[:, :t], after[:, :t])
    # Position t and later do see it (the test is not vacuous).
    assert ((before[:, t:] - after[:, t:]).abs().amax(-1) > 1e-6).all()


def test_mla_scale_with_yarn_matches_transformers():
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    yarn = dict(rope_factor=40.0, original_seq_len=16, mscale=0.707, mscale_all_dim=0.707)
    args = _variant(MLA_ARGS, max_seq_len=640, **yarn)
    config = transformers.DeepseekV3Config(
        hidden_size=args.dim,
        num_attention_heads=args.num_heads,
        q_lora_rank=args.q_lora_rank,
        kv_lora_rank=args.kv_lora_rank,
        qk_nope_head_dim=args.qk_nope_head_dim,
        qk_rope_head_dim=args.qk_rope_head_dim,
        v_head_dim=args.v_head_dim,
        max_position_embeddings=args.max_seq_len,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": args.rope_theta,
            "factor": args.rope_factor,
            "original_max_position_embeddings": args.original_seq_len,
            "mscale": args.mscale,
            "mscale_all_dim": args.mscale_all_dim,
        },
    )
    expected = DeepseekV3Attention(config, layer_idx=0).scaling
    assert MLA(args).scale == pytest.approx(expected, rel=1e-12)
    assert MLA(args).scale != pytest.approx(MLA(MLA_ARGS).scale)  # the YaRN correction is active
