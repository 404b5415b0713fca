"""The figures logged every `metrics.log_interval` steps, from a step's result and the wall time
and tokens since the last log line. (The observability issue turns this into one metrics
processor with more keys; the names here are already its namespaced ones.)"""

import resource
import time
from dataclasses import dataclass

import torch

from dstrain.train.loss_scale import LossScaler
from dstrain.train.step import StepResult


class Window:
    """Wall time and tokens since the last log line."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.seconds, self.tokens, self.steps = 0.0, 0, 0

    def start(self) -> None:
        self._t0 = time.perf_counter()

    def stop(self, tokens: int) -> float:
        """Adds the step; returns its seconds."""
        seconds = time.perf_counter() - self._t0
        self.seconds += seconds
        self.tokens += tokens
        self.steps += 1
        return seconds


@dataclass(frozen=True)
class Throughput:
    world_size: int
    flops_per_token: float
    peak_flops: float | None  # per device; None: unknown (no MFU)


def step_metrics(
    result: StepResult,
    window: Window,
    optimizer: torch.optim.Optimizer,
    scaler: LossScaler,
    throughput: Throughput,
) -> dict[str, float]:
    tokens_per_s = window.tokens / max(window.seconds, 1e-9)
    per_device = tokens_per_s / throughput.world_size
    metrics = {
        "loss/main": result.loss.item(),
        "optim/lr": optimizer.param_groups[0]["lr"],
        "optim/grad_norm": result.grad_norm.item(),
        "throughput/tokens_per_s": tokens_per_s,
        "throughput/tokens_per_s_per_device": per_device,
        "time/step_s": window.seconds / max(window.steps, 1),
        "memory/rss_mb": peak_rss_mb(),
    }
    if result.mtp_loss is not None:
        metrics["loss/mtp"] = result.mtp_loss.item()
    if scaler.enabled:
        metrics["optim/loss_scale"] = scaler.scale
    if throughput.peak_flops:
        metrics["throughput/mfu"] = per_device * throughput.flops_per_token / throughput.peak_flops
    for name, load in result.expert_load.items():
        if load.sum() > 0:
            metrics[f"moe/{name}/max_over_mean"] = (load.max() / load.mean()).item()
    return metrics


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
