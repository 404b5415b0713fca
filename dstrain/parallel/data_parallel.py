"""Data parallelism and ZeRO on the `dp` axes.

| zero_stage | what | upstream piece |
|---|---|---|
| 0 | DDP: gradients all-reduced in backward | `DistributedDataParallel` |
| 1 | sharded fp32 master weights and optimizer states | FSDP2, no resharding after forward, |
|   | weights gathered once per step; gradients  | gradient sync and resharding deferred to the |
|   | accumulated unsharded, reduced once        | last micro-batch (`grad_sync` in train/step) |
| 2 | as 1, plus sharded gradients, reduced (and | `fully_shard(reshard_after_forward=False)` |
|   | weights gathered) every micro-batch        | |
| 3 | as 2, plus weights resharded after forward | `fully_shard(reshard_after_forward=True)` |

ZeRO-1 as Megatron's distributed optimizer and DeepSeek-V3 run it, built from FSDP2's primitives
rather than `ZeroRedundancyOptimizer`, which cannot checkpoint through DCP (its state dict first
gathers everything on one rank) and does not know expert parallelism. Per parameter in bf16: 2
bytes of gathered weights, 4 of accumulated fp32 gradients, 12 / dp of fp32 master weights and
Adam moments: Megatron's figures. Between steps FSDP2 frees the gathered weights (it gathers them
again, prefetched, at the next forward), and the sharded parameters and optimizer states are
DTensors, so DCP saves and reshards them like every other layout. Under pipeline parallelism
upstream's stages already defer the sync to the last micro-batch, so ZeRO-1 and ZeRO-2 run alike.

FSDP2 shards each transformer block and then the root (embedding, norm, head). With
dp_replicate > 1 the mesh is 2-D (replicate, shard): HSDP, gradients reduce-scattered within a
shard group and all-reduced across replicas. Optimizer offload is FSDP2's `CPUOffloadPolicy`.
Expert-parallel experts get an FSDP2 of their own over the ranks holding the same experts.
"""

import inspect
import warnings

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from dstrain.config.schema import CommConfig
from dstrain.errors import UserError
from dstrain.model.transformer import Transformer


def mixed_precision(param_dtype: torch.dtype | None) -> MixedPrecisionPolicy:
    """FSDP2's policy: weights gathered in `param_dtype` (None: as stored), gradients reduced
    and accumulated across micro-batches in fp32, as Megatron's and DeepSeek-V3's are (a bf16
    weight's gradient, FP8's wgrad included, is rounded to bf16 once per micro-batch first:
    `tests/unit/test_fp8_accumulation.py`)."""
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)


def apply_fsdp(
    model: Transformer,
    mesh: DeviceMesh,
    *,
    reshard_after_forward: bool,
    param_dtype: torch.dtype | None,
    offload: bool,
    ignored: set[nn.Parameter] | None = None,
) -> None:
    """FSDP2 per block, then the root. `mesh` is 1-D (shard) or 2-D (replicate, shard).
    `ignored` parameters (expert-parallel experts) stay as they are."""
    policy = mixed_precision(param_dtype)
    # Pinned host memory serves copies to an accelerator; a CPU run keeps pageable memory (its
    # mesh is on the CPU even on a machine that has GPUs).
    pinned = mesh.device_type == "cuda"
    offload_policy = CPUOffloadPolicy(pin_memory=pinned) if offload else None
    kwargs = dict(
        mesh=mesh,
        mp_policy=policy,
        reshard_after_forward=reshard_after_forward,
        ignored_params=ignored or None,
    )
    if offload_policy is not None:
        kwargs["offload_policy"] = offload_policy
    for block in _blocks(model):
        fully_shard(block, **kwargs)
    # The root's parameters (embedding, final norm, head) are used last in forward and first in
    # backward: keeping them unsharded after forward saves one all-gather per step.
    fully_shard(model, **{**kwargs, "reshard_after_forward": False})


def apply_fsdp_experts(
    experts: list[nn.Module],
    mesh: DeviceMesh,
    *,
    reshard_after_forward: bool,
    param_dtype: torch.dtype | None,
) -> None:
    """ZeRO for expert-parallel experts: FSDP2 over the ranks holding the same experts (`mesh`:
    efsdp, or (dp_replicate, efsdp)), giving 2-D (efsdp, ep) parameters as torchtitan does.
    Reduce-scatter averages their gradients over `mesh`; the trainer rescales them afterwards
    (`set_gradient_divide_factor` would need PREMUL_SUM, which gloo lacks)."""
    policy = mixed_precision(param_dtype)
    # The experts' output is a view of the combine all-to-all's; FSDP2 warns that an in-place op
    # on it would skip its backward hook. The MoE only uses it out of place.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDPExpertParallel")
    for module in experts:
        fully_shard(
            module, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward
        )


def apply_ddp(
    model: nn.Module, mesh: DeviceMesh, comm: CommConfig, ignored: list[str] | None = None
) -> DistributedDataParallel:
    """Plain DDP over `mesh` (1-D, every data-parallel rank), with an optional compression hook.
    `ignored` parameter names (expert-parallel experts) are left out of its all-reduce."""
    if ignored:
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ignored)
    device = next(model.parameters()).device  # the model's, not whatever the machine has
    ddp = DistributedDataParallel(
        model,
        process_group=mesh.get_group(),
        device_ids=[device.index] if device.type == "cuda" else None,
        # PowerSGD chains several collectives per bucket inside future callbacks; with more
        # than one bucket in flight, gloo ranks can issue them in different orders ("Received
        # data size doesn't match expected size"). One bucket keeps them in order.
        bucket_cap_mb=10_000 if comm.compression == "powersgd" else 25,
        # Gradients live in the buckets rather than beside them: one copy, not two.
        gradient_as_bucket_view=True,
        **_NO_BUFFER_SYNC,
    )
    _register_compression(ddp, mesh, comm)
    return ddp


# Buffers (MoE biases) are updated identically on every rank from all-reduced loads; torch 2.13
# renamed the switch.
_NO_BUFFER_SYNC = (
    {"forward_sync_buffers": False}
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
    else {"broadcast_buffers": False}
)


def _register_compression(ddp: DistributedDataParallel, mesh: DeviceMesh, comm: CommConfig) -> None:
    group = mesh.get_group()
    if comm.compression == "bf16":
        if mesh.device_type != "cuda":
            raise UserError(
                "comm.compression = bf16 needs NCCL on CUDA GPUs (upstream's bf16 hook)",
                "use comm.compression = fp16 on CPU hosts",
                exit_code=1,
            )
        ddp.register_comm_hook(group, default_hooks.bf16_compress_hook)
    elif comm.compression == "fp16":
        ddp.register_comm_hook(group, default_hooks.fp16_compress_hook)
    elif comm.compression == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=group,
            matrix_approximation_rank=comm.powersgd_rank,
            start_powerSGD_iter=comm.powersgd_start_iter,  # > 1: error feedback needs warm-up
            use_error_feedback=True,
            warm_start=True,
        )
        # The per-tensor hook: batched_powerSGD_hook asserts on 2-D input in torch 2.13.
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)


def _blocks(model: Transformer) -> list[nn.Module]:
    blocks = list(model.layers.values())
    if model.mtp is not None:
        blocks += [module.block for module in model.mtp.values()]
    return blocks
