"""One optimizer step: micro-batches forward/backward, loss scaling, clipping, the update, and the
MoE balancing-bias update. Kept apart from the Trainer so a bare loop and the trainer can share
(and a benchmark compare) exactly the same maths."""

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from dstrain.model.moe import MoE, Router
from dstrain.train.loss import TokenCounts, loss_terms
from dstrain.train.loss_scale import LossScaler


@dataclass
class StepResult:
    """Detached results of one step; `.item()` them only when logging (host sync on GPU)."""

    loss: torch.Tensor
    mtp_loss: torch.Tensor | None
    grad_norm: torch.Tensor
    skipped: bool
    tokens: int
    expert_load: dict[str, torch.Tensor]  # router name -> tokens per expert this step


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: list[torch.Tensor],
    *,
    scaler: LossScaler,
    precision: str,
    grad_clip: float,
    mtp_weight: float,
    num_mtp: int,
    bias_update_speed: float,
) -> StepResult:
    device = next(model.parameters()).device
    labels = [mb[:, 1:] for mb in micro_batches]
    counts = TokenCounts.of(labels, num_mtp)
    _set_aux_scale(model, 1.0 / len(micro_batches))
    loss = torch.zeros((), device=device)
    mtp_loss = torch.zeros((), device=device) if num_mtp else None
    for mb, lab in zip(micro_batches, labels, strict=True):
        with autocast(precision, device):
            outputs = model(mb[:, :-1].to(device))
        total, parts = loss_terms(outputs, lab.to(device), counts, mtp_weight)
        (total * scaler.loss_multiplier()).backward()
        loss = loss + parts["main"]
        if mtp_loss is not None:
            mtp_loss = mtp_loss + parts["mtp"]
    params = [p for p in model.parameters() if p.grad is not None]
    finite = scaler.unscale_and_check(params)
    max_norm = grad_clip if grad_clip > 0 else float("inf")
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
    if finite:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    load = update_balancing_bias(model, bias_update_speed)
    return StepResult(loss, mtp_loss, grad_norm.detach(), not finite, counts.per_depth[0], load)


def update_balancing_bias(model: nn.Module, speed: float) -> dict[str, torch.Tensor]:
    """Aux-loss-free balancing: each router learns from the load it saw this step, then its
    counter resets. Returns the loads, for the moe/* metrics."""
    loads = {}
    for name, router in model.named_modules():
        if isinstance(router, Router):
            loads[name] = router.tokens_per_expert.clone()
            if speed > 0:
                router.update_bias(router.tokens_per_expert, speed)
            router.tokens_per_expert.zero_()
    return loads


def _set_aux_scale(model: nn.Module, scale: float) -> None:
    for moe in (m for m in model.modules() if isinstance(m, MoE)):
        moe.aux_loss_scale = scale
