"""Attention: Multi-head Latent Attention (DeepSeek-V2/V3) and classic multi-head / grouped-query
attention (DeepSeek-LLM, DeepSeekMoE-16B).

Shapes: B batch, S sequence, D model dim, H heads (local heads under TP), R q_lora_rank,
C kv_lora_rank, N qk_nope_head_dim, P qk_rope_head_dim, V v_head_dim.

MLA (DeepSeek-V2 section 2.1): queries go through a low-rank bottleneck (wq_a -> q_norm -> wq_b),
or one projection wq when q_lora_rank = 0; keys and values come from one shared latent c_KV
(wkv_a -> kv_norm -> wkv_b), plus a decoupled RoPE key shared by all heads. Heads are reshaped
with `view(B, S, -1, head_dim)`, so a TP-sharded wq_b/wkv_b (fewer local heads) just works.

Context parallelism (`context`, set by `parallel/context_parallel.py`): x holds this rank's part
of the sequence; MLA gathers each token's latent and rotated RoPE key from the cp group and
up-projects the whole sequence's keys and values locally; MHA gathers its rotated keys and its
values. Queries stay local; the mask is causal by global position.
"""

from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.bias import causal_lower_right

from dstrain.config.model_args import ModelArgs
from dstrain.model.documents import masked_attention
from dstrain.model.norm import RMSNorm
from dstrain.model.rope import apply_rope, softmax_scale


