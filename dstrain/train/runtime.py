"""The parallel runtime of one rank: degrees, meshes, batch plan, the model (built on `meta`,
parallelised or carved into pipeline stages, then materialised) and its optimizer.

One builder for both the Trainer and the dry run (`dry_run.py`), so a dry run on torch's fake
process group builds exactly what training builds, only left on `meta`.
"""

from dataclasses import dataclass
from datetime import timedelta

import torch

from dstrain.config.batch import BatchPlan, run_batch
from dstrain.config.flavors import resolve_model_args
from dstrain.config.model_args import ModelArgs
from dstrain.config.parallel_dims import ParallelDims
from dstrain.config.schema import DstrainConfig
from dstrain.config.validate import raise_if_errors
from dstrain.model.hf_load import HFCheckpoint
from dstrain.model.hf_load import check as check_checkpoint
from dstrain.model.transformer import build_model
from dstrain.parallel.distributed import World
from dstrain.parallel.mesh import Meshes, build_meshes
from dstrain.parallel.parallelize import parallelize_model
from dstrain.parallel.pipeline import Pipeline, build_pipeline
from dstrain.preflight.rules import CheckTarget, run_rules
from dstrain.train.optim import build_optimizer
from dstrain.train.step import DataParallel


@dataclass
class Runtime:
    model_args: ModelArgs
    dims: ParallelDims
    meshes: Meshes | None  # None: one process, no process group
    dp: DataParallel
    batch: BatchPlan
    model: torch.nn.Module  # under PP, this rank's stages seen as one module
    pipeline: Pipeline | None
    optimizer: torch.optim.Optimizer
    weights: HFCheckpoint | None = None  # where the initial weights came from (init_from)


def build_runtime(
    config: DstrainConfig, world: World, *, materialize: bool = True, init_from: bool = True
) -> Runtime:
    """Everything that depends on the layout, in dependency order. `materialize=False` (a dry
    run) leaves the parameters on `meta`; `init_from=False` (a resume, whose checkpoint brings
    the weights) draws them instead of reading `model.init_from`."""
    args = resolve_model_args(config.model)
    dims = checked_dims(config, world.world_size, args)
    meshes = _meshes(config, world, dims)
    dp = _data_parallel(config, dims, meshes)
    batch = _batch(config, dims)
    device = world.device if materialize else None
    weights = initial_weights(config, args) if materialize and init_from else None
    model, pipeline = _model(config, args, dims, meshes, batch, device, weights)
    if weights is not None:
        weights.close()
    optimizer = build_optimizer(model, config.optim, config.train.precision)
    return Runtime(args, dims, meshes, dp, batch, model, pipeline, optimizer, weights)


def _meshes(config: DstrainConfig, world: World, dims: ParallelDims) -> Meshes | None:
    """None in one process. The dry run's fake groups keep torch's timeouts (they never wait)."""
    if world.backend is None:
        return None
    real = world.backend in ("gloo", "nccl")
    timeout = timedelta(seconds=config.comm.timeout_s) if real else None
    return build_meshes(dims, _mesh_device(world), timeout)


def initial_weights(config: DstrainConfig, args: ModelArgs) -> HFCheckpoint | None:
    """`model.init_from`'s checkpoint, its tensors checked against the architecture (a missing,
    extra or mis-shaped one is an error naming it) before anything is allocated."""
    if config.model.init_from is None:
        return None
    checkpoint = HFCheckpoint(config.model.init_from)
    check_checkpoint(checkpoint, args)
    return checkpoint


def checked_dims(config: DstrainConfig, world_size: int, args: ModelArgs) -> ParallelDims:
    """The degrees, after the rules of `dstrain check` (the CLI ran them already; a runtime built
    in code runs them here): nothing the check accepts is refused later, nothing it refuses
    starts."""
    dims = ParallelDims.of(config.parallel, world_size)
    raise_if_errors(dims.validate())
    target = CheckTarget(config, world_size, args, None)
    raise_if_errors([f for f in run_rules(target) if f.key != "data.source"])
    return dims


def _mesh_device(world: World) -> str:
    # The fake backend of a dry run serves any device type; meshes of a run use the run's.
    return "cpu" if world.device.type == "meta" else world.device.type


def _data_parallel(
    config: DstrainConfig, dims: ParallelDims, meshes: Meshes | None
) -> DataParallel:
    """The ranks whose target tokens differ: the data-parallel ones, times the context-parallel
    ones (which hold other parts of the same sequences)."""
    if meshes is None or dims.dp * dims.cp == 1:
        return DataParallel()
    zero1 = config.parallel.zero_stage == 1
    mesh = meshes["dp_cp"] if dims.cp > 1 else meshes["dp"]
    return DataParallel(mesh.get_group(), dims.dp * dims.cp, defer_sync=zero1)


def _batch(config: DstrainConfig, dims: ParallelDims) -> BatchPlan:
    plan, findings = run_batch(config, dims.dp)
    raise_if_errors(findings)
    assert plan is not None
    return plan


def _model(
    config: DstrainConfig,
    args: ModelArgs,
    dims: ParallelDims,
    meshes: Meshes | None,
    batch: BatchPlan,
    device: torch.device | None,
    weights: HFCheckpoint | None,
) -> tuple[torch.nn.Module, Pipeline | None]:
    """Built on `meta`, parallelised (or carved into stages), and only then materialised: a rank
    allocates its own shards, never the whole model; the layout-invariant initialiser gives the
    weights of a one-process run with the same seed."""
    model = build_model(args, device=None)
    if dims.pp == 1:
        return parallelize_model(model, config, meshes, device=device, weights=weights), None
    pipeline = build_pipeline(
        model,
        config,
        meshes,
        microbatches=batch.grad_accum_steps,
        device=device,
        weights=weights,
    )
    return pipeline.model, pipeline
