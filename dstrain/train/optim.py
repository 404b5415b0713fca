"""The optimizer: AdamW (or Adam, SGD) with no weight decay on norms and biases."""

import torch
from torch import nn

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


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    groups = param_groups(model, cfg.weight_decay)
    if cfg.name == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.betas[0])
    # foreach keeps the step one fused pass over all tensors on CPU and GPU alike.
    kind = torch.optim.AdamW if cfg.name == "adamw" else torch.optim.Adam
    return kind(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, foreach=True)
