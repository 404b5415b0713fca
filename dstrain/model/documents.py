"""Document masking (`data.document_mask`): a window packs several documents; each token attends
only to the earlier tokens of its own document and RoPE positions restart at each document, so
every document gets the logits it has alone.

Built once per forward from document ids [B, S] (`train/loss.py documents_of`: the number of EOS
tokens before each token, so an EOS belongs to the document it ends) and handed to every block.
On CUDA the mask is a FlexAttention `BlockMask`: blocks wholly outside a document are skipped,
so attention costs the documents' own lengths rather than the window's. Elsewhere (FlexAttention
has no CPU backward in torch 2.13) it is a boolean [B, 1, S, S] for SDPA, causal and within the
document: S^2 bytes per sequence.
"""

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class DocumentMask:
    ids: torch.Tensor  # [B, S] document index of each token, non-decreasing along S
    positions: torch.Tensor  # [B, S] each token's position within its document
    mask: Any  # [B, 1, S, S] bool for SDPA, or a FlexAttention BlockMask

    @classmethod
    def of(cls, ids_BS: torch.Tensor) -> "DocumentMask":
        return cls(ids_BS, _positions(ids_BS), _mask(ids_BS))

    @classmethod
    def split(
        cls, ids_BS: torch.Tensor, queries_L: torch.Tensor, keys_K: torch.Tensor
    ) -> "DocumentMask":
        """Context parallelism: the mask of this rank's query positions `queries_L` against
        the gathered keys' positions `keys_K`, within documents and causal by global position;
        ids and positions for the rank's own tokens. A boolean mask [B, 1, L, K] on every device
        (a FlexAttention BlockMask of a rank's two chunks is not built yet)."""
        ids_q, ids_k = ids_BS[:, queries_L], ids_BS[:, keys_K]
        causal = queries_L[:, None] >= keys_K[None, :]
        mask = ((ids_q[:, :, None] == ids_k[:, None, :]) & causal)[:, None]
        return cls(ids_q, _positions(ids_BS)[:, queries_L], mask)

    def first(self, length: int) -> "DocumentMask":
        """The mask of the first `length` positions (an MTP depth's shorter sequence)."""
        return DocumentMask.of(self.ids[:, :length])


def _positions(ids_BS: torch.Tensor) -> torch.Tensor:
    S = ids_BS.size(1)
    index = torch.arange(S, device=ids_BS.device).expand_as(ids_BS)
    starts = torch.ones_like(ids_BS, dtype=torch.bool)
    starts[:, 1:] = ids_BS[:, 1:] != ids_BS[:, :-1]
    start_of = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - start_of


def _mask(ids_BS: torch.Tensor) -> Any:
    if ids_BS.is_cuda and _flex() is not None:
        return _block_mask(ids_BS)
    S = ids_BS.size(1)
    causal = torch.ones(S, S, dtype=torch.bool, device=ids_BS.device).tril()
    return ((ids_BS[:, :, None] == ids_BS[:, None, :]) & causal)[:, None]


def _block_mask(ids_BS: torch.Tensor) -> Any:
    from torch.nn.attention.flex_attention import create_block_mask

    def within_document(b, h, q, kv):  # noqa: ANN001 (FlexAttention's mask_mod signature)
        return (ids_BS[b, q] == ids_BS[b, kv]) & (q >= kv)

    B, S = ids_BS.shape
    return create_block_mask(within_document, B, None, S, S, device=ids_BS.device)


_COMPILED_FLEX: list = []


def _flex() -> Any:
    """FlexAttention, compiled once (uncompiled it materialises the whole score matrix)."""
    if not _COMPILED_FLEX:
        try:
            from torch.nn.attention.flex_attention import flex_attention
        except ImportError:
            _COMPILED_FLEX.append(None)
        else:
            _COMPILED_FLEX.append(torch.compile(flex_attention, dynamic=False))
    return _COMPILED_FLEX[0]


def masked_attention(
    q_BHSK: torch.Tensor, k_BHSK: torch.Tensor, v_BHSK: torch.Tensor, mask: Any, scale: float
) -> torch.Tensor:
    """Attention over [B, H, S, K] under a `DocumentMask.mask`."""
    if isinstance(mask, torch.Tensor):
        return torch.nn.functional.scaled_dot_product_attention(
            q_BHSK, k_BHSK, v_BHSK, attn_mask=mask, scale=scale
        )
    return _flex()(q_BHSK, k_BHSK, v_BHSK, block_mask=mask, scale=scale)
