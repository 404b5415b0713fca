"""One optimizer step under pipeline parallelism: the same maths as `train_step`, with the
micro-batch loop run by the upstream schedule instead of a Python for-loop.

Who gives what to `schedule.step`: the rank of stage 0 the token ids, the rank of the last stage
the labels (`target`) and, with MTP, the next tokens. The loss of each micro-batch is computed on
the last stage, normalized by the global token counts (which every rank computes from its own copy
of the batch: the pp ranks of one data-parallel rank load the same samples). After the step, one
all-reduce over the pipeline gives every rank the loss, and the gradient norm, the overflow check
and the MoE statistics each span the pipeline ranks.

Under context parallelism every stage runs on this rank's part of each sequence: stage 0 gets the
part's tokens, the last stage MTP's per-depth input tokens ([B, D, L], `step.model_inputs`) and,
as `target`, every depth's targets at this rank's positions stacked [B, D + 1, L]
(`loss.split_targets`): the schedule cuts keywords and targets into micro-batches along dim 0
only, so the depths travel as one tensor.
"""

from collections.abc import Callable

import torch
import torch.distributed as dist

from dstrain.errors import UserError
from dstrain.metrics.pipeline_timer import PipelineTimer
from dstrain.metrics.probes import NO_PROBES, Probes
from dstrain.parallel.pipeline import Pipeline
from dstrain.train.heartbeat import TIMEOUT_SIGNS
from dstrain.train.loss import inputs_of, labels_of, loss_terms, next_tokens_of, split_targets
from dstrain.train.loss_scale import LossScaler
from dstrain.train.step import (
    DataParallel,
    Guard,
    StepResult,
    apply_update,
    autocast,
    backward_scale,
    global_counts,
    model_inputs,
    own_mean,
    set_aux_scale,
    to_device,
    whole_sequence,
)


def pipeline_step(
    pipe: Pipeline,
    optimizer: torch.optim.Optimizer,
    micro_batches: list[torch.Tensor],
    *,
    scaler: LossScaler,
    precision: str,
    grad_clip: float,
    mtp_weight: float,
    num_mtp: int,
    num_experts: int,
    bias_update_speed: float,
    dp: DataParallel,
    timer: PipelineTimer,
    finish_grads: Callable[[], None] | None = None,
    guard: Guard | None = None,
    probes: Probes = NO_PROBES,
    preempting: bool = False,
) -> StepResult:
    """`probes` time the optimizer phase and the collectives; the forward and backward phases
    are the pipeline timer's F, B, I, W and loss actions."""
    device = next(pipe.model.parameters()).device
    context = pipe.context
    # On the host: counted without a sync.
    part = context.split if context is not None else whole_sequence
    labels = [part(labels_of(mb)) for mb in micro_batches]
    targets = None
    if context is not None:
        targets = [split_targets(labels_of(mb), num_mtp, part) for mb in micro_batches]
    counts = global_counts(labels, num_mtp, dp, device, targets=targets)
    scale = backward_scale(scaler, dp.size, len(micro_batches), context.size if context else 1)
    set_aux_scale(pipe.model, scale.aux)

    def loss_fn(outputs: object, target: torch.Tensor) -> tuple[torch.Tensor, dict]:
        if context is None:
            total, parts = loss_terms(outputs, target, counts, mtp_weight)
        else:
            depths = list(target.unbind(1))
            total, parts = loss_terms(outputs, depths[0], counts, mtp_weight, targets=depths)
        return total * scale.loss, parts

    pipe.loss.fn = timer.timed_loss(loss_fn)
    pipe.loss.parts = {}
    # One copy of the step's batch (the schedule splits it back into micro-batches).
    batch = to_device(torch.cat(micro_batches), device)
    args, kwargs, target = _stage_inputs(pipe, batch, num_mtp)
    try:
        timer.start()
        # Autocast around the whole step: upstream runs forward and backward inside `step`;
        # backward ops keep the dtypes their forward chose, as if only the forwards were cast.
        with autocast(precision, device):
            pipe.schedule.step(*args, target=target, return_outputs=False, **kwargs)
        timer.stop()
    except RuntimeError as exc:
        raise _stuck(exc, pipe) from exc
    with probes.phase("optimizer"):
        if pipe.tied is not None:
            pipe.tied.sum_grads()
        if finish_grads is not None:
            finish_grads()
        zero = torch.zeros((), device=device)
        local = torch.stack([pipe.loss.parts.get(k, zero) for k in ("main", "mtp")])
        dist.all_reduce(local, group=pipe.group)  # the loss lives on the last stage's rank
        sums = dp.sum(local.clone())
        update = apply_update(
            pipe.model,
            optimizer,
            scaler,
            sums[0],
            grad_clip,
            bias_update_speed,
            dp,
            guard,
            pp_group=pipe.group,
            uncounted=_uncounted(pipe),
            preempting=preempting,
            after_reduce=scale.after,
        )
    return StepResult(
        loss=sums[0],
        local_loss=own_mean(local[0], labels, counts),
        mtp_loss=sums[1] if num_mtp else None,
        grad_norm=update.grad_norm,
        skipped=not update.applied,
        tokens=counts.per_depth[0],
        expert_load=_gather_loads(update.expert_load, pipe, num_experts, device),
        preempted=update.preempted,
    )


