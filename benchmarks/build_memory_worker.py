"""One rank of benchmarks/build_memory.py: build the model under the given layout by the new path
(meta -> parallelise -> materialise the local shards) or the old one (every rank materialises
the whole fp32 model, then FSDP2 shards it), and report this rank's peak RSS."""

import json
import resource
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from dstrain.config.flavors import resolve_model_args
from dstrain.config.load import load_config
from dstrain.model.transformer import build_model
from dstrain.parallel.distributed import World, shutdown
from dstrain.parallel.mesh import build_meshes
from dstrain.parallel.parallelize import parallelize_model
from dstrain.train.runtime import build_runtime, checked_dims


def rss_mb() -> float:
    statm = Path("/proc/self/statm").read_text().split()
    return int(statm[1]) * resource.getpagesize() / 2**20


def main() -> None:
    out, mode, overrides = Path(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    config = load_config(None, overrides).config
    dist.barrier()
    before = rss_mb()
    began = time.perf_counter()
    if mode == "new":
        runtime = build_runtime(config, World(rank, world, rank, torch.device("cpu"), "gloo"))
        model = runtime.model
    else:  # the old path, as the trainer ran it before meta construction
        args = resolve_model_args(config.model)
        dims = checked_dims(config, world, args)
        model = build_model(args, "cpu", seed=config.train.seed)
        model = parallelize_model(model, config, build_meshes(dims, "cpu"), device=None)
    seconds = time.perf_counter() - began
    local = sum(
        (p._local_tensor if hasattr(p, "_local_tensor") else p).numel() for p in model.parameters()
    )
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    result = {"before_mb": before, "peak_mb": peak, "seconds": seconds, "local_params": local}
    (out / f"{mode}_rank{rank}.json").write_text(json.dumps(result))
    shutdown(0)


if __name__ == "__main__":
    main()
