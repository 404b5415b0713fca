"""One layout on one cluster: memory, step time, throughput, MFU, bubble and exposed
communication, from the memory, compute, communication and bubble models.

Step time of the busiest pipeline rank (Narayanan et al. 2021, sec. 3):

    step = (m x t_microbatch + exposed in-stage comm) / (1 - b) + exposed data-parallel comm
           + optimizer step

with t_microbatch its forward + backward (+ recompute) compute, b its idle share of the
pipeline's busy interval (`_bubbles`: a flow shop over the ranks' unequal stage times under
gpipe and 1f1b, else the schedule's closed form for the modelled F, B and W costs,
`planner/bubble.py`; the bubble reported is the mean over the ranks), the in-stage communication
(TP, EP, PP, CP) stretched by the bubble like the compute it sits between, and the
data-parallel tail after the pipeline drains, and AdamW's step over the rank's shard (memory-
bound: `compute.optimizer_seconds`). MFU = model FLOPs per step (`model/flops.py`: the
trainer's MFU numerator) / (step x GPUs x dense peak).
"""

from dataclasses import dataclass, field

from dstrain.config.model_args import ModelArgs
from dstrain.model.flops import training_flops_per_token
from dstrain.planner.bubble import Costs, stages_per_rank, theoretical_bubble
from dstrain.planner.comm import CommConstants, CommTimes, comm_per_step
from dstrain.planner.compute import (
    ComputeConstants,
    StageTimes,
    optimizer_seconds,
    stage_times,
)
from dstrain.planner.kernels import comm_sm_share
from dstrain.planner.layout import Cluster, Layout
from dstrain.planner.memory import GiB, Memory, memory_per_gpu
from dstrain.planner.shape import RankShape, rank_shapes

IN_STAGE = ("tp", "ep", "pp", "cp")
OVERLAPPED = ("dp", "edp", "ep", "cp")  # the axes whose collectives overlap compute
TIGHT = 0.10  # an estimate within 10 % of the device is "tight": the estimate's own error
DATA_PARALLEL = ("dp", "edp")


@dataclass(frozen=True)
class Constants:
    """Everything `dstrain plan --calibrate` fits."""

    compute: ComputeConstants = field(default_factory=ComputeConstants)
    comm: CommConstants = field(default_factory=CommConstants)


@dataclass
class Estimate:
    layout: Layout
    memory: Memory
    hbm_bytes: float
    step_time_s: float = 0.0
    compute_s: float = 0.0  # forward and backward (and recompute), per step
    optimizer_s: float = 0.0
    bubble_fraction: float = 0.0  # mean over the pipeline ranks (the trainer's pipeline timer)
    # the busiest rank's share of the pipeline's interval spent neither computing nor in its
    # TP, EP or CP collectives: idle, and waiting on its stage-to-stage sends (Zero Bubble's
    # bubble rate, (cost - m (F + B + W)) / cost of the longest stage)
    busiest_bubble: float = 0.0
    comm: CommTimes | None = None
    model_flops_per_step: float = 0.0
    num_gpus: int = 0
    peak_flops: float = 0.0
    illegal: list[str] = field(default_factory=list)  # the trainer's reasons, when not legal
    # tokens/s per GPU that published runs like this one measured against such a prediction
    # (low, high, runs): `planner/published.py`
    throughput_range: tuple[float, float, int] | None = None

    @property
    def fits(self) -> bool:
        """The estimate fits (what the search ranks by: a layout it recommends has room)."""
        return self.memory.peak <= self.hbm_bytes

    @property
    def memory_verdict(self) -> str:
        """Memory's verdict: "does not fit" only when even the floor (`Memory.floor`) exceeds
        the device; "tight" when the estimate is over, or within TIGHT of, the device while the
        floor is not; else "fits"."""
        if self.memory.floor > self.hbm_bytes:
            return "does not fit"
        return "tight" if self.memory.peak > (1 - TIGHT) * self.hbm_bytes else "fits"

    @property
    def memory_margin_gib(self) -> float:
        """Device memory left over by the estimate (negative: over by that much)."""
        return (self.hbm_bytes - self.memory.peak) / GiB

    @property
    def usable(self) -> bool:
        return self.fits and not self.illegal

    @property
    def tokens_per_s(self) -> float:
        return self.layout.tokens_per_step / self.step_time_s if self.step_time_s else 0.0

    @property
    def tflops_per_gpu(self) -> float:
        if not self.step_time_s:
            return 0.0
        return self.model_flops_per_step / self.step_time_s / self.num_gpus / 1e12

    @property
    def mfu(self) -> float:
        return self.tflops_per_gpu * 1e12 / self.peak_flops if self.peak_flops else 0.0

    @property
    def comm_exposed_fraction(self) -> float:
        if not self.step_time_s or self.comm is None:
            return 0.0
        return self.comm.exposed_seconds / self.step_time_s

    def to_json(self) -> dict:
        return {
            "layout": {**self.layout.__dict__, "world": self.layout.world},
            "legal": not self.illegal,
            "illegal_reasons": self.illegal,
            "fits": self.fits,
            "memory_verdict": self.memory_verdict,
            "memory_margin_gib": self.memory_margin_gib,
            "memory_gib_per_gpu": {**self.memory.to_json(), "capacity": self.hbm_bytes / GiB},
            "step_time_s": self.step_time_s,
            "compute_s": self.compute_s,
            "optimizer_s": self.optimizer_s,
            "tokens_per_s": self.tokens_per_s,
            "tokens_per_s_per_gpu": self.tokens_per_s / self.num_gpus if self.num_gpus else 0.0,
            "tokens_per_s_per_gpu_range": (
                {
                    "low": self.throughput_range[0],
                    "high": self.throughput_range[1],
                    "coverage": 0.8,
                    "from_published_runs": self.throughput_range[2],
                }
                if self.throughput_range
                else None
            ),
            "tflops_per_gpu": self.tflops_per_gpu,
            "mfu": self.mfu,
            "bubble_fraction": self.bubble_fraction,
            "busiest_rank_bubble": self.busiest_bubble,
            "comm_exposed_fraction": self.comm_exposed_fraction,
            "comm": self.comm.to_json() if self.comm is not None else {},
        }


