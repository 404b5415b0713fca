"""Activation checkpointing: recompute in backward instead of keeping activations.

`full` wraps every transformer block (keeps only block inputs); `selective` wraps the attention
and the feed-forward/MoE of each block separately, the two largest activation producers, so the
norms and residual adds are not recomputed. Uses torch.utils.checkpoint (non-reentrant), the
same wrapper torchtitan and FSDP2 compose with.
"""

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from dstrain.model.transformer import Transformer, TransformerBlock


def apply_ac(model: Transformer, *, mode: str) -> None:
    """Wrap `model`'s blocks (and MTP blocks) in place; mode is none, selective or full."""
    if mode == "none":
        return
    for parent in _block_parents(model):
        for name, block in parent.named_children():
            if not isinstance(block, TransformerBlock):
                continue
            if mode == "full":
                parent.register_module(name, checkpoint_wrapper(block, preserve_rng_state=False))
            else:
                block.attention = checkpoint_wrapper(block.attention, preserve_rng_state=False)
                block.ffn = checkpoint_wrapper(block.ffn, preserve_rng_state=False)


def _block_parents(model: Transformer) -> list[nn.Module]:
    parents: list[nn.Module] = [model.layers]
    if model.mtp is not None:
        parents += list(model.mtp.values())
    return parents
