"""How a model's layers fall into pipeline stages and stages onto ranks: pure Python, shared by
the trainer (`parallel/pipeline.py`, which builds the stages) and the planner (which costs them).
"""

from dstrain.config.model_args import ModelArgs
from dstrain.config.schema import V_SHAPED
from dstrain.errors import UserError
from dstrain.model.flops import stage_forward_flops_per_token


def stage_indices(schedule: str, pp: int, virtual_stages: int, rank: int) -> list[int]:
    """The stages pp rank `rank` holds, in the order its chunks are built."""
    if schedule in V_SHAPED:
        return [rank, 2 * pp - 1 - rank]
    return [rank + k * pp for k in range(virtual_stages)]


def split_layers(num_layers: int, num_stages: int, first_less: int, last_less: int) -> list[range]:
    """Consecutive layer ids per stage: equal shares of num_layers + first_less + last_less, the
    first stage `first_less` short and the last `last_less` short (the same rule as `check`)."""
    total = num_layers + first_less + last_less
    per = total // num_stages
    sizes = [per] * num_stages
    sizes[0] -= first_less
    sizes[-1] -= last_less
    if total % num_stages or min(sizes) < 0:
        raise UserError(
            f"{num_layers} layers (+{first_less} first, +{last_less} last trimmed) do not split "
            f"evenly over {num_stages} pipeline stages",
            "run `dstrain check` on the config: it proposes pp_first/last_stage_less_layers",
            exit_code=1,
        )
    starts = [sum(sizes[:i]) for i in range(num_stages)]
    return [range(start, start + size) for start, size in zip(starts, sizes, strict=True)]


def balanced_split(args: ModelArgs, seq_len: int, schedule: str, pp: int, v: int) -> list[range]:
    """The default split: of every legal (first, last) trimming, the one whose busiest pp rank
    has the fewest forward FLOPs (the last stage also runs the head and the MTP modules; under
    V-shaped schedules rank 0 holds both ends), and then the least trimming. Every stage keeps
    at least one block where some split allows it; otherwise an end stage may hold none (as
    `check` allows: DeepSeek-V3's 61 layers over 32 DualPipeV stages leave the last stage the
    head and MTP alone). With no split at all (fewer layers than stages) `check` has refused."""
    for min_blocks in (1, 0):
        chosen = _least_busy_split(args, seq_len, schedule, pp, v, min_blocks)
        if chosen:
            return chosen
    return []


def _least_busy_split(
    args: ModelArgs, seq_len: int, schedule: str, pp: int, v: int, min_blocks: int
) -> list[range]:
    num_stages, num_layers = pp * v, args.num_layers
    best: tuple[float, int] | None = None
    chosen: list[range] = []
    for first in range(num_layers + 1):
        for last in range(num_layers + 1):
            total = num_layers + first + last
            per = total // num_stages
            if total % num_stages or per - max(first, last) < min_blocks:
                continue  # uneven, or an end stage with too few blocks
            split = split_layers(num_layers, num_stages, first, last)
            cost = [
                stage_forward_flops_per_token(args, seq_len, split[s], last=s == num_stages - 1)
                for s in range(num_stages)
            ]
            busiest = max(
                sum(cost[s] for s in stage_indices(schedule, pp, v, rank)) for rank in range(pp)
            )
            if best is None or (busiest, first + last) < best:
                best, chosen = (busiest, first + last), split
    return chosen
