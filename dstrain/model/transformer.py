"""The DeepSeek-style decoder: embedding, blocks, final norm, head, and multi-token prediction.

Pipeline- and TP-friendly by construction (STYLE items 2-3): blocks live in an `nn.ModuleDict`
keyed by layer id, so their names survive stage splitting and checkpoints; the embedding, norm,
head and MTP modules may be None on stages that do not hold them.

Multi-token prediction (DeepSeek-V3 section 2.2): module k (1..D) combines the previous depth's
hidden state at position i with the embedding of token i+k, runs one transformer block, and
predicts token i+k+1 through the shared head. Its sequence is k positions shorter.
"""

from typing import Any

import torch
from torch import nn

from dstrain.config.model_args import ModelArgs
from dstrain.model.attention import SequenceShard, build_attention
from dstrain.model.documents import DocumentMask
from dstrain.model.ffn import FeedForward
from dstrain.model.init import init_parameters
from dstrain.model.moe import MoE
from dstrain.model.norm import RMSNorm
from dstrain.model.rope import RotaryEmbedding


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: ModelArgs) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = build_attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        is_moe = args.num_routed_experts > 0 and layer_id >= args.first_k_dense
        self.ffn = MoE(args) if is_moe else FeedForward(args.dim, args.inter_dim, args.mlp)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, **mask: Any
    ) -> torch.Tensor:
        """`mask`: under document masking, `mask=DocumentMask.mask` (a keyword, so that the TP
        plans' input layouts, which cover x, cos and sin, stay as they are)."""
        x = x + self.attention(self.attention_norm(x), cos, sin, **mask)
        return x + self.ffn(self.ffn_norm(x))


class MTPModule(nn.Module):
    """One prediction depth: norms, the projection M_k [2D -> D], one block, an output norm."""

    def __init__(self, depth: int, args: ModelArgs) -> None:
        super().__init__()
        self.depth = depth
        self.enorm = RMSNorm(args.dim, args.norm_eps)
        self.hnorm = RMSNorm(args.dim, args.norm_eps)
        self.proj = nn.Linear(2 * args.dim, args.dim, bias=False)
        self.block = TransformerBlock(args.num_layers + depth - 1, args)
        self.norm = RMSNorm(args.dim, args.norm_eps)
        for moe in (m for m in self.block.modules() if isinstance(m, MoE)):
            moe.tail_padding = depth  # context parallelism's padded positions (MoE)

    def forward(
        self,
        h_prev: torch.Tensor,
        emb_next: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        **mask: Any,
    ) -> torch.Tensor:
        """h_prev [B, S', D] at positions i, emb_next [B, S', D] of tokens i+k -> [B, S', D]."""
        h = self.proj(torch.cat([self.enorm(emb_next), self.hnorm(h_prev)], dim=-1))
        return self.block(h, cos, sin, **mask)