def estimate_memory(args: ModelArgs, layout: Layout, cluster: Cluster) -> Estimate:
    """The cheap half: memory only (the search drops what cannot fit before timing it)."""
    return Estimate(layout, memory_per_gpu(args, layout, cluster), cluster.gpu.hbm_gb * 1e9)


def estimate(
    args: ModelArgs, layout: Layout, cluster: Cluster, consts: Constants = Constants()
) -> Estimate:
    result = estimate_memory(args, layout, cluster)
    add_time(result, args, cluster, consts)
    return result


def add_time(result: Estimate, args: ModelArgs, cluster: Cluster, consts: Constants) -> None:
    """Fills the step time, bubble and communication of `result` (its layout must tile the
    global batch into micro-batches)."""
    layout = result.layout
    m = layout.microbatches
    shapes = rank_shapes(args, layout)
    times = [stage_times(args, layout, cluster, shape, consts.compute) for shape in shapes]
    busiest = max(range(len(shapes)), key=lambda i: times[i].total)
    shape, t = shapes[busiest], times[busiest]
    result.compute_s = m * t.total
    busiest_idle, result.bubble_fraction = _bubbles(layout, shapes, times, busiest)
    result.comm = comm_per_step(
        args,
        layout,
        cluster,
        consts.comm,
        layers_per_rank=shape.layers,
        moe_layers_per_rank=shape.moe_layers,
        dense_params_per_rank=shape.dense_params,
        expert_params_per_rank=shape.expert_params,
        forward_compute_s=m * t.forward,
        backward_compute_s=m * (t.backward + t.weight),
        attention_compute_s=0.0,
        overlap_compute_s=m * t.total * layout.paired_share,
        shared_forward_s=m * t.shared_forward,
        holds_head=shape.has_head,
    )
    in_stage = sum(getattr(result.comm, axis).exposed_seconds for axis in IN_STAGE)
    tail = sum(getattr(result.comm, axis).exposed_seconds for axis in DATA_PARALLEL)
    result.optimizer_s = optimizer_seconds(
        _updated_params(shape, layout), layout, cluster, consts.compute
    )
    # A collective that hides behind compute still takes its SMs from it (`kernels.py`).
    hidden = sum(
        getattr(result.comm, axis).seconds - getattr(result.comm, axis).exposed_seconds
        for axis in OVERLAPPED
    )
    contended = hidden * comm_sm_share(cluster.gpu.arch)
    stretched = (result.compute_s + contended + in_stage) / (1 - busiest_idle)
    working = result.compute_s + in_stage - result.comm.pp.exposed_seconds
    result.busiest_bubble = 1 - working / stretched if layout.pp > 1 else 0.0
    result.step_time_s = stretched + tail + result.optimizer_s
    result.model_flops_per_step = training_flops_per_token(args, layout.seq_len) * (
        layout.tokens_per_step
    )
    result.num_gpus = layout.world
    result.peak_flops = cluster.gpu.peak_tflops(layout.precision) * 1e12


def _updated_params(shape: RankShape, layout: Layout) -> float:
    """The parameters whose optimizer step this rank runs: its shard under ZeRO >= 1."""
    if layout.zero == 0:
        return shape.dense_params + shape.expert_params
    return shape.dense_params / (layout.dp * layout.cp) + shape.expert_params / max(
        layout.expert_dp, 1
    )


def _bubbles(
    layout: Layout, shapes: list[RankShape], times: list[StageTimes], busiest: int
) -> tuple[float, float]:
    """(the busiest rank's idle share of the pipeline's busy interval, the mean over the
    pipeline ranks: what the trainer's pipeline timer measures as the bubble).

    Stages differ: the first holds the embedding, the last the head and the MTP modules, and
    layers split unevenly. Under gpipe and 1f1b the busy interval is that of a flow shop with a
    bottleneck, sum of the ranks' micro-batch times + (m - 1) x the slowest's; with equal ranks
    it is the closed form (m + p - 1) t. The other schedules take their closed form on the
    busiest rank's F, B and W costs (`planner/bubble.py`), the others idling for the
    difference. Ranks between the second and the last are like the second."""
    p, m = layout.pp, layout.microbatches
    if p == 1:
        return 0.0, 0.0
    by_rank = {shape.rank: t.total for shape, t in zip(shapes, times, strict=True)}
    totals = [by_rank.get(r, by_rank[min(1, p - 1)]) for r in range(p - 1)] + [by_rank[p - 1]]
    slowest = times[busiest]
    if layout.schedule in ("gpipe", "1f1b"):
        interval = sum(totals) + (m - 1) * max(totals)
    else:
        v = stages_per_rank(layout.schedule, layout.virtual_stages)
        costs = Costs(slowest.forward / v, slowest.backward / v, slowest.weight / v)
        closed = theoretical_bubble(layout.schedule, p, m, v, costs)
        interval = m * slowest.total / (1 - closed)
    return 1 - m * slowest.total / interval, 1 - m * sum(totals) / p / interval
