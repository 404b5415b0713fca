"""Materialising a model built on `meta` after it was parallelised: each rank allocates only the
shards it holds (`to_empty`) and fills them with the layout-invariant initial weights of
`dstrain/model/init.py`, so gathered weights equal a one-process run's bit for bit; or, with
`model.init_from`, with its slices of a Hugging Face checkpoint (`dstrain/model/hf_load.py`).

Order (torchtitan's): build on meta -> TP, EP, activation checkpointing, compile, FSDP2 -> here
-> DDP (which needs real tensors: it broadcasts rank 0's at wrap time).
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

from dstrain.model.hf_load import HFCheckpoint, load_parameters
from dstrain.model.init import LocalBox, init_parameters, whole


def local_box(tensor: torch.Tensor) -> LocalBox:
    """Where this rank's local shard of `tensor` sits in the global tensor. FSDP2's shards are
    DTensors too (uneven ones cut as torch.chunk cuts, as DTensor computes), so TP, EP and FSDP
    and their 2-D compositions all come out as one box of the global tensor."""
    if not isinstance(tensor, DTensor):
        return whole(tensor)
    mesh = tensor.device_mesh
    shape, offset = _compute_local_shape_and_global_offset(
        tensor.shape, mesh.shape, _coordinate(mesh), tensor.placements
    )
    local = tensor._local_tensor  # the storage itself: init writes in place
    assert tuple(local.shape) == tuple(shape), (tuple(local.shape), tuple(shape))
    return LocalBox(local, tuple(tensor.shape), tuple(offset))


def _coordinate(mesh: DeviceMesh) -> list[int]:
    """This rank's place in `mesh`, from the mesh's grid of ranks. Not `mesh.get_coordinate()`:
    torch caches DTensor specs by value, and meshes of the same shape compare equal whatever the
    rank they were built on, so a dry run that builds rank after rank in one process (fake
    process groups) meets parameters whose mesh is the previous rank's, coordinate included."""
    where = (mesh.mesh == dist.get_rank()).nonzero()
    assert where.size(0) == 1, f"rank {dist.get_rank()} is not in {mesh}"
    return where[0].tolist()


def materialize(
    model: nn.Module, device: torch.device, seed: int, weights: HFCheckpoint | None = None
) -> None:
    """Allocate `model`'s local shards on `device` and fill them: from `weights` (a checkpoint's
    slices) when given, else the initialiser's draws from `seed`."""
    model.to_empty(device=device)
    if weights is None:
        init_parameters(model, seed, local_box)
    else:
        load_parameters(model, weights, local_box)
