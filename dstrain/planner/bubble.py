"""Closed-form pipeline bubbles: the idle share of the pipeline-busy interval,
bubble_time / (bubble_time + per-rank compute), for each schedule dstrain runs.

Notation: p pipeline ranks, m micro-batches, F / B / W the time of one forward, input-gradient
backward and weight-gradient backward of one stage (chunk); the full backward costs B + W.
"""

import math
from dataclasses import dataclass

from dstrain.config.schema import V_SHAPED

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zbv", "dualpipev")


@dataclass(frozen=True)
class Costs:
    """Time of one action on one stage (chunk), in any unit (ms, or 1 = one forward)."""

    forward: float = 1.0
    backward: float = 1.0  # the input-gradient part; a full backward costs backward + weight
    weight: float = 1.0

    def __post_init__(self) -> None:
        values = (self.forward, self.backward, self.weight)
        if not all(math.isfinite(x) and x >= 0 for x in values):
            raise ValueError(f"costs must be finite and >= 0, got {values}")

    @property
    def full_backward(self) -> float:
        return self.backward + self.weight


def stages_per_rank(schedule: str, virtual_stages: int = 1) -> int:
    """Stages (model chunks) each rank holds: `virtual_stages` only matters for interleaved-1f1b;
    V-shaped schedules always hold 2 (stages r and 2p-1-r), gpipe and 1f1b hold 1."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
    if schedule in V_SHAPED:
        return 2
    return virtual_stages if schedule == "interleaved-1f1b" else 1


def theoretical_bubble(
    schedule: str,
    pp: int,
    microbatches: int,
    virtual_stages: int = 1,
    costs: Costs = Costs(),
) -> float:
    """The bubble fraction of `schedule` on `pp` ranks with `microbatches` micro-batches.

    - gpipe, 1f1b: (p-1)/(m+p-1) (GPipe, Huang et al. 2019; 1F1B has the same bubble and fewer
      activations in flight, Narayanan et al. 2021).
    - interleaved-1f1b with v stages per rank: (p-1)/(v*m+p-1), the bubble shrinks v-fold
      (Megatron-LM, Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
      Clusters", Sec. 2.2.2).
    - zbv: the ZB1P row of the DualPipe README table (Zero Bubble PP, Qi et al. 2023), bubble
      time (p-1)(F+B_full-2W) with per-chunk costs, over 2m(F+B_full) of compute per rank.
    - dualpipev: the DualPipeV row of the same table (DeepSeek-V3 report, Sec. 3.2.1), bubble
      time (PP/2-1)(F&B+B_full-3W) with PP = 2p stages and F&B = F+B_full (one stream, no
      compute overlap): (p-1)(F+2*B_full-3W), over 2m(F+B_full).

    The V-shaped rows subtract the weight-gradient work that fills the bubble; a negative value
    (W large against F and B) means no bubble at all and is clamped to 0. pp == 1 gives 0.
    """
    v = stages_per_rank(schedule, virtual_stages)
    if pp < 1 or microbatches < 1 or v < 1:
        raise ValueError(
            f"pp, microbatches and virtual_stages must be >= 1, got {pp}, {microbatches}, {v}"
        )
    if pp == 1:
        return 0.0
    p, m = pp, microbatches
    if schedule not in V_SHAPED:
        return (p - 1) / (v * m + p - 1)
    f, b, w = costs.forward, costs.full_backward, costs.weight
    # Table rows: ZB1P (F+B-2W) and DualPipeV (F&B+B-3W with F&B = F+B, one stream).
    per_hop = f + b - 2 * w if schedule == "zbv" else f + 2 * b - 3 * w
    bubble = max((p - 1) * per_hop, 0.0)
    compute = 2 * m * (f + b)
    return bubble / (bubble + compute) if bubble + compute > 0 else 0.0
