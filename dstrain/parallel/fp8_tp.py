"""FP8 linears under tensor parallelism: the blockwise GEMM on each rank's shards.

DTensor has no sharding rule for our FP8 matmul, so each tensor-parallel `Fp8Linear` computes on
its local shards and hands DTensor the placements a linear of that style produces (what
`F.linear` on DTensors would have done):
    colwise (weight Shard(0)):  input Replicate; output Shard(-1); the input's gradient is
        Partial (each rank's share of the output features), reduced by DTensor as for any linear.
    rowwise (weight Shard(1)):  input Shard(-1) (redistributed there if it came Replicate, as
        MTP's proj does); output Partial, reduced by the style's output layout.

Tiles and blocks must not straddle ranks, or a rank would scale part of a tile that another
rank holds the rest of, and the run would quantise unlike one process: each rank's share of a
sharded width must be a whole number of 128-wide tiles (`check_fp8_shards`).
"""

from types import MethodType

from torch import nn
from torch.distributed.tensor import DTensor, Partial, Shard

from dstrain.errors import UserError
from dstrain.model.fp8 import TILE, fp8_matmul
from dstrain.model.fp8_linear import Fp8Linear


def apply_fp8_tp(model: nn.Module) -> None:
    """Give every tensor-parallel `Fp8Linear` of `model` its local-shard forward (after
    `apply_tp`). Raises UserError where a shard is not a whole number of 128-tiles."""
    for name, module in model.named_modules():
        if isinstance(module, Fp8Linear) and isinstance(module.weight, DTensor):
            _check_shard(name, module.weight)
            module.forward = MethodType(_local_forward, module)


def _sharded_dim(weight: DTensor) -> int:
    (placement,) = weight.placements
    assert isinstance(placement, Shard) and placement.dim in (0, 1), weight.placements
    return placement.dim


def _check_shard(name: str, weight: DTensor) -> None:
    dim = _sharded_dim(weight)
    local, tp = weight.to_local().size(dim), weight.device_mesh.size()
    if local % TILE:
        what = "output features" if dim == 0 else "input features"
        raise UserError(
            f"train.precision = fp8 with tp = {tp}: {name} splits its {weight.size(dim)} {what} "
            f"into {local} per rank, not a multiple of {TILE}, so a 1x128 tile or 128x128 block "
            "would straddle two ranks",
            f"choose parallel.tp so that {weight.size(dim)} / tp is a multiple of {TILE}, or "
            "widen the model (heads x head dims, inter_dim), or train in bf16",
            exit_code=1,
        )


def _local_forward(self: Fp8Linear, x: DTensor) -> DTensor:
    if self.bias is not None:
        raise NotImplementedError("a tensor-parallel FP8 linear with a bias")  # none in dstrain
    weight = self.weight
    mesh = weight.device_mesh
    if _sharded_dim(weight) == 0:
        x_local = x.to_local(grad_placements=[Partial()])
        y = fp8_matmul(x_local, weight.to_local(), self.fp8_backend)
        placements = [Shard(y.dim() - 1)]
    else:
        x_local = x.redistribute(mesh, [Shard(x.dim() - 1)]).to_local()
        y = fp8_matmul(x_local, weight.to_local(), self.fp8_backend)
        placements = [Partial()]
    return DTensor.from_local(y, mesh, placements, run_check=False)
