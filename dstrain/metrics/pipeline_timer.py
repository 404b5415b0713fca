"""The measured pipeline bubble: every pipeline action (F, B, I, W, the loss) timed on each rank.

Why our own: upstream schedules have no timing API (their actions only run under
`record_function`, visible to a profiler but not to the training loop), so the timer wraps the
stage methods the schedules call: `forward_one_chunk` (F), `backward_one_chunk` (B for a full
backward, I for the input-gradient half), `backward_weight_one_chunk` (W), and the module
function through which every schedule waits for its sends and receives (R, part of the bubble:
`pipeline/p2p_wait_fraction` says how much of it is waiting on a peer rather than Python
overhead between actions).

Definition (the one the closed forms use): the pipeline-busy interval of a step is the longest
rank's time in the schedule (the first stage's, which starts first and runs the last backward);
what a rank did not spend computing in it (waiting for activations or gradients, send/recv, the
cool-down wait for the other ranks) is its bubble:

    bubble_fraction = 1 - sum over ranks(compute) / (pp x interval)

which is the mean over the pipeline ranks of each rank's idle share. Each rank times its own
span; the longest one per step is found when the window is collected (one all-gather per log
line), so no barrier stands between the steps.
"""

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.pipelining.schedules as upstream

from dstrain.metrics.spans import Spans
from dstrain.planner.bubble import Costs, theoretical_bubble

KINDS = ("F", "B", "I", "W", "L", "R")  # L: the loss on the last stage; R: p2p waits
COMPUTE = KINDS[:5]
PHASE_OF = {"F": "forward", "L": "forward", "B": "backward", "I": "backward", "W": "backward"}
HOST = torch.device("cpu")
_ACTIVE: list["PipelineTimer"] = []  # the timer of the step in flight (one pipeline per process)
# Seconds each side of an overlapped DualPipeV pair spent waiting for its turn while the other
# computed (`parallel/pipeline_overlap` adds to it): not this side's compute, so the timed action
# of that side leaves it out, and a pair counts its wall time once, not twice.
TURN_WAITS = {"forward": 0.0, "backward": 0.0}


