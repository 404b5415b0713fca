"""One optimizer step: micro-batches forward/backward, loss scaling, clipping, the update, and the
MoE balancing-bias update. Kept apart from the Trainer so a bare loop and the trainer can share
(and a benchmark compare) exactly the same maths.

Across data-parallel ranks (`dp`): the target-token counts are summed first, so each rank's loss
is its share of the global mean; DDP/FSDP average gradients over the dp ranks, so the backward
loss is multiplied by dp to turn that average into the sum the global mean needs. The expert
loads are summed before the balancing bias moves, so every rank (and a one-process run) routes
the same way.
"""

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from dstrain.metrics.probes import NO_PROBES, Probes
from dstrain.model.moe import MoE, Router
from dstrain.parallel.context_parallel import ContextShard
from dstrain.train.agreement import agree
from dstrain.train.loss import (
    TokenCounts,
    documents_of,
    inputs_of,
    labels_of,
    loss_terms,
    shifted,
    split_targets,
)
from dstrain.train.loss_scale import LossScaler


@dataclass
class StepResult:
    """Detached results of one step; `.item()` them only when logging (host sync on GPU)."""

    loss: torch.Tensor  # the global mean over every dp rank's tokens
    local_loss: torch.Tensor  # this dp rank's own mean (its tokens only)
    mtp_loss: torch.Tensor | None
    grad_norm: torch.Tensor
    skipped: bool
    tokens: int  # target tokens of the global batch
    expert_load: dict[str, torch.Tensor]  # router name -> tokens per expert, global batch
    preempted: bool = False  # some rank got SIGTERM: every rank stops after this step


@dataclass(frozen=True)
class DataParallel:
    """The ranks that see different data. group None: one process. `defer_sync` (ZeRO-1):
    gradients are reduced once per step, after the last micro-batch."""

    group: dist.ProcessGroup | None = None
    size: int = 1
    defer_sync: bool = False

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.group is not None and self.size > 1:
            dist.all_reduce(tensor, group=self.group)
        return tensor


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    if precision == "fp32":
        return contextlib.nullcontext()
    # fp8: bf16 autocast for what the FP8 recipe leaves out (embedding, head, norms, SDPA); the
    # FP8 linears turn autocast off inside (model/fp8.py).
    dtype = torch.float16 if precision == "fp16" else torch.bfloat16
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
    dp: DataParallel = DataParallel(),
    finish_grads: Callable[[], None] | None = None,
    guard: "Guard | None" = None,
    probes: Probes = NO_PROBES,
    preempting: bool = False,
    document_eos: int | None = None,
    context: ContextShard | None = None,
) -> StepResult:
    """`finish_grads` runs after the last backward, before clipping: the gradient reductions the
    DP wrappers do not do (expert-parallel experts). `guard(loss, grad_norm)` may refuse the
    update (the numerics guard). `probes` time the phases and the collectives. `preempting`:
    this rank got SIGTERM (the result says whether any rank did). `document_eos`: the EOS id
    under document masking (None: off). `context`: this rank's part of each sequence (context
    parallelism; `dp` then spans the cp ranks too, whose target tokens differ)."""
    device = next(model.parameters()).device
    part = context.split if context is not None else whole_sequence
    # Counted on the host, before the copy: no device sync for the divisors of the loss.
    host_labels = [part(labels_of(mb)) for mb in micro_batches]
    host_docs = document_ids(micro_batches, document_eos)
    host_targets = None
    if context is not None:  # every depth's targets at this rank's positions
        docs_of = host_docs or [None] * len(micro_batches)
        host_targets = [
            split_targets(labels_of(mb), num_mtp, part, d)
            for mb, d in zip(micro_batches, docs_of, strict=True)
        ]
    counts = global_counts(host_labels, num_mtp, dp, device, host_docs, host_targets)
    micro_batches = [to_device(mb, device) for mb in micro_batches]
    labels = [part(labels_of(mb)) for mb in micro_batches]
    docs = None if host_docs is None else [to_device(d, device) for d in host_docs]
    scale = backward_scale(scaler, dp.size, len(micro_batches), context.size if context else 1)
    set_aux_scale(model, scale.aux)
    loss = torch.zeros((), device=device)
    mtp_loss = torch.zeros((), device=device) if num_mtp else None
    for i, (mb, lab) in enumerate(zip(micro_batches, labels, strict=True)):
        with probes.phase("forward"):
            last = i == len(micro_batches) - 1
            doc = None if docs is None else docs[i]
            with grad_sync(model, last=last, defer=dp.defer_sync), autocast(precision, device):
                inputs, extra = model_inputs(mb, doc, context, num_mtp)
                outputs = model(inputs, **extra)
            targets = None
            if context is not None:
                targets = split_targets(labels_of(mb), num_mtp, part, doc)
            total, parts = loss_terms(outputs, lab, counts, mtp_weight, doc, targets)
        with probes.phase("backward"):
            (total * scale.loss).backward()
        loss = loss + parts["main"]
        if mtp_loss is not None:
            mtp_loss = mtp_loss + parts["mtp"]
    with probes.phase("optimizer"):
        if finish_grads is not None:
            finish_grads()
        local_loss = own_mean(loss.detach(), host_labels, counts, host_docs)
        loss = dp.sum(loss.detach())
        mtp_loss = dp.sum(mtp_loss.detach()) if mtp_loss is not None else None
        update = apply_update(
            model,
            optimizer,
            scaler,
            loss,
            grad_clip,
            bias_update_speed,
            dp,
            guard,
            preempting=preempting,
            after_reduce=scale.after,
        )
    return StepResult(
        loss,
        local_loss,
        mtp_loss,
        update.grad_norm,
        not update.applied,
        counts.per_depth[0],
        update.expert_load,
        update.preempted,
    )


