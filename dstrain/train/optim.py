"""The optimizer: AdamW (or Adam, SGD) with no weight decay on norms and biases."""

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

from dstrain.config.schema import OptimConfig


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Matrices (and expert tensors, embeddings) decay; vectors (norm weights, biases) do not."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.dim() >= 2 else no_decay).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_optimizer(
    model: nn.Module, cfg: OptimConfig, zero1_group: dist.ProcessGroup | None = None
) -> torch.optim.Optimizer:
    """The optimizer; with `zero1_group`, ZeRO-1: each rank of that group keeps and steps the
    states of its share of the parameters, then broadcasts the updated parameters."""
    groups = param_groups(model, cfg.weight_decay)
    if cfg.name == "sgd":
        kind, kwargs = torch.optim.SGD, dict(lr=cfg.lr, momentum=cfg.betas[0])
    else:
        kind = torch.optim.AdamW if cfg.name == "adamw" else torch.optim.Adam
        # foreach keeps the step one fused pass over all tensors on CPU and GPU alike.
        kwargs = dict(lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, foreach=True)
    if zero1_group is not None:
        return ZeroRedundancyOptimizer(
            groups, optimizer_class=kind, process_group=zero1_group, **kwargs
        )
    return kind(groups, **kwargs)
