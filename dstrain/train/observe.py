"""What a run measures and where the figures go, built for the Trainer: the probes (phase and
communication timers, watching DDP's buckets), the pipeline timer, and the sinks (rank 0 writes
the files; every rank may serve Prometheus)."""

from pathlib import Path
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from dstrain.config.schema import DstrainConfig
from dstrain.metrics.comm_timer import CommTimer, axis_of_groups
from dstrain.metrics.pipeline_timer import PipelineTimer
from dstrain.metrics.probes import NO_PROBES, Probes
from dstrain.metrics.processor import StepFigures
from dstrain.metrics.sinks import JsonlSink, Sink, TensorBoardSink
from dstrain.parallel.pipeline import Pipeline
from dstrain.train.loss_scale import LossScaler
from dstrain.train.step import StepResult


def build_probes(
    config: DstrainConfig,
    device: torch.device,
    meshes: Any,
    model: torch.nn.Module,
    pipeline: Pipeline | None,
) -> Probes:
    """Phase timers, and with a process group the communication timer (metrics.timers)."""
    if not config.metrics.timers:
        return NO_PROBES
    if meshes is None:
        return Probes(device)
    tied = pipeline.tied if pipeline is not None else None
    extra = {"pp": tied.group} if tied is not None else {}
    comm = CommTimer(device, axis_of_groups(meshes, extra))
    wrapped = [stage.submod for stage in pipeline.stages] if pipeline is not None else [model]
    for module in wrapped:
        if isinstance(module, DistributedDataParallel):
            comm.watch_ddp(module, pipelined=pipeline is not None)
    comm.start()
    return Probes(device, comm)


def build_pipeline_timer(
    pipeline: Pipeline | None, probes: Probes, device: torch.device
) -> PipelineTimer | None:
    """Times every pipeline action; F, B, I, W and the loss also count as forward and backward
    time, and DDP's exposed all-reduce closes after each backward action."""
    if pipeline is None:
        return None
    comm = probes.comm
    timer = PipelineTimer(
        pipeline.group,
        phases=probes.spans,
        after_backward=comm.backward_done if comm is not None else None,
        device=device,
    )
    timer.instrument(pipeline.stages)
    return timer


def build_sinks(
    config: DstrainConfig,
    run_dir: Path,
    *,
    rank: int,
    local_rank: int,
    is_main: bool,
    after_step: int,
    resolved: dict[str, Any],
) -> list[Sink]:
    """Every rank: its Prometheus endpoint (port + local rank). Rank 0: JSONL (continuing after
    `after_step` on a resume), TensorBoard, W&B offline. `resolved`: the config as it ran."""
    m = config.metrics
    sinks: list[Sink] = []
    if m.prometheus_port is not None:
        from dstrain.metrics.prometheus import PrometheusSink  # imports prometheus_client

        port = m.prometheus_port + local_rank
        sinks.append(PrometheusSink(port, m.prometheus_host, run=config.run.name, rank=rank))
    if not is_main:
        return sinks
    if m.jsonl:
        sinks.append(JsonlSink(run_dir / "metrics.jsonl", after_step=after_step))
    if m.tensorboard:
        sinks.append(TensorBoardSink(run_dir / "tb"))
    if m.wandb:
        from dstrain.metrics.wandb_sink import WandbSink  # imports wandb: only when asked

        sinks.append(WandbSink(run_dir, run=config.run.name, config=resolved))
    return sinks


def step_figures(
    last: StepResult, optimizer: torch.optim.Optimizer, scaler: LossScaler
) -> StepFigures:
    """The last step of a window, as the metrics processor takes it."""
    return StepFigures(
        loss=last.loss,
        grad_norm=last.grad_norm,
        local_loss=last.local_loss,
        lr=optimizer.param_groups[0]["lr"],
        mtp_loss=last.mtp_loss,
        loss_scale=scaler.scale if scaler.enabled else None,
        expert_load=last.expert_load,
    )
