"""The optimizer: AdamW (or Adam, SGD) with no weight decay on norms and biases; Adam's moments in
fp32 (torch's own optimizers) or in bf16 (`Bf16MomentsAdam`)."""

import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from dstrain.config.schema import OptimConfig

MOMENTS = ("exp_avg", "exp_avg_sq")


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


def build_optimizer(
    model: nn.Module, cfg: OptimConfig, precision: str = "fp32"
) -> torch.optim.Optimizer:
    """The optimizer over this rank's parameters (their shards under FSDP2: ZeRO-1/2/3 shard the
    optimizer states that way). `precision` (train.precision) resolves `cfg.moments = auto`."""
    groups = param_groups(model, cfg.weight_decay)
    if cfg.name == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.betas[0])
    if cfg.moments_dtype(precision) == "bf16":
        return Bf16MomentsAdam(
            groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, decoupled=cfg.name == "adamw"
        )
    kind = torch.optim.AdamW if cfg.name == "adamw" else torch.optim.Adam
    # foreach keeps the step one fused pass over all tensors on CPU and GPU alike.
    return kind(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, foreach=True)


class Bf16MomentsAdam(torch.optim.Optimizer):
    """Adam(W) whose two moments are stored in bf16 and computed in fp32, over fp32 master weights
    and gradients: DeepSeek-V3's low-precision optimizer states (report, Sec. 3.3.3). Half of
    Adam's 8 bytes per parameter.

    Why our own: torch.optim.Adam/AdamW allocate their moments like the parameters (fp32), their
    foreach and fused kernels take one dtype per tensor group, and `load_state_dict` casts every
    floating state back to the parameter's dtype. The arithmetic is torch's AdamW (decoupled) or
    Adam (L2 in the gradient), step for step, on each parameter's local tensor (the shard under
    FSDP2, which holds the same placements as its gradient and moments); `step` is a host tensor
    as in torch, so checkpoints (DCP) and resharding treat the state the same way."""

    def __init__(
        self,
        params: list[dict],
        lr: float,
        betas: tuple[float, float],
        eps: float,
        decoupled: bool = True,
    ) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=0.0))
        self.decoupled = decoupled

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001 (torch's signature)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, decay = group["lr"], group["eps"], group["weight_decay"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    for name in MOMENTS:
                        state[name] = torch.zeros_like(param, dtype=torch.bfloat16)
                state["step"] += 1
                t = state["step"].item()  # a host tensor: no device sync
                p, g = _local(param), _local(_placed_like(param.grad, param)).float()
                if decay and self.decoupled:
                    p.mul_(1 - lr * decay)
                elif decay:
                    g = g.add(p, alpha=decay)
                m_stored, v_stored = (_local(state[name]) for name in MOMENTS)
                m = m_stored.float().lerp_(g, 1 - beta1)
                v = v_stored.float().mul_(beta2).addcmul_(g, g, value=1 - beta2)
                m_stored.copy_(m)
                v_stored.copy_(v)
                denom = (v.sqrt() / math.sqrt(1 - beta2**t)).add_(eps)
                p.addcdiv_(m, denom, value=-lr / (1 - beta1**t))
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's, which casts the moments to the parameters' dtype; then back to bf16."""
        super().load_state_dict(state_dict)
        for state in self.state.values():
            for name in MOMENTS:
                if name in state and state[name].dtype != torch.bfloat16:
                    state[name] = state[name].to(torch.bfloat16)


def _placed_like(grad: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """The gradient with its parameter's placements: a DTensor gradient can come out placed
    otherwise (under TP, Replicate for a Shard(0) weight), which torch's optimizers let DTensor
    redistribute implicitly and local arithmetic cannot."""
    if isinstance(grad, DTensor) and tuple(grad.placements) != tuple(param.placements):
        return grad.redistribute(param.device_mesh, param.placements)
    return grad


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t