class PipelineTimer:
    """Accumulates compute time per action kind and the busy interval, over a logging window."""

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        phases: Spans | None = None,
        after_backward: Callable[[], None] | None = None,
        device: torch.device = HOST,
    ) -> None:
        """`phases`: where the compute actions also count, as forward and backward time;
        `after_backward`: called after each B and W action (the communication timer closes
        DDP's exposed all-reduce there); `device`: the run's, which the group's backend serves
        (the window itself accumulates on the host, off the hot path)."""
        self.group = group
        self.device = device
        self.phases = phases
        self.after_backward = after_backward
        self.window = torch.zeros(2 + 2 * len(KINDS), dtype=torch.float64)  # [_, steps, ...]
        self.spans: list[float] = []  # this rank's time in the schedule, per step
        self.run_bubble: list[float] = []
        self._t0 = 0.0

    def instrument(self, stages: list[Any]) -> None:
        """Time the stage methods the schedules call (instance attributes shadow the methods),
        and (once per process) upstream's p2p wait."""
        _hook_p2p_wait()
        for stage in stages:
            stage.forward_one_chunk = self._timed(stage.forward_one_chunk, lambda *a, **k: "F")
            stage.backward_one_chunk = self._timed(stage.backward_one_chunk, _backward_kind)
            stage.backward_weight_one_chunk = self._timed(
                stage.backward_weight_one_chunk, lambda *a, **k: "W"
            )

    def timed_loss(self, fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        return self._timed(fn, lambda *a, **k: "L")

    def start(self) -> None:
        self._t0 = time.perf_counter()
        _ACTIVE.append(self)

    def stop(self) -> None:
        _ACTIVE.remove(self)
        self.spans.append(time.perf_counter() - self._t0)
        self.window[1] += 1

    def collect(self, schedule: str, microbatches: int, virtual_stages: int) -> dict[str, float]:
        """The window's figures, identical on every pipeline rank (one all-gather), then reset:
        bubble fraction, p2p-wait share, the mean milliseconds per F, B, I and W action, the
        stage imbalance (the busiest rank's compute over the mean: a slow stage idles the
        others, a bubble no schedule removes; trimming layers off it is the fix), and the
        schedule's theoretical bubble for the measured costs."""
        size = dist.get_world_size(self.group) if self.group is not None else 1
        spans = torch.tensor(self.spans, dtype=torch.float64)
        rows = self._gather(torch.cat([self.window, spans]))
        self.window.zero_()
        self.spans.clear()
        width = self.window.numel()
        totals = rows[:, :width].sum(0)
        per_rank = rows[:, 2 : 2 + 2 * len(COMPUTE) : 2].sum(1)
        totals[0] = size * rows[:, width:].max(0).values.sum()  # pp x the busy intervals
        interval, sums = totals[0].item(), totals[2::2]
        if interval <= 0:
            return {}
        compute = sums[: len(COMPUTE)].sum().item()
        figures = {
            "pipeline/bubble_fraction": max(0.0, 1.0 - compute / interval),
            "pipeline/p2p_wait_fraction": sums[KINDS.index("R")].item() / interval,
            "pipeline/stage_imbalance": (per_rank.max() / per_rank.mean()).item(),
        }
        self.run_bubble.append(figures["pipeline/bubble_fraction"])
        for i, kind in enumerate(KINDS[:4]):
            count = totals[3 + 2 * i].item()
            if count:
                figures[f"pipeline/time_{kind.lower()}_ms"] = 1000 * sums[i].item() / count
        # Split schedules time the input-gradient half (I) and W; the others a full backward (B).
        forward = figures.get("pipeline/time_f_ms", 0.0)
        backward = figures.get("pipeline/time_i_ms") or figures.get("pipeline/time_b_ms", 0.0)
        if forward > 0:
            costs = Costs(forward, backward, figures.get("pipeline/time_w_ms", 0.0))
            figures["pipeline/bubble_fraction_theory"] = theoretical_bubble(
                schedule, size, microbatches, virtual_stages, costs
            )
        return figures

    def _gather(self, row: torch.Tensor) -> torch.Tensor:
        """[pp ranks, len(row)]: every pipeline rank's window, through the run's device."""
        if self.group is None:
            return row.unsqueeze(0)
        size = dist.get_world_size(self.group)
        local = row.to(self.device)
        rows = torch.empty(size * row.numel(), dtype=row.dtype, device=local.device)
        dist.all_gather_into_tensor(rows, local, group=self.group)
        return rows.view(size, -1).cpu()  # host sync: once per log line

    def mean_bubble(self) -> float | None:
        """The mean of the collected windows, for summary.json."""
        return sum(self.run_bubble) / len(self.run_bubble) if self.run_bubble else None

    def _timed(self, fn: Callable[..., Any], kind_of: Callable[..., str]) -> Callable[..., Any]:
        slot = {kind: 2 + 2 * i for i, kind in enumerate(KINDS)}

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            waited = dict(TURN_WAITS)
            try:
                return fn(*args, **kwargs)
            finally:
                kind = kind_of(*args, **kwargs)
                seconds = time.perf_counter() - start
                if kind in PHASE_OF:
                    side = PHASE_OF[kind]
                    seconds -= TURN_WAITS[side] - waited[side]
                self.window[slot[kind]] += seconds
                self.window[slot[kind] + 1] += 1
                if self.phases is not None and kind in PHASE_OF:
                    self.phases.add(PHASE_OF[kind], seconds)
                if self.after_backward is not None and kind in ("B", "W"):
                    self.after_backward()

        return timed


def _hook_p2p_wait() -> None:
    """Every upstream schedule waits for its p2p work through `schedules._wait_batch_p2p`
    (looked up as a module global at call time): wrap it once, timing into the active timer."""
    original = upstream._wait_batch_p2p
    if getattr(original, "_dstrain_timed", False):
        return

    def wait(*args: Any, **kwargs: Any) -> Any:
        if not _ACTIVE:
            return original(*args, **kwargs)
        return _ACTIVE[-1]._timed(original, lambda *a, **k: "R")(*args, **kwargs)

    wait._dstrain_timed = True  # type: ignore[attr-defined]
    upstream._wait_batch_p2p = wait


def _backward_kind(*args: Any, full_backward: bool = True, **kwargs: Any) -> str:
    return "B" if full_backward else "I"
