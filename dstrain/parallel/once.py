"""Work one rank does for the ranks that share its file system: tokenizing into the data cache.

With `scope = "shared"` (a cache every node sees) global rank 0 builds; with `"node"` (a
node-local disk) local rank 0 of each node does. Every other rank waits for its builder, then
calls the same function, which finds the finished cache and only maps it; so nothing races in
the cache and N ranks do not tokenize the same corpus N times.

The wait is an all_gather of each builder's outcome on a gloo group of its own, with a timeout
of days: tokenizing a large corpus can outlast the process group's timeout by hours, and a
CPU group needs no GPU memory. (Not a file lock: flock is unreliable on NFS and Lustre, where
shared caches live.) A builder's bad input (a UserError) reaches its waiters, which raise the
same message; any other failure makes them stop too, naming the builder.
"""

from collections.abc import Callable
from datetime import timedelta
from typing import TypeVar

import torch.distributed as dist

from dstrain.errors import UserError
from dstrain.parallel.distributed import World

T = TypeVar("T")
WAIT_TIMEOUT = timedelta(days=3)


def builder_of(world: World, scope: str) -> int:
    """The global rank that builds for `world.rank` (torchrun numbers each node's ranks
    contiguously, so a node's local rank 0 is `rank - local_rank`)."""
    return 0 if scope == "shared" else world.rank - world.local_rank


def once_per_cache(world: World, scope: str, build: Callable[[], T]) -> T:
    """`build()` on the builder first, then on the ranks that wait for it."""
    if world.backend is None or world.world_size == 1 or world.backend == "fake":
        return build()
    builder = builder_of(world, scope)
    group = dist.new_group(backend="gloo", timeout=WAIT_TIMEOUT)
    try:
        outcome: tuple | None = None
        failure: BaseException | None = None
        if world.rank == builder:
            try:
                result = build()
            except UserError as exc:
                failure, outcome = exc, ("bad input", exc.message, exc.fix, exc.exit_code)
            except BaseException as exc:  # told to the waiters, then raised here
                failure, outcome = exc, ("failed", f"{type(exc).__name__}: {exc}")
            else:
                outcome = ("ok",)
        outcomes: list[tuple | None] = [None] * world.world_size
        dist.all_gather_object(outcomes, outcome, group=group)
    finally:
        dist.destroy_process_group(group)
    if failure is not None:
        raise failure
    if world.rank == builder:
        return result
    told = outcomes[builder]
    if told is not None and told[0] == "bad input":
        raise UserError(told[1], told[2], told[3])
    if told is None or told[0] != "ok":
        detail = told[1] if told is not None else "no outcome"
        raise UserError(
            f"rank {builder}, which prepares the data for this rank, failed ({detail})",
            f"see rank {builder}'s log above for the cause",
            exit_code=1,
        )
    return build()