def whole_sequence(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def model_inputs(
    mb: torch.Tensor, doc: torch.Tensor | None, context: ContextShard | None, num_mtp: int
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The model's arguments for a micro-batch: its input tokens and, under document masking,
    the documents. Under context parallelism this rank's part of the tokens and, with MTP,
    each depth's input tokens at this rank's positions (`next_tokens` [B, D, L]: depth k's at
    position i is token i + k, 0 past the end, whose targets are none)."""
    tokens = inputs_of(mb)
    extra = {} if doc is None else {"documents": doc}  # whole: the model splits it (cp)
    if context is None:
        return tokens, extra
    if num_mtp:
        depths = [context.split(shifted(tokens, k, 0)) for k in range(1, num_mtp + 1)]
        extra["next_tokens"] = torch.stack(depths, dim=1)
    return context.split(tokens), extra


@dataclass(frozen=True)
class BackwardScale:
    loss: float  # the main (and MTP) loss's multiplier in backward
    aux: float  # the balance loss's, per micro-batch (AddAuxiliaryLoss)
    after: float  # what the unscale multiplies the reduced gradients by, besides 1 / scale


def backward_scale(scaler: LossScaler, dp_size: int, micro_batches: int, cp: int) -> BackwardScale:
    """DDP/FSDP average gradients over dp, and the global-mean loss needs their sum: the backward
    loss is multiplied by dp. The balance loss enters backward on its own, loss-scaled like the
    main loss, averaged over micro-batches and (unlike the main loss) over dp. Under fp16 the x dp
    would make every activation gradient dp times one process's, and so overflow where one
    process does not: there the dp factor waits until after the reduction (the unscale).
    `cp`: context-parallel ranks, counted in `dp_size` (dp x cp ranks reduce gradients), whose
    balance-loss terms are parts of one sequence's loss: they must add up, not average, so its
    backward is multiplied by cp."""
    m = scaler.loss_multiplier()
    if scaler.enabled:
        return BackwardScale(m, m * cp / (micro_batches * dp_size), float(dp_size))
    return BackwardScale(m * dp_size, m * cp / micro_batches, 1.0)


def own_mean(
    share: torch.Tensor,
    labels: list[torch.Tensor],
    counts: TokenCounts,
    documents: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """A rank's share of the global mean loss, turned into the mean over its own tokens."""
    own = TokenCounts.of(labels, 0, documents).per_depth[0]
    return share * (counts.per_depth[0] / max(own, 1))


Guard = Callable[[float, float], bool]  # (global loss, gradient norm) -> apply the update


def apply_update(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: LossScaler,
    loss: torch.Tensor,
    grad_clip: float,
    bias_update_speed: float,
    dp: DataParallel,
    guard: Guard | None,
    *,
    pp_group: dist.ProcessGroup | None = None,
    uncounted: frozenset[torch.Tensor] = frozenset(),
    preempting: bool = False,
    after_reduce: float = 1.0,
) -> "Update":
    """After the last backward, on gradients that are complete: unscale (fp16), clip, agree
    with every rank on the overflow and preemption flags and read the global loss and norm
    (`agreement.agree`: one collective, one host sync), let the guard judge, step, then move
    the balancing biases (not after a refused step: its batch is dropped). `pp_group`: the
    pipeline ranks, which hold other parameters; `preempting`: this rank got SIGTERM;
    `after_reduce`: the factor `backward_scale` left for the unscale."""
    params = [p for p in model.parameters() if p.grad is not None]
    overflow = scaler.unscale(params, loss.device, after_reduce)
    grad_norm = clip_grad_norm(params, grad_clip, pp_group=pp_group, uncounted=uncounted)
    verdict = agree(loss, grad_norm, overflow, preempting)
    scaler.update(verdict.finite)
    applied = verdict.finite and (guard is None or guard(verdict.loss, verdict.grad_norm))
    if applied:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    load = update_balancing_bias(model, bias_update_speed if applied else 0.0, dp)
    return Update(grad_norm, applied, load, verdict.preempted)


@dataclass(frozen=True)
class Update:
    grad_norm: torch.Tensor
    applied: bool
    expert_load: dict[str, torch.Tensor]
    preempted: bool


def clip_grad_norm(
    params: list[torch.Tensor],
    max_norm: float,
    *,
    pp_group: dist.ProcessGroup | None = None,
    uncounted: frozenset[torch.Tensor] = frozenset(),
) -> torch.Tensor:
    """The global gradient norm, clipped to max_norm when max_norm > 0; returns the norm before
    clipping. Gradients may be plain tensors and DTensors on several meshes (FSDP, TP, EP): each
    kind's squared norm is summed over its shards (an all-reduce per kind), then combined, and
    summed over the pipeline stages (`pp_group`). `uncounted` parameters (the MTP copy of a tied
    embedding, whose gradient the original already counts) are clipped but not counted."""
    by_kind: dict[object, list[torch.Tensor]] = {}
    for p in params:
        g = p.grad
        key = (g.device_mesh, g.placements) if isinstance(g, DTensor) else None
        by_kind.setdefault(key, []).append(g)
    device = params[0].grad.device if params else torch.device("cpu")
    squares = [torch.zeros((), device=device)]
    for key, grads in by_kind.items():
        counted = [g for g in grads if not any(g is p.grad for p in uncounted)]
        if counted:
            squares.append(_square_sum(counted, key).to(device))
    total_sq = torch.stack(squares).sum()
    if pp_group is not None:
        dist.all_reduce(total_sq, group=pp_group)
    total = total_sq.sqrt()
    if max_norm > 0:
        # A tensor factor, as torch's clip_grad_norm_ uses: no host sync (1.0 when not clipping).
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
        for grads in by_kind.values():
            local = [_local(g) for g in grads]
            torch._foreach_mul_(local, coef.to(local[0].device))
    return total.detach()


def _square_sum(grads: list[torch.Tensor], kind: tuple | None) -> torch.Tensor:
    """Sum of squares of gradients sharing one (mesh, placements): local squares summed over the
    mesh axes that shard them. (Our own rather than DTensor's norm, which came out 3e-5 off for
    a Shard(0) [2048, 128] gradient on 2 gloo ranks in torch 2.13.)"""
    local = torch.stack([_local(g).float().square().sum() for g in grads]).sum()
    if kind is not None:
        mesh, placements = kind
        for axis, placement in enumerate(placements):
            if not placement.is_replicate():
                dist.all_reduce(local, group=mesh.get_group(axis))
    return local


def _local(grad: torch.Tensor) -> torch.Tensor:
    return grad.to_local() if isinstance(grad, DTensor) else grad


def update_balancing_bias(
    model: nn.Module, speed: float, dp: DataParallel = DataParallel()
) -> dict[str, torch.Tensor]:
    """Aux-loss-free balancing: each router learns from the load of the global batch, then its
    counter resets. Returns the loads, for the moe/* metrics."""
    loads = {}
    for name, router in model.named_modules():
        if isinstance(router, Router):
            load = dp.sum(router.tokens_per_expert.clone())
            loads[name] = load
            if speed > 0:
                router.update_bias(load, speed)
            router.tokens_per_expert.zero_()
    return loads


def to_device(batch: torch.Tensor, device: torch.device) -> torch.Tensor:
    """One copy per micro-batch; non-blocking from the loader's pinned memory to a GPU."""
    return batch.to(device, non_blocking=batch.is_pinned())


def document_ids(
    micro_batches: list[torch.Tensor], eos_id: int | None
) -> list[torch.Tensor] | None:
    """Each micro-batch's document ids under document masking (`eos_id` set), else None."""
    if eos_id is None:
        return None
    return [documents_of(mb, eos_id) for mb in micro_batches]


def global_counts(
    labels: list[torch.Tensor],
    num_mtp: int,
    dp: DataParallel,
    device: torch.device,
    documents: list[torch.Tensor] | None = None,
    targets: list[list[torch.Tensor]] | None = None,
) -> TokenCounts:
    """Target tokens per depth over the global batch; `labels` (and `documents`) on the host
    (counted there); `targets`: each depth's own, under context parallelism."""
    if targets is not None:
        local = TokenCounts.of_targets(targets)
    else:
        local = TokenCounts.of(labels, num_mtp, documents)
    if dp.size == 1:
        return local
    summed = dp.sum(torch.tensor(local.per_depth, dtype=torch.int64, device=device))
    # Host sync: the counts are the loss's divisors, needed as numbers before the forward.
    return TokenCounts(tuple(int(n) for n in summed.tolist()))


def grad_sync(model: nn.Module, *, last: bool, defer: bool) -> contextlib.AbstractContextManager:
    """Around a micro-batch's forward. DDP: all-reduce gradients once, after the last
    micro-batch. FSDP2 under ZeRO-1 (`defer`): keep the gathered weights and accumulate
    unsharded gradients until the last micro-batch, then reduce-scatter and reshard (flags that
    FSDP2 reads in backward, so they are set here and stay set)."""
    if defer and isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(last)
        model.set_reshard_after_backward(last)
        return contextlib.nullcontext()
    if not last and hasattr(model, "no_sync"):
        return model.no_sync()
    return contextlib.nullcontext()


def set_aux_scale(model: nn.Module, scale: float) -> None:
    for moe in (m for m in model.modules() if isinstance(m, MoE)):
        moe.aux_loss_scale = scale