def _stage_inputs(
    pipe: Pipeline, batch: torch.Tensor, num_mtp: int
) -> tuple[tuple[torch.Tensor, ...], dict[str, torch.Tensor], torch.Tensor | None]:
    """What this rank gives `schedule.step`: the first stage's token ids, the last stage's
    `next_tokens` (MTP) and targets; under context parallelism this rank's part of each."""
    context = pipe.context
    if context is None:
        tokens, extra = inputs_of(batch), {"next_tokens": next_tokens_of(batch)}
        target = labels_of(batch)
    else:
        tokens, extra = model_inputs(batch, None, context, num_mtp)
        target = torch.stack(split_targets(labels_of(batch), num_mtp, context.split), dim=1)
    args = (tokens,) if pipe.has_first else ()
    kwargs = extra if pipe.has_last and num_mtp else {}
    return args, kwargs, target if pipe.has_last else None


def _stuck(exc: RuntimeError, pipe: Pipeline) -> Exception:
    """A pipeline peer that stopped responding becomes one clear error naming this rank, its
    stages and the peers it waited for; any other error passes through unchanged."""
    text = str(exc).strip()
    if not any(sign in text.lower() for sign in TIMEOUT_SIGNS):
        return exc
    rank, size = dist.get_rank(pipe.group), dist.get_world_size(pipe.group)
    peers = sorted({(rank - 1) % size, (rank + 1) % size} - {rank})
    stages = ", ".join(str(stage.stage_index) for stage in pipe.stages)
    return UserError(
        f"pipeline stuck: pp rank {rank} (global rank {dist.get_rank()}, stages {stages}) got "
        f"nothing from its pipeline peers (pp ranks {peers}) within the collective timeout: "
        f"{text.splitlines()[-1]}",
        "a peer rank hung or died: its own log names the cause; if the stages are only slow, "
        "raise comm.timeout_s",
        exit_code=1,
    )


def _uncounted(pipe: Pipeline) -> frozenset[torch.Tensor]:
    copy = pipe.tied.copy if pipe.tied is not None else None
    return frozenset([copy.weight]) if copy is not None else frozenset()


def _gather_loads(
    load: dict[str, torch.Tensor], pipe: Pipeline, num_experts: int, device: torch.device
) -> dict[str, torch.Tensor]:
    """Every router's load on every pipeline rank (each rank counted only its own layers)."""
    if not pipe.router_names:
        return {}
    table = torch.zeros(len(pipe.router_names), num_experts, device=device)
    rows = {name: row for row, name in enumerate(pipe.router_names)}
    for name, counts in load.items():
        # Activation checkpointing and compile wrap blocks: drop their name parts.
        plain = name.replace("._checkpoint_wrapped_module", "").replace("._orig_mod", "")
        table[rows[plain]] = counts.to(table.dtype)
    dist.all_reduce(table, group=pipe.group)
    return dict(zip(pipe.router_names, table, strict=True))
