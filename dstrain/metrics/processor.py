"""The metrics processor: every `metrics.log_interval` steps, the window since the last log line
becomes one flat dictionary of namespaced keys (docs/observability.md lists them), identical on
every rank, which every sink receives.

Per-rank figures (memory, phase times, blocked communication, each data-parallel rank's own loss)
cross ranks in one all-gather per log line, issued outside the communication timer.
"""

import resource
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from dstrain.metrics.comm_timer import AXES
from dstrain.metrics.moe_stats import layer_label, load_stats
from dstrain.metrics.probes import PHASES, Probes

MEMORY = ("model_states_mb", "rss_mb", "peak_rss_mb", "peak_allocated_mb", "peak_reserved_mb")


class Window:
    """Wall time, tokens and steps since the last log line."""

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


@dataclass
class StepFigures:
    """The last step of the window, as the trainer saw it (tensors: detached, any device)."""

    loss: torch.Tensor  # global mean
    grad_norm: torch.Tensor
    local_loss: torch.Tensor  # this data-parallel rank's own mean
    lr: float
    mtp_loss: torch.Tensor | None = None
    loss_scale: float | None = None
    expert_load: dict[str, torch.Tensor] = field(default_factory=dict)  # router -> tokens


@dataclass(frozen=True)
class Throughput:
    world_size: int
    flops_per_token: float  # model FLOPs per token, forward + backward
    peak_flops: float | None  # per device; None or 0: unknown (no MFU)