class SequenceShard(Protocol):
    """What attention needs of context parallelism (`parallel/context_parallel.ContextShard`):
    `size` ranks each hold a part of every sequence."""

    size: int

    def positions(self, local_len: int, device: torch.device | str = "cpu") -> torch.Tensor: ...

    def gather(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor: ...

    def causal_mask(self, local_len: int, device: torch.device | str = "cpu") -> torch.Tensor: ...

    def chunk_mask(self, length: int, end: int, device: torch.device) -> torch.Tensor: ...

    def query_chunks(self, local_len: int) -> list[tuple[slice, int]]: ...


class MLA(nn.Module):
    context: SequenceShard | None = None  # context parallelism (module docstring)

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.q_lora_rank = args.q_lora_rank
        self.kv_lora_rank = args.kv_lora_rank
        self.nope_dim, self.rope_dim = args.qk_nope_head_dim, args.qk_rope_head_dim
        self.v_dim = args.v_head_dim
        qk_dim = self.nope_dim + self.rope_dim
        heads = args.num_heads
        if self.q_lora_rank:
            self.wq_a = nn.Linear(args.dim, self.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(self.q_lora_rank, args.norm_eps)
            self.wq_b = nn.Linear(self.q_lora_rank, heads * qk_dim, bias=False)
        else:
            self.wq = nn.Linear(args.dim, heads * qk_dim, bias=False)
        self.wkv_a = nn.Linear(args.dim, self.kv_lora_rank + self.rope_dim, bias=False)
        self.kv_norm = RMSNorm(self.kv_lora_rank, args.norm_eps)
        self.wkv_b = nn.Linear(self.kv_lora_rank, heads * (self.nope_dim + self.v_dim), bias=False)
        self.wo = nn.Linear(heads * self.v_dim, args.dim, bias=False)
        self.scale = softmax_scale(args, qk_dim)

    def forward(
        self, x_BSD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: Any = None
    ) -> torch.Tensor:
        B, S, _ = x_BSD.shape
        q = self.wq_b(self.q_norm(self.wq_a(x_BSD))) if self.q_lora_rank else self.wq(x_BSD)
        q_BSHK = q.view(B, S, -1, self.nope_dim + self.rope_dim)
        q_nope, q_rope = q_BSHK.split([self.nope_dim, self.rope_dim], dim=-1)
        kv_BSC, k_rope_BSP = self.wkv_a(x_BSD).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        k_rope_BSP = apply_rope(k_rope_BSP.unsqueeze(2), cos, sin).squeeze(2)
        if self.context is not None:  # every rank's latents: [B, S x cp, C + P]
            latent = self.context.gather(torch.cat([kv_BSC, k_rope_BSP], dim=-1))
            kv_BSC, k_rope_BSP = latent.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv = self.wkv_b(self.kv_norm(kv_BSC)).view(
            B, kv_BSC.size(1), -1, self.nope_dim + self.v_dim
        )
        k_nope, v_BSHV = kv.split([self.nope_dim, self.v_dim], dim=-1)
        q_rope = apply_rope(q_rope, cos, sin)
        k_rope = k_rope_BSP.unsqueeze(2).expand(-1, -1, k_nope.size(2), -1)
        q_BSHK = torch.cat([q_nope, q_rope], dim=-1)
        k_BSHK = torch.cat([k_nope, k_rope], dim=-1)
        out = _attention(q_BSHK, k_BSHK, v_BSHV, self.scale, mask, self.context)
        return self.wo(out.flatten(2))


class MHA(nn.Module):
    """Multi-head attention with optional grouped-query key/value heads and RoPE on full heads
    (interleaved pairs, as DeepSeek-LLM/MoE checkpoints are converted for here)."""

    context: SequenceShard | None = None  # context parallelism (module docstring)

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.head_dim = args.head_dim or args.dim // args.num_heads
        kv_heads = args.num_kv_heads or args.num_heads
        self.wq = nn.Linear(args.dim, args.num_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.num_heads * self.head_dim, args.dim, bias=False)
        self.scale = softmax_scale(args, self.head_dim)

    def forward(
        self, x_BSD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: Any = None
    ) -> torch.Tensor:
        B, S, _ = x_BSD.shape
        q = apply_rope(self.wq(x_BSD).view(B, S, -1, self.head_dim), cos, sin)
        k = apply_rope(self.wk(x_BSD).view(B, S, -1, self.head_dim), cos, sin)
        v = self.wv(x_BSD).view(B, S, -1, self.head_dim)
        if self.context is not None:  # every rank's keys and values: [B, S x cp, Hkv, K]
            k, v = self.context.gather(k), self.context.gather(v)
        groups = q.size(2) // k.size(2)
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=2), v.repeat_interleave(groups, dim=2)
        return self.wo(_attention(q, k, v, self.scale, mask, self.context).flatten(2))


def _attention(
    q_BLHK: torch.Tensor,
    k_BSHK: torch.Tensor,
    v_BSHV: torch.Tensor,
    scale: float,
    mask: Any,
    context: SequenceShard | None,
) -> torch.Tensor:
    """Causal attention of the local queries; under context parallelism against the whole
    sequence's keys (`gather`'s order): with a documents' mask as given (made for them), else
    chunk by chunk, each of this rank's two chunks against the keys up to its own end (causal
    bottom-right: the chunk's first query sees every earlier position), not the whole sequence
    under a mask."""
    if context is None or mask is not None:
        return _causal_attention(q_BLHK, k_BSHK, v_BSHV, scale, mask)
    outputs = []
    for rows, start in context.query_chunks(q_BLHK.size(1)):
        q = q_BLHK[:, rows]
        end = start + q.size(1)
        outputs.append(
            _causal_attention(
                q, k_BSHK[:, :end], v_BSHV[:, :end], scale, _bottom_right(q, end, context)
            )
        )
    return torch.cat(outputs, dim=1)


def _bottom_right(q_BLHK: torch.Tensor, end: int, context: SequenceShard) -> torch.Tensor:
    """The causal mask of queries at positions end - L .. end - 1 against keys 0 .. end - 1.
    On CUDA torch's bias (`causal_lower_right`), which the fused kernels apply without an
    [L, end] mask in memory; elsewhere that mask, one per chunk that every layer and
    micro-batch shares (`ContextShard.chunk_mask`; the bias cannot be made under fake tensors:
    the dry run)."""
    length = q_BLHK.size(1)
    if q_BLHK.is_cuda:
        return causal_lower_right(length, end)
    return context.chunk_mask(length, end, q_BLHK.device)


def _causal_attention(
    q_BSHK: torch.Tensor,
    k_BSHK: torch.Tensor,
    v_BSHV: torch.Tensor,
    scale: float,
    mask: Any = None,
) -> torch.Tensor:
    """SDPA over [B, H, S, *], causal, or within documents under a `DocumentMask.mask`. MLA's
    value width differs from its query/key width; the fused kernels want them equal, so values
    are zero-padded to the key width and the output is cut back (as torchtitan does), instead of
    falling back to the unfused math path."""
    v_dim, k_dim = v_BSHV.size(-1), q_BSHK.size(-1)
    if v_dim < k_dim:
        v_BSHV = F.pad(v_BSHV, (0, k_dim - v_dim))
    q, k, v = (t.transpose(1, 2) for t in (q_BSHK, k_BSHK, v_BSHV))
    if mask is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    else:
        out = masked_attention(q, k, v, mask, scale)
    return out.transpose(1, 2)[..., :v_dim]


def build_attention(args: ModelArgs) -> nn.Module:
    return MLA(args) if args.attention == "mla" else MHA(args)
