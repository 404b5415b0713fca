"""Which ranks share each mesh axis, for a few layouts of 4 ranks; and how long a collective on
a sub-group waits for a peer that never joins, with the meshes' timeout set."""

import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from dstrain.config.parallel_dims import ParallelDims
from dstrain.parallel.mesh import build_meshes
from tests.distributed.harness import worker_main

LAYOUTS = {
    "dp_shard2_tp2": dict(dp_replicate=1, dp_shard=2, cp=1, tp=2, pp=1, ep=1),
    "dp_shard2_tp2_ep2": dict(dp_replicate=1, dp_shard=2, cp=1, tp=2, pp=1, ep=2),
    "hsdp2x2_ep2": dict(dp_replicate=2, dp_shard=2, cp=1, tp=1, pp=1, ep=2),
}


def groups(out_dir):
    result = {}
    for name, degrees in LAYOUTS.items():
        meshes = build_meshes(ParallelDims(**degrees, world_size=4), "cpu")
        result[name] = {
            axis: meshes[axis].mesh.flatten().tolist()
            for axis in ("dp", "dp_shard", "dp_replicate", "tp", "ep", "efsdp", "dp_shard_cp")
        }
    result["rank"] = dist.get_rank()
    result["stalled_ep_wait_s"] = _stalled_ep_wait()
    return result


def _stalled_ep_wait() -> float | None:
    """pp2 x dp2 x ep2 with a 2 s timeout: every group carries it; then ep rank 0 all-reduces
    over ep while its peer never joins (it sleeps well past the timeout). Seconds waited, on the
    ranks that waited."""
    dims = ParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=1, pp=2, ep=2, world_size=4)
    meshes = build_meshes(dims, "cpu", timedelta(seconds=2))
    ep = meshes["ep"]
    if ep.get_local_rank() == 1:
        time.sleep(12)
        return None
    started = time.perf_counter()
    try:
        dist.all_reduce(torch.ones(1), group=ep.get_group())
    except RuntimeError:
        return time.perf_counter() - started
    raise AssertionError("the all-reduce completed without its peer")


if __name__ == "__main__":
    sys.exit(worker_main(groups))
