"""parallelize_model: the one place that turns the single-device model into the one that trains.

Fixed order (torchtitan's), each step for a reason:
0. context parallelism (parallel.cp): the model runs on this rank's part of each sequence;
   FP8 conversion (train.precision = fp8): it swaps the classes of the linears that TP's styles
   and FSDP then wrap, and under TP gives the sharded ones their local-shard forward;
1. tensor parallelism first: it changes module shapes and placements (and, with
   parallel.moe_tp = split_tokens, gives each MoE its tp rank's share of the tokens);
2. expert parallelism: it replaces the experts' forward with dispatch/combine;
3. activation checkpointing: it must wrap the already-sharded modules;
4. torch.compile per block: it must see the final modules;
5. FSDP2 (ZeRO-1/2/3): it shards whatever parameters the steps above left;
6. materialisation: the model was built on `meta`; now each rank allocates and initialises only
   the shards it holds (`materialize.py`);
7. DDP last: it wraps a finished model with real tensors.
"""

import torch
from torch import nn

from dstrain.config.parallel_dims import ParallelDims
from dstrain.config.schema import V_SHAPED, DstrainConfig
from dstrain.model.fp8 import choose_backend
from dstrain.model.fp8_linear import apply_fp8
from dstrain.model.hf_load import HFCheckpoint
from dstrain.model.transformer import Transformer
from dstrain.parallel.activation_checkpoint import apply_ac
from dstrain.parallel.context_parallel import apply_context_parallel, context_shard
from dstrain.parallel.data_parallel import apply_ddp, apply_fsdp, apply_fsdp_experts
from dstrain.parallel.expert_parallel import ExpertParallelExperts, apply_ep, expert_parameters
from dstrain.parallel.fp8_tp import apply_fp8_tp
from dstrain.parallel.materialize import materialize
from dstrain.parallel.mesh import Meshes
from dstrain.parallel.moe_tokens import apply_token_split
from dstrain.parallel.tensor_parallel import apply_tp


def parallelize_model(
    model: Transformer,
    config: DstrainConfig,
    meshes: Meshes | None = None,
    *,
    device: torch.device | None,
    weights: HFCheckpoint | None = None,
) -> nn.Module:
    """Apply every configured parallelism in order to `model` (built on `meta`), then
    materialise this rank's shards on `device` (from `weights`, a Hugging Face checkpoint, when
    given). `device=None` leaves the parameters as they are: on meta for a dry run, or a model
    that was materialised already. Returns the module to train (DDP wraps)."""
    dims = meshes.dims if meshes is not None else None
    if dims is not None and dims.cp > 1:
        apply_context_parallel(model, context_shard(meshes))
    if config.train.precision == "fp8":
        apply_fp8(model, choose_backend(config.train.fp8_backend, device))
    if dims is not None and dims.tp > 1:
        apply_tp(model, meshes["tp"], sequence_parallel=config.parallel.sequence_parallel)
        apply_fp8_tp(model)
        if config.parallel.moe_tp == "split_tokens":
            apply_token_split(model, meshes["tp"])
    if dims is not None and dims.ep > 1:
        apply_ep(model, meshes["ep"], overlap_shared=config.parallel.ep_overlap)
    split = config.parallel.pp > 1 and config.parallel.pp_schedule in V_SHAPED
    apply_ac(model, mode=config.train.activation_checkpoint, split_backward=split)
    if config.train.compile:
        apply_compile(model)
    data_parallel = dims is not None and dims.dp * dims.cp > 1
    if data_parallel and config.parallel.zero_stage >= 1:
        _apply_fsdp(model, config, meshes)
    if device is not None:
        materialize(model, device, config.train.seed, weights)
    if data_parallel and config.parallel.zero_stage == 0:
        if any(param.is_meta for param in model.parameters()):
            return model  # a dry run: DDP needs real tensors (the dry run counts its buckets)
        experts = [name for name, _ in expert_parameters(model)]
        mesh = meshes["dp_cp"] if dims.cp > 1 else meshes["dp"]
        return apply_ddp(model, mesh, config.comm, ignored=experts)
    return model


def _apply_fsdp(model: Transformer, config: DstrainConfig, meshes: Meshes) -> None:
    """FSDP2 over the dp axes (ZeRO-1/2/3). Expert-parallel experts get FSDP2 of their own over
    the ranks that hold the same experts, or (with offload) stay outside it and have their
    gradients reduced by `reduce_expert_grads`."""
    p, dims = config.parallel, meshes.dims
    experts = dict(expert_parameters(model))
    param_dtype = torch.bfloat16 if config.train.precision in ("bf16", "fp8") else None
    if experts_use_fsdp(config, dims):
        emesh = meshes.sparse["dp_replicate", "efsdp"] if dims.dp_replicate > 1 else meshes["efsdp"]
        apply_fsdp_experts(
            [m for m in model.modules() if isinstance(m, ExpertParallelExperts)],
            emesh,
            reshard_after_forward=p.zero_stage == 3,
            param_dtype=param_dtype,
        )
        experts = {}  # now FSDP-managed: the blocks' fully_shard skips them
    # Context-parallel ranks shard the weights with dp_shard (torchtitan's dp_shard_cp).
    apply_fsdp(
        model,
        meshes.fsdp(),
        reshard_after_forward=p.zero_stage == 3,
        param_dtype=param_dtype,
        offload=p.offload_optimizer or p.offload_params,
        ignored=set(experts.values()),
    )


def experts_use_fsdp(config: DstrainConfig, dims: ParallelDims) -> bool:
    """Experts are ZeRO-sharded over the ranks holding the same experts when FSDP is on and
    there is more than one such rank (without offload, which FSDP2 applies per module)."""
    p = config.parallel
    return (
        dims.ep > 1
        and dims.dp > 1
        and p.zero_stage >= 1
        and dims.efsdp * dims.dp_replicate > 1
        and not (p.offload_optimizer or p.offload_params)
    )


def apply_compile(model: Transformer) -> None:
    """Compile each block separately: small graphs compile fast, are reused by identical blocks,
    and leave FSDP's per-block hooks outside the graph."""
    for name, block in model.layers.named_children():
        model.layers.register_module(name, torch.compile(block, fullgraph=False))
