"""What one `bench comm` run measures: the ops, sizes, iterations and the group layout. Plain
Python (no torch), so the CLI checks every flag before any worker process exists."""

from dataclasses import dataclass

from dstrain.config.parallel_dims import ParallelDims
from dstrain.config.suggest import did_you_mean
from dstrain.errors import UserError

OP_NAMES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send_recv")
# nccl-tests' type names; the tensors are torch.float32 / torch.bfloat16.
DTYPES = ("float", "bfloat16")
# `dp` is dp_replicate x dp_shard flattened (ranks that see different data); `ep` is the expert
# axis folded over dp_shard x cp x tp (dstrain.parallel.mesh).
AXES = ("tp", "dp", "dp_shard", "dp_replicate", "ep", "pp")
# A pipeline axis only ever carries point-to-point traffic between consecutive stages.
PP_OPS = ("send_recv",)


@dataclass(frozen=True)
class CommSpec:
    ops: tuple[str, ...]
    sizes: tuple[int, ...]  # requested bytes per size (nccl-tests -b/-e/-f)
    dtype: str = "float"
    warmup: int | None = None  # None: 5, fewer for big sizes on CPU (timing.iterations)
    iters: int | None = None  # None: 20, fewer for big sizes on CPU
    axis: str | None = None  # None: every op on the whole world
    dims: ParallelDims | None = None  # the layout the axis comes from
    straggler_ratio: float = 1.2
    min_busbw: float | None = None  # GB/s, compared with each op's busbw at its largest size
    gemm: bool = True
    progress: bool = True


def parse_ops(text: str, axis: str | None = None) -> tuple[str, ...]:
    """'all' (every op; on the pp axis only send_recv) or a comma list of OP_NAMES."""
    if text.strip() == "all":
        return PP_OPS if axis == "pp" else OP_NAMES
    ops = tuple(dict.fromkeys(name.strip() for name in text.split(",") if name.strip()))
    for name in ops:
        if name not in OP_NAMES:
            raise UserError(
                f"--ops: unknown op `{name}`{did_you_mean(name, OP_NAMES)}",
                f"choose from {', '.join(OP_NAMES)} (comma-separated), or `all`",
            )
    if not ops:
        raise UserError("--ops is empty", f"choose from {', '.join(OP_NAMES)}, or `all`")
    return ops


def axis_size(dims: ParallelDims, axis: str) -> int:
    """The size of one group of `axis` (every group of an axis has the same size)."""
    return dims.dp if axis == "dp" else getattr(dims, axis)


def check_axis(dims: ParallelDims, axis: str) -> int:
    """The axis' group size for this layout; UserError when the layout is illegal for the world
    size or the axis has one rank (nothing to communicate)."""
    errors = [f for f in dims.validate() if f.severity == "error"]
    if errors:
        first = errors[0]
        raise UserError(f"{first.key}: {first.message}", first.fix, exit_code=1)
    size = axis_size(dims, axis)
    if size < 2:
        key = "dp_shard" if axis == "dp" else axis
        raise UserError(
            f"--axis {axis}: the {axis} axis has 1 rank in this layout ({dims.describe()}), so "
            "it carries no communication",
            f"give the layout a {axis} degree of 2 or more (e.g. --set parallel.{key}=2, with "
            "a world size it divides), or pick another --axis",
            exit_code=1,
        )
    return size
