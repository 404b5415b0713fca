"""`once_per_cache` on 4 gloo ranks posing as 2 nodes of 2 (local rank = rank % 2).

Each case's build writes a marker after a pause on the builder; a waiter records whether its
builder's marker was there when its own build ran (it must be). A builder's UserError must reach
every rank as the same message. argv: OUT_DIR.
"""

import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from dstrain.errors import UserError
from dstrain.parallel.distributed import World
from dstrain.parallel.once import builder_of, once_per_cache
from tests.distributed.harness import worker_main


def cases(out_dir: Path) -> dict:
    rank = dist.get_rank()
    world = World(rank, dist.get_world_size(), rank % 2, torch.device("cpu"), "gloo")
    result = {}
    for scope in ("shared", "node"):
        builder = builder_of(world, scope)
        marker = out_dir / f"{scope}-built-by-{builder}"

        def build(scope=scope, builder=builder, marker=marker):
            if rank == builder:
                time.sleep(1.0)  # the waiters must not run ahead meanwhile
                marker.write_text(str(rank))
                return {"built": True}
            return {"built": False, "saw_marker": marker.exists()}

        result[scope] = {"builder": builder, **once_per_cache(world, scope, build)}

    def bad():
        if rank == 0:
            raise UserError("data.source x.jsonl:3: malformed JSON", "fix the line", exit_code=1)
        return "should not run"

    try:
        once_per_cache(world, "shared", bad)
        result["bad"] = None
    except UserError as exc:
        result["bad"] = [exc.message, exc.fix, exc.exit_code]
    return result


if __name__ == "__main__":
    sys.exit(worker_main(cases))