class Transformer(nn.Module):
    # Context parallelism: this rank's part of every sequence (`parallel/context_parallel.py`).
    context: SequenceShard | None = None

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.embed: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        rope_dim = args.qk_rope_head_dim if args.attention == "mla" else _mha_head_dim(args)
        self.rope = RotaryEmbedding(args, rope_dim)
        self.layers = nn.ModuleDict(
            {str(i): TransformerBlock(i, args) for i in range(args.num_layers)}
        )
        self.norm: RMSNorm | None = RMSNorm(args.dim, args.norm_eps)
        self.head: nn.Linear | None = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.mtp: nn.ModuleDict | None = (
            nn.ModuleDict({str(k): MTPModule(k, args) for k in range(1, args.num_mtp_modules + 1)})
            if args.num_mtp_modules
            else None
        )
        # Under pipeline parallelism the last stage holds MTP but not `embed`: it gets a copy of
        # the embedding here, whose gradient the pipeline sums with the original's (a tied pair).
        self.mtp_embed: nn.Embedding | None = None

    def forward(
        self,
        tokens: torch.Tensor,
        next_tokens: torch.Tensor | None = None,
        documents: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """tokens [B, S] -> logits [B, S, V]; with MTP, (logits, mtp_1 [B, S-1, V], ...).

        A stage without the embedding takes hidden states [B, S, D] instead of token ids; a last
        stage with MTP then needs `next_tokens` [B, S-1] (token i+1 at position i). Under
        context parallelism `next_tokens` is [B, D, L], each depth's (`_mtp_logits_split`).
        `documents` [B, >= S]: each token's document index (document masking; see
        `model/documents.py`), None: one causal sequence.
        """
        h = self.embed(tokens) if self.embed is not None else tokens
        docs = None if documents is None else self._documents(documents, tokens.size(1))
        cos, sin = self.rope(h.size(1), self._positions(h, docs))
        mask = {} if docs is None else {"mask": docs.mask}
        for layer in self.layers.values():
            h = layer(h, cos, sin, **mask)
        if self.head is None:
            return h
        logits = self.head(self.norm(h) if self.norm is not None else h)
        if self.mtp is None:
            return logits
        if self.context is not None:  # without next_tokens (evaluation): the main head only
            if next_tokens is None:
                return logits
            return (logits, *self._mtp_logits_split(h, next_tokens, cos, sin, mask))
        if next_tokens is None:
            next_tokens = tokens[:, 1:]
        return (logits, *self._mtp_logits(h, next_tokens[:, : h.size(1) - 1], docs))

    def _documents(self, documents: torch.Tensor, length: int) -> DocumentMask:
        """The documents' mask of this forward's `length` tokens: all of them, or under context
        parallelism this rank's part of the sequence (`documents` is the whole one's)."""
        if self.context is None:
            return DocumentMask.of(documents[:, :length])
        device = documents.device
        whole = documents[:, : length * self.context.size]
        queries = self.context.positions(length, device)
        keys = torch.arange(whole.size(1), device=device)  # the gathered keys' order
        return DocumentMask.split(whole, queries, keys)

    def _positions(self, h: torch.Tensor, docs: DocumentMask | None) -> torch.Tensor | None:
        """Each token's RoPE position [B, S]: its place in its document, or in the sequence of
        which this rank holds a part (context parallelism); None: 0..S-1."""
        if docs is not None:
            return docs.positions
        if self.context is not None:
            return self.context.positions(h.size(1), h.device).expand(h.size(0), -1)
        return None

    def _mtp_logits_split(
        self,
        h: torch.Tensor,
        next_tokens: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: dict[str, Any],
    ) -> list[torch.Tensor]:
        """MTP on this rank's part of the sequence (context parallelism): every depth keeps the
        main sequence's positions, length and documents' mask, its input tokens given per depth
        (`next_tokens` [B, D, L]: token i + k at position i). Positions past S - 1 - k, which
        one process drops, see only earlier ones (causal), so they change no kept output; their
        targets are none (`train/loss.split_targets`)."""
        embed = self.mtp_embed if self.mtp_embed is not None else self.embed
        outputs = []
        for module in self.mtp.values():
            # the padded positions route, but are not counted (`MoE.tail_padding`)
            h = module(h, embed(next_tokens[:, module.depth - 1]), cos, sin, **mask)
            outputs.append(self.head(module.norm(h)))
        return outputs

    def _mtp_logits(
        self, h: torch.Tensor, next_tokens: torch.Tensor, docs: DocumentMask | None
    ) -> list[torch.Tensor]:
        """next_tokens [B, S-1]: the tokens at positions 1..S-1. Depth k's position i stands
        for the main sequence's position i: under document masking it takes that one's document
        and position."""
        embed = self.mtp_embed if self.mtp_embed is not None else self.embed
        emb = embed(next_tokens)
        outputs = []
        for module in self.mtp.values():
            k = module.depth
            length = h.size(1) - 1
            depth_docs = None if docs is None else docs.first(length)
            cos, sin = self.rope(length, None if depth_docs is None else depth_docs.positions)
            mask = {} if depth_docs is None else {"mask": depth_docs.mask}
            h = module(h[:, :-1], emb[:, k - 1 :], cos, sin, **mask)
            outputs.append(self.head(module.norm(h)))
        return outputs


def _mha_head_dim(args: ModelArgs) -> int:
    return args.head_dim or args.dim // args.num_heads


def build_model(
    args: ModelArgs, device: torch.device | str | None = "cpu", seed: int = 0
) -> Transformer:
    """The model on `meta` (no memory); with a `device`, materialised there and initialised from
    `seed` (one process). The trainer passes `device=None`: it parallelises the meta model first
    and materialises only what each rank holds (`dstrain/parallel/materialize.py`)."""
    with torch.device("meta"):
        model = Transformer(args)
    if device is not None:
        model.to_empty(device=device)
        init_parameters(model, seed)
    return model
