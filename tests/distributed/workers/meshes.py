"""Which ranks share each mesh axis, for a few layouts of 4 ranks."""

import sys

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
    return result


if __name__ == "__main__":
    sys.exit(worker_main(groups))
