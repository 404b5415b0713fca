"""Bytes of model states one rank holds during a step, counted from its runtime: every parameter's
local shard as the layout left it (a DTensor's local tensor under TP, EP and FSDP2), plus what
the ZeRO stage and precision make the step allocate around it.

Per parameter, with P_local its local shard and P_gathered what FSDP2 all-gathers (the shard
before FSDP: TP/EP-local), mixed precision meaning bf16 compute weights:

    stage                        weights                    gradients
    ZeRO-0 (DDP, or no dp)       4 P_local                  4 P_local
    ZeRO-1 (ZeRO-2 under PP)     4 P_local + w P_gathered   4 P_gathered
    ZeRO-2                       4 P_local + w P_gathered   4 P_local
    ZeRO-3                       4 P_local                  4 P_local   (+ one block in flight)
    optimizer                    Adam: 8 P_local (two fp32 moments; 4 with optim.moments bf16);
                                 SGD: 4 P_local

w = 2 under bf16 (FSDP2's param_dtype), else 4. FSDP2 keeps the gathered weights from the first
forward to the last backward when it does not reshard after forward, and accumulates unsharded
gradients in fp32 (its reduce dtype) while the sync is deferred (ZeRO-1: Megatron's fp32 main
gradients; DeepSeek-V3 also keeps gradients in fp32, report sec. 3.3.3). DDP's gradients are
views into its buckets (`gradient_as_bucket_view`). Offload keeps FSDP2's sharded weights,
gradients and the optimizer in host memory (`host_bytes`).
"""

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from dstrain.config.schema import DstrainConfig

FP32 = 4
# Mesh axes FSDP2 shards or replicates over (the others are TP and EP, which the model keeps).
FSDP_AXES = frozenset({"dp_replicate", "dp_shard", "efsdp", "dp", "dp_shard_cp"})


@dataclass
class StateBytes:
    """Bytes by kind, each split into dense and (routed) expert parameters."""

    params: dict[str, float] = field(default_factory=lambda: {"dense": 0.0, "expert": 0.0})
    grads: dict[str, float] = field(default_factory=lambda: {"dense": 0.0, "expert": 0.0})
    optimizer: dict[str, float] = field(default_factory=lambda: {"dense": 0.0, "expert": 0.0})
    host: float = 0.0  # offloaded to the CPU

    @property
    def total(self) -> float:
        return sum(sum(part.values()) for part in (self.params, self.grads, self.optimizer))


def state_bytes(model: nn.Module, config: DstrainConfig, pp: int) -> StateBytes:
    """Model states of `model` (this rank's module, on meta or materialised) under `config`."""
    p = config.parallel
    offload = p.offload_optimizer or p.offload_params
    gathered_width = 2 if config.train.precision in ("bf16", "fp8") else FP32
    moments = 1 if config.optim.name == "sgd" else 2
    # bytes per moment element: bf16 moments (optim.moments) take 2 of fp32's 4
    moment_width = 2 if config.optim.moments_dtype(config.train.precision) == "bf16" else FP32
    if config.optim.name == "sgd":
        moment_width = FP32  # SGD's momentum is torch's, fp32
    out = StateBytes()
    for name, param in model.named_parameters():
        kind = "expert" if _is_routed_expert(name) else "dense"
        local = _local_numel(param)
        sharded = _fsdp_sharded(param)
        gathered = _gathered_numel(param) if sharded else local
        keeps_gathered = sharded and p.zero_stage in (1, 2)
        defers_sync = sharded and (p.zero_stage == 1 or (p.zero_stage == 2 and pp > 1))
        device_params = gathered_width * gathered if keeps_gathered else 0
        host_side = local * (FP32 + moment_width * moments) if sharded and offload else 0
        if host_side:
            out.host += host_side
        else:
            device_params += FP32 * local
            out.optimizer[kind] += moment_width * moments * local
        out.params[kind] += device_params
        grad = FP32 * (gathered if defers_sync else local)
        if not (sharded and offload):
            out.grads[kind] += grad
    return out


def _is_routed_expert(name: str) -> bool:
    return ".experts." in name and "shared_experts" not in name


def _local_numel(param: torch.Tensor) -> int:
    return param._local_tensor.numel() if isinstance(param, DTensor) else param.numel()


def _fsdp_sharded(param: torch.Tensor) -> bool:
    if not isinstance(param, DTensor):
        return False
    names = param.device_mesh.mesh_dim_names or ()
    return any(n in FSDP_AXES for n in names)


def _gathered_numel(param: DTensor) -> int:
    """Elements after FSDP2's all-gather: the placements on the FSDP axes become Replicate."""
    names = param.device_mesh.mesh_dim_names or ()
    placements = [
        Replicate() if name in FSDP_AXES else placement
        for name, placement in zip(names, param.placements, strict=True)
    ]
    shape, _ = compute_local_shape_and_global_offset(param.shape, param.device_mesh, placements)
    return int(torch.Size(shape).numel())
