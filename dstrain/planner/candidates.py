"""The layouts the search tries: every combination of degrees that tiles the cluster and of the
knobs that trade memory for time. The trainer's rules (`planner/legal.py`) then decide which are
legal; this module only avoids generating combinations that cannot even tile the world.

Degrees: tp within a node (a power of two up to the node size: tensor parallelism across nodes
is never worth its per-layer all-reduces), pp a power of two up to the layer count, dp what is
left, ep a power of two dividing the routed experts and dp x tp. Knobs: ZeRO 0-3, micro-batch
1-8, every schedule (interleaved with 2 virtual stages), recompute none/selective/full; sequence
parallelism whenever tp > 1 (it only saves memory at the same communication volume); cp as
given (`plan --cp`, 1 by default: splitting sequences is the answer to a sequence too long for
one rank, which the user knows, not a speed knob); no offload unless asked.
"""

from collections.abc import Iterator

from dstrain.config.model_args import ModelArgs
from dstrain.planner.bubble import SCHEDULES
from dstrain.planner.layout import RECOMPUTE, Cluster, Layout

MICRO_BATCHES = (1, 2, 4, 8)


def candidates(
    args: ModelArgs, cluster: Cluster, base: Layout, fixed: set[str]
) -> Iterator[Layout]:
    """Layouts for `cluster`, keeping the fields named in `fixed` as `base` has them."""
    world = cluster.num_gpus
    for tp in _choices("tp", base, fixed, _powers_of_two(min(cluster.gpus_per_node, world))):
        for pp in _choices("pp", base, fixed, _powers_of_two(min(args.num_layers, world))):
            if world % (tp * pp * base.cp):
                continue
            dp = world // (tp * pp * base.cp)
            if "dp" in fixed and dp != base.dp:
                continue
            for ep in _choices("ep", base, fixed, _expert_degrees(args, dp * tp * base.cp)):
                yield from _knobs(base.with_(dp=dp, tp=tp, pp=pp, ep=ep), fixed)


def _knobs(layout: Layout, fixed: set[str]) -> Iterator[Layout]:
    schedules = SCHEDULES if layout.pp > 1 else ("1f1b",)
    for zero in _choices("zero", layout, fixed, (0, 1, 2, 3)):
        for mb in _choices("micro_batch", layout, fixed, MICRO_BATCHES):
            if layout.global_batch % (layout.dp * mb):
                continue
            for schedule in _choices("schedule", layout, fixed, schedules):
                virtual = 2 if schedule == "interleaved-1f1b" else 1
                if "virtual_stages" in fixed:
                    virtual = layout.virtual_stages
                for recompute in _choices("recompute", layout, fixed, RECOMPUTE):
                    sp = layout.sequence_parallel if "sequence_parallel" in fixed else layout.tp > 1
                    yield layout.with_(
                        zero=zero,
                        micro_batch=mb,
                        schedule=schedule,
                        virtual_stages=virtual,
                        recompute=recompute,
                        sequence_parallel=sp,
                    )


def _choices(field: str, base: Layout, fixed: set[str], options) -> tuple:
    return (getattr(base, field),) if field in fixed else tuple(options)


def _powers_of_two(limit: int) -> list[int]:
    values, n = [], 1
    while n <= limit:
        values.append(n)
        n *= 2
    return values


def _expert_degrees(args: ModelArgs, span: int) -> list[int]:
    if args.num_routed_experts == 0:
        return [1]
    return [
        ep
        for ep in _powers_of_two(min(args.num_routed_experts, span))
        if args.num_routed_experts % ep == 0 and span % ep == 0
    ]
