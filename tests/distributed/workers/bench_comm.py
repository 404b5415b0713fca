"""`bench comm` on 4 ranks, one launch: every op on the world (n=4), then on the tp axis of a
dp_shard 2 x tp 2 layout (two groups of n=2 at once), and send_recv on the pp axis of pp 2 x
dp_shard 2. Rank 0 returns the three reports."""

import sys

import torch
import torch.distributed as dist

from dstrain.bench.comm import run_comm
from dstrain.bench.spec import OP_NAMES, PP_OPS, CommSpec
from dstrain.config.parallel_dims import ParallelDims
from dstrain.parallel.distributed import World
from tests.distributed.harness import worker_main

SIZES = (1024, 8192, 65536)


def _dims(**degrees) -> ParallelDims:
    base = dict(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1)
    return ParallelDims(**(base | degrees), world_size=4)


def reports(out_dir):
    world = World(dist.get_rank(), 4, dist.get_rank(), torch.device("cpu"), "gloo")
    common = dict(sizes=SIZES, warmup=1, iters=3, progress=False)
    specs = {
        "world": CommSpec(ops=OP_NAMES, **common),
        "tp": CommSpec(ops=OP_NAMES, axis="tp", dims=_dims(dp_shard=2, tp=2), gemm=False, **common),
        "pp": CommSpec(ops=PP_OPS, axis="pp", dims=_dims(dp_shard=2, pp=2), gemm=False, **common),
        "bf16": CommSpec(ops=("all_reduce", "reduce_scatter"), dtype="bfloat16", gemm=False,
                         min_busbw=1e6, **common),
    }  # fmt: skip
    return {name: run_comm(spec, world) for name, spec in specs.items()}


if __name__ == "__main__":
    sys.exit(worker_main(reports))
