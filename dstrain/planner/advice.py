"""What to do about a layout that runs out of memory: the planner's estimate of it, part by part,
beside what the run measured (when it ran: `train/oom.py`), and the nearest layouts that fit
(`planner/nearest.py`) as `--set` flags. One function for `dstrain train` (a step that ran out)
and `dstrain plan` (a layout that does not fit), one text format and one JSON shape.

What "fits" means. Without a measurement (plan), the planner's estimate within the device. With
one, the planner may have underestimated the run (its estimate of the layout that failed may
even be under the device), so a layout must also save, by the planner's own count, at least
what the run lacked: the memory in use at the failure plus the allocation that failed, less the
device (a lower bound: the step would have gone on allocating), and never less than MIN_SAVING
of the estimate. So the budget is min(device, estimate of the failed layout - that saving).
"""

from dataclasses import dataclass, field
from typing import Any

from dstrain.config.model_args import ModelArgs
from dstrain.config.schema import DstrainConfig
from dstrain.planner.estimate import Estimate, estimate_memory
from dstrain.planner.layout import Cluster, Layout
from dstrain.planner.memory import GiB
from dstrain.planner.nearest import MAX_CHANGES, Suggestion, nearest_fitting

MIN_SAVING = 0.01  # of the failed layout's estimate: a layout the planner sees no gain in is no fix
PARTS = ("weights", "gradients", "optimizer", "activations", "other")
TOP = 5
LABEL = 24  # the width of the rows' labels


@dataclass(frozen=True)
class Measured:
    """What one rank held when an allocation failed, in bytes. Weights, gradients and optimizer
    are counted from its runtime as the dry run counts them (`parallel/state_bytes.py`);
    activations and other are what the device (or host) held beyond them (`train/oom.py`)."""

    rank: int
    step: int
    where: str  # "device memory (cuda:0)", "host memory (RLIMIT_AS)", ...
    error: str  # the allocator's message, first line
    weights: float
    gradients: float
    optimizer: float
    activations: float
    other: float
    capacity: float  # what that memory holds for this rank
    requested: float | None = None  # the allocation that failed, when the message says

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations + self.other

    @property
    def needed(self) -> float:
        return self.total + (self.requested or 0.0)

    def to_json(self) -> dict[str, Any]:
        gib = {part: getattr(self, part) / GiB for part in PARTS}
        return {
            "rank": self.rank,
            "step": self.step,
            "where": self.where,
            "error": self.error,
            **gib,
            "total": self.total / GiB,
            "capacity": self.capacity / GiB,
            "requested": None if self.requested is None else self.requested / GiB,
        }


@dataclass
class MemoryAdvice:
    estimate: Estimate  # the planner's, of the layout that ran out (or does not fit)
    budget: float  # bytes a layout's estimate may reach to fit (module docstring)
    suggestions: list[Suggestion] = field(default_factory=list)
    measured: Measured | None = None

    def lines(self) -> list[str]:
        """The advice as text, one line each (no markup)."""
        m, e = self.measured, self.estimate
        unit, scale = _unit(max(e.memory.peak, m.needed if m else 0.0))
        rows = [(f"memory per {'rank' if m else 'GPU'}, {unit}", [*PARTS, "total"], "")]
        if m is not None:
            extra = f" (+{_size(m.requested)} requested)" if m.requested else ""
            values = [*(getattr(m, p) for p in PARTS), m.total]
            rows.append(
                (f"  measured (rank {m.rank})", values, f"of {m.capacity / scale:.2f}{extra}")
            )
        parts = _estimate_parts(e)
        values = [*(parts[p] for p in PARTS), e.memory.peak]
        of = f"of {e.hbm_bytes / scale:.2f}  ({e.layout.describe()})"
        rows.append(("  planner's estimate", values, of))
        out = [
            f"{label:<{LABEL}}"
            + "".join(f"{v:>12}" if isinstance(v, str) else f"{v / scale:>12.2f}" for v in cells)
            + (f"  {tail}" if tail else "")
            for label, cells, tail in rows
        ]
        out.append(self._budget_line(unit, scale))
        if not self.suggestions:
            out.append(
                f"  none within {MAX_CHANGES} changed settings on these {e.layout.world} "
                "GPUs: add GPUs (`dstrain plan --num-gpus N` searches them), shorten "
                "train.seq_len, or offload the optimizer (parallel.offload_optimizer)"
            )
        for i, s in enumerate(self.suggestions, 1):
            out.append(
                f"  {i}. {s.command_line()}    # {s.estimate.memory.peak / scale:.2f} {unit}, "
                f"{s.estimate.step_time_s:.3g} s/step ({s.estimate.layout.describe()})"
            )
        return out

    def _budget_line(self, unit: str, scale: float) -> str:
        head = (
            "nearest layouts that fit (fewest changed settings first, then the planner's "
            f"fastest), estimate <= {self.budget / scale:.2f} {unit}"
        )
        m = self.measured
        if m is None or self.budget >= m.capacity:
            return head + ": the device's memory"
        lacked = max(0.0, m.needed - m.capacity)
        saving = self.estimate.memory.peak - self.budget
        why = (
            f"what the run lacked, {lacked / scale:.2f} {unit}"
            if lacked >= MIN_SAVING * self.estimate.memory.peak
            else f"{100 * MIN_SAVING:.0f} %"
        )
        return (
            head + f": the device's memory, and at least {saving / scale:.2f} {unit} under "
            f"this layout's estimate ({why}; the planner can underestimate a run)"
        )

    def to_json(self) -> dict[str, Any]:
        e = self.estimate
        return {
            "measured": None if self.measured is None else self.measured.to_json(),
            "estimate": {
                "layout": e.layout.describe(),
                **{p: v / GiB for p, v in _estimate_parts(e).items()},
                "total": e.memory.peak / GiB,
                "capacity": e.hbm_bytes / GiB,
            },
            "budget_gib": self.budget / GiB,
            "nearest": [s.to_json() for s in self.suggestions],
        }


def advise(
    args: ModelArgs,
    cluster: Cluster,
    config: DstrainConfig,
    layout: Layout,
    measured: Measured | None = None,
    *,
    top: int = TOP,
) -> MemoryAdvice:
    """The advice for `layout` (the layout of `config`) on `cluster`: its estimate, and the
    nearest layouts under the budget (module docstring)."""
    estimate = estimate_memory(args, layout, cluster)
    budget = memory_budget(estimate, measured)
    suggestions = nearest_fitting(args, cluster, config, layout, budget, top=top)
    return MemoryAdvice(estimate, budget, suggestions, measured)


def memory_budget(estimate: Estimate, measured: Measured | None) -> float:
    """The most a layout's estimate may be to fit (module docstring)."""
    if measured is None:
        return estimate.hbm_bytes
    lacked = max(measured.needed - measured.capacity, MIN_SAVING * estimate.memory.peak)
    return min(measured.capacity, estimate.memory.peak - lacked)


def _estimate_parts(e: Estimate) -> dict[str, float]:
    m = e.memory
    return {
        "weights": m.weights,
        "gradients": m.gradients,
        "optimizer": m.optimizer,
        "activations": m.activations,
        "other": m.overhead,
    }


def _size(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / 2**20:.1f} MiB"


def _unit(largest: float) -> tuple[str, float]:
    """GiB, or MiB for a model too small to read in GiB (a debug run)."""
    return ("GiB", GiB) if largest >= GiB else ("MiB", 2**20)
