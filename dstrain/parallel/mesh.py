"""Device meshes from ParallelDims.

Ranks are laid out row-major over (pp, dp_replicate, dp_shard, cp, tp): tp is innermost, so a
tensor-parallel group is consecutive ranks (on one node). The same world is viewed twice
(torch's `DeviceMesh._unflatten`, as torchtitan does):

    dense  (pp, dp_replicate, dp_shard, cp, tp)   attention, dense FFN, embeddings
    sparse (pp, dp_replicate, efsdp, ep)          routed experts

`ep` takes the innermost ep ranks of the dp_shard x cp x tp block (the folding rule of
`ParallelDims`); the remaining `efsdp` ranks (times dp_replicate: `edp`) hold the same experts.
Named views: `dp` (replicate x shard: ranks with different data), `dp_shard_cp` (FSDP's shard
axis), `dp_cp` (ranks with different target tokens: different data, or other parts of the same
sequences), `edp` (ranks holding the same experts).
"""

from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.distributed_c10d import _set_pg_timeout

from dstrain.config.parallel_dims import ParallelDims

DENSE_AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
SPARSE_AXES = ("pp", "dp_replicate", "efsdp", "ep")


@dataclass
class Meshes:
    dims: ParallelDims
    dense: DeviceMesh
    sparse: DeviceMesh
    flat: dict[str, DeviceMesh]
    timeout: timedelta | None = None  # every group's (comm.timeout_s); None: torch's defaults
    hsdp_cp: DeviceMesh | None = None  # (pp, dp_replicate, dp_shard_cp, tp): HSDP with cp

    def fsdp(self) -> DeviceMesh:
        """FSDP2's mesh for the dense weights: the dp_shard (x cp) ranks shard them; under HSDP
        (dp_replicate > 1) 2-D, the replicas outside."""
        shard = self["dp_shard_cp"] if self.dims.cp > 1 else self["dp_shard"]
        if self.dims.dp_replicate == 1:
            return shard
        if self.hsdp_cp is not None:
            return self.hsdp_cp["dp_replicate", "dp_shard_cp"]
        return self.dense["dp_replicate", "dp_shard"]

    def __getitem__(self, name: str) -> DeviceMesh:
        """A named 1-D view: any dense axis, `dp`, `dp_shard_cp`, `dp_cp`, `efsdp` or `ep`."""
        if name in self.flat:
            return self.flat[name]
        if name in ("efsdp", "ep"):
            return self.sparse[name]
        return self.dense[name]


def build_meshes(dims: ParallelDims, device_type: str, timeout: timedelta | None = None) -> Meshes:
    """`timeout`: set on every group the meshes create. torch gives a sub-group its backend's
    default (30 min for gloo, 10 for NCCL), not the world group's `init_process_group` timeout,
    so without this a rank stuck in an EP, PP or TP collective holds its peers far past
    comm.timeout_s. Upstream's setter, as torchtitan uses it (`_set_pg_timeout`)."""
    world = init_device_mesh(device_type, (dims.world_size,), mesh_dim_names=("world",))
    dense = world._unflatten(
        0, (dims.pp, dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp), DENSE_AXES
    )
    sparse = world._unflatten(0, (dims.pp, dims.dp_replicate, dims.efsdp, dims.ep), SPARSE_AXES)
    flat = {
        "dp": dense["dp_replicate", "dp_shard"]._flatten("dp"),
        "dp_shard_cp": dense["dp_shard", "cp"]._flatten("dp_shard_cp"),
        # Ranks with disjoint target tokens (data x context parallel): losses and counts sum here.
        "dp_cp": dense["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp"),
        # Ranks holding the same experts: their expert gradients are summed over this.
        "edp": sparse["dp_replicate", "efsdp"]._flatten("edp"),
    }
    hsdp_cp = None
    if dims.dp_replicate > 1 and dims.cp > 1:
        shape = (dims.pp, dims.dp_replicate, dims.dp_shard * dims.cp, dims.tp)
        hsdp_cp = world._unflatten(0, shape, ("pp", "dp_replicate", "dp_shard_cp", "tp"))
    meshes = Meshes(dims, dense, sparse, flat, timeout, hsdp_cp)
    if timeout is not None:
        for group in groups(meshes):
            _set_pg_timeout(timeout, group)
    return meshes


def groups(meshes: Meshes) -> list[dist.ProcessGroup]:
    """Each distinct process group of this rank's 1-D views (the world's included where an
    axis spans it)."""
    found: dict[str, dist.ProcessGroup] = {}
    for name in (*DENSE_AXES, "efsdp", "ep", *meshes.flat):
        group = meshes[name].get_group()
        found.setdefault(group.group_name, group)
    return list(found.values())
