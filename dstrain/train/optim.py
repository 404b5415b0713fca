"""The optimizer: AdamW (or Adam, SGD) with no weight decay on norms and biases."""

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from dstrain.config.schema import OptimConfig


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Matrices (and expert tensors, embeddings) decay; vectors (norm weights, biases) do not.

    Parameters are also grouped by kind (plain tensor, or DTensor on a given mesh), because a
    foreach step cannot mix them: TP and EP leave plain and DTensor parameters side by side."""
    groups: dict[tuple[bool, object], list[torch.Tensor]] = {}
    for param in model.parameters():
        if param.requires_grad:
            mesh = param.device_mesh if isinstance(param, DTensor) else None
            groups.setdefault((param.dim() >= 2, mesh), []).append(param)
    ordered = sorted(groups.items(), key=lambda item: (not item[0][0], item[0][1] is not None))
    return [
        {"params": params, "weight_decay": weight_decay if decays else 0.0}
        for (decays, _), params in ordered
    ]


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    """The optimizer over this rank's parameters (their shards under FSDP2: ZeRO-1/2/3 shard the
    optimizer states that way)."""
    groups = param_groups(model, cfg.weight_decay)
    if cfg.name == "sgd":
        kind, kwargs = torch.optim.SGD, dict(lr=cfg.lr, momentum=cfg.betas[0])
    else:
        kind = torch.optim.AdamW if cfg.name == "adamw" else torch.optim.Adam
        # foreach keeps the step one fused pass over all tensors on CPU and GPU alike.
        kwargs = dict(lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, foreach=True)
    return kind(groups, **kwargs)