class MetricsProcessor:
    def __init__(
        self,
        model: torch.nn.Module,
        throughput: Throughput,
        probes: Probes,
        device: torch.device,
        optimizer: torch.optim.Optimizer | None = None,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.throughput = throughput
        self.probes = probes
        self.device = device
        self.run_peaks: dict[str, float] = {}  # for summary.json
        self.comm_fractions: list[float] = []

    def collect(self, step: StepFigures, window: Window) -> dict[str, float | list[float]]:
        labels = sorted({layer_label(name) for name in step.expert_load})
        rows = self._gather(self._local_row(step, window, labels))
        metrics: dict[str, float | list[float]] = {}
        metrics.update(_optimization(step, rows))
        metrics.update(self._throughput(window, rows))
        metrics.update(_memory(rows, self.device))
        metrics.update(_times(rows, window.steps))
        metrics.update(self._comm(rows, window.steps))
        metrics.update(_moe(step.expert_load, rows, labels))
        for key in ("memory/peak_rss_mb", "memory/peak_allocated_mb"):
            if key in metrics:
                self.run_peaks[key] = float(metrics[key])  # type: ignore[arg-type]
        return metrics

    def mean_comm_fraction(self) -> float | None:
        if not self.comm_fractions:
            return None
        return sum(self.comm_fractions) / len(self.comm_fractions)

    # ---- one row per rank ------------------------------------------------------------------

    def _local_row(self, step: StepFigures, window: Window, labels: list[str]) -> torch.Tensor:
        """[window s, local loss, memory x4, phase s x5, exposed s x axes, bytes x axes,
        bias norm per MoE layer]: everything a rank knows that others do not."""
        phases = self.probes.spans.take()
        comm = self.probes.comm.take() if self.probes.comm is not None else ({}, {})
        biases = _bias_norms(self.model)
        states = model_state_bytes(self.model, self.optimizer) / 2**20
        row = [window.seconds, step.local_loss.item(), states, *_memory_now(self.device)]
        row += [phases.get(p, 0.0) for p in PHASES]
        row += [comm[0].get(a, 0.0) for a in AXES] + [float(comm[1].get(a, 0)) for a in AXES]
        row += [biases.get(label, 0.0) for label in labels]
        return torch.tensor(row, dtype=torch.float64)

    def _gather(self, row: torch.Tensor) -> torch.Tensor:
        """[ranks, len(row)]; the collective is not training communication."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return row.unsqueeze(0)
        local = row.to(self.device)
        rows = torch.empty(
            dist.get_world_size() * row.numel(), dtype=row.dtype, device=local.device
        )
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        with self.probes.quiet():
            gather(rows, local)
        return rows.view(dist.get_world_size(), -1).cpu()

    def _throughput(self, window: Window, rows: torch.Tensor) -> dict[str, float]:
        t = self.throughput
        seconds = rows[:, _WINDOW].max().item()  # the slowest rank sets the pace
        tokens_per_s = window.tokens / max(seconds, 1e-9)
        per_device = tokens_per_s / t.world_size
        figures = {
            "throughput/tokens_per_s": tokens_per_s,
            "throughput/tokens_per_s_per_device": per_device,
            "throughput/tflops_per_device": per_device * t.flops_per_token / 1e12,
            "time/step_s": seconds / max(window.steps, 1),
        }
        if t.peak_flops:
            figures["throughput/mfu"] = per_device * t.flops_per_token / t.peak_flops
        return figures

    def _comm(self, rows: torch.Tensor, steps: int) -> dict[str, float]:
        if self.probes.comm is None:
            return {}
        seconds = rows[:, _WINDOW].clamp(min=1e-9)
        exposed = rows[:, _EXPOSED : _EXPOSED + len(AXES)]
        moved = rows[:, _BYTES : _BYTES + len(AXES)]
        share = exposed.sum(dim=1) / seconds
        figures = {
            "comm/exposed_fraction": share.mean().item(),
            "comm/exposed_fraction_max": share.max().item(),
        }
        self.comm_fractions.append(figures["comm/exposed_fraction"])
        for i, axis in enumerate(AXES):
            if exposed[:, i].any() or moved[:, i].any():
                figures[f"comm/{axis}/exposed_fraction"] = (exposed[:, i] / seconds).mean().item()
                figures[f"comm/{axis}/bytes_per_step"] = moved[:, i].mean().item() / max(steps, 1)
        return figures


# Column offsets of a rank's row.
_WINDOW, _LOSS, _MEMORY = 0, 1, 2
_PHASES = _MEMORY + len(MEMORY)
_EXPOSED = _PHASES + len(PHASES)
_BYTES = _EXPOSED + len(AXES)
_BIAS = _BYTES + len(AXES)


def _optimization(step: StepFigures, rows: torch.Tensor) -> dict[str, float]:
    figures = {
        "loss/main": step.loss.item(),
        "loss/max_over_dp": rows[:, _LOSS].max().item(),
        "optim/grad_norm": step.grad_norm.item(),
        "optim/lr": step.lr,
    }
    if step.mtp_loss is not None:
        figures["loss/mtp"] = step.mtp_loss.item()
    if step.loss_scale is not None:
        figures["optim/loss_scale"] = step.loss_scale
    return figures


def _memory(rows: torch.Tensor, device: torch.device) -> dict[str, float]:
    names = MEMORY if device.type == "cuda" else MEMORY[:3]
    return {f"memory/{n}": rows[:, _MEMORY + i].max().item() for i, n in enumerate(names)}


def _times(rows: torch.Tensor, steps: int) -> dict[str, float]:
    per_step = rows[:, _PHASES : _PHASES + len(PHASES)].mean(dim=0) / max(steps, 1)
    return {f"time/{p}_s": per_step[i].item() for i, p in enumerate(PHASES)}


def _moe(
    loads: dict[str, torch.Tensor], rows: torch.Tensor, labels: list[str]
) -> dict[str, float | list[float]]:
    figures: dict[str, float | list[float]] = {}
    worst, dead = 0.0, 0.0
    by_label = {layer_label(name): load for name, load in loads.items()}
    for i, label in enumerate(labels):
        stats = load_stats(by_label[label])
        for key, value in stats.items():
            figures[f"moe/{label}/{key}"] = value
        figures[f"moe/{label}/bias_norm"] = rows[:, _BIAS + i].max().item()
        if stats:
            worst = max(worst, float(stats["max_over_mean"]))  # type: ignore[arg-type]
            dead += float(stats["dead_experts"])  # type: ignore[arg-type]
    if labels:
        figures["moe/max_over_mean"] = worst
        figures["moe/dead_experts"] = dead
    return figures


def _bias_norms(model: torch.nn.Module) -> dict[str, float]:
    """This rank's routers' balancing-bias norms (under PP, its own layers only)."""
    norms = {}
    for name, buffer in model.named_buffers():
        if name.endswith("router.expert_bias"):
            norms[layer_label(name.removesuffix(".expert_bias"))] = buffer.float().norm().item()
    return norms


def model_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> float:
    """This rank's model states: its parameter shards, a gradient of the same size for each one
    that trains (counted from the parameters: at log time the gradients are already freed), and
    the optimizer's state tensors (its shard under ZeRO)."""
    total = 0
    for param in model.parameters():
        size = _local(param).numel() * param.element_size()
        total += size * (2 if param.requires_grad else 1)
    if optimizer is not None:
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    total += _local(value).numel() * value.element_size()
    return float(total)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _memory_now(device: torch.device) -> list[float]:
    """[RSS now, peak RSS, GPU peak allocated, GPU peak reserved] in MB (GPU: 0 on CPU)."""
    peak_rss = peak_rss_mb()
    statm = Path("/proc/self/statm")
    pages = int(statm.read_text().split()[1]) if statm.exists() else 0
    rss = pages * resource.getpagesize() / 2**20 if pages else peak_rss
    peak_rss = max(peak_rss, rss)  # the kernel updates ru_maxrss lazily
    if device.type != "cuda":
        return [rss, peak_rss, 0.0, 0.0]
    mb = 2**20
    return [
        rss,
        peak_rss,
        torch.cuda.max_memory_allocated(device) / mb,
        torch.cuda.max_memory_reserved(device) / mb,
    ]


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
