"""parallelize_model: the one place that turns the single-device model into the one that trains.

Fixed order (torchtitan's, for the reasons in each step): tensor parallelism first (it changes
module shapes), expert parallelism (it replaces the experts' forward), activation checkpointing
(it must wrap the already-sharded modules), torch.compile per block (it must see the final
modules), and data parallelism / ZeRO last (FSDP shards whatever parameters the steps above
left). The process-group steps (TP, EP, FSDP/DDP) arrive with the N-D parallel issue; on one
process only AC and compile apply.
"""

import torch

from dstrain.config.schema import DstrainConfig
from dstrain.model.transformer import Transformer
from dstrain.parallel.activation_checkpoint import apply_ac


def parallelize_model(model: Transformer, config: DstrainConfig) -> Transformer:
    apply_ac(model, mode=config.train.activation_checkpoint)
    if config.train.compile:
        apply_compile(model)
    return model


def apply_compile(model: Transformer) -> None:
    """Compile each block separately: small graphs compile fast, are reused by identical blocks,
    and leave FSDP's per-block hooks outside the graph."""
    for name, block in model.layers.named_children():
        model.layers.register_module(name, torch.compile(block, fullgraph=False))
