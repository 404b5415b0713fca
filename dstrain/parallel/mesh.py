"""Device meshes from ParallelDims.

Ranks are laid out row-major over (pp, dp_replicate, dp_shard, cp, tp): tp is innermost, so a
tensor-parallel group is consecutive ranks (on one node). The same world is viewed twice
(torch's `DeviceMesh._unflatten`, as torchtitan does):

    dense  (pp, dp_replicate, dp_shard, cp, tp)   attention, dense FFN, embeddings
    sparse (pp, dp_replicate, efsdp, ep)          routed experts

`ep` takes the innermost ep ranks of the dp_shard x cp x tp block (the folding rule of
`ParallelDims`); the remaining `efsdp` ranks (times dp_replicate: `edp`) hold the same experts.
Named views: `dp` (replicate x shard: ranks with different data), `dp_shard_cp` (FSDP's shard
axis), `edp` (ranks holding the same experts).
"""

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from dstrain.config.parallel_dims import ParallelDims

DENSE_AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
SPARSE_AXES = ("pp", "dp_replicate", "efsdp", "ep")


@dataclass
class Meshes:
    dims: ParallelDims
    dense: DeviceMesh
    sparse: DeviceMesh
    flat: dict[str, DeviceMesh]

    def __getitem__(self, name: str) -> DeviceMesh:
        """A named 1-D view: any dense axis, `dp`, `dp_shard_cp`, `efsdp` or `ep`."""
        if name in self.flat:
            return self.flat[name]
        if name in ("efsdp", "ep"):
            return self.sparse[name]
        return self.dense[name]


def build_meshes(dims: ParallelDims, device_type: str) -> Meshes:
    world = init_device_mesh(device_type, (dims.world_size,), mesh_dim_names=("world",))
    dense = world._unflatten(
        0, (dims.pp, dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp), DENSE_AXES
    )
    sparse = world._unflatten(0, (dims.pp, dims.dp_replicate, dims.efsdp, dims.ep), SPARSE_AXES)
    flat = {
        "dp": dense["dp_replicate", "dp_shard"]._flatten("dp"),
        "dp_shard_cp": dense["dp_shard", "cp"]._flatten("dp_shard_cp"),
        # Ranks holding the same experts: their expert gradients are summed over this.
        "edp": sparse["dp_replicate", "efsdp"]._flatten("edp"),
    }
    return Meshes(dims, dense, sparse, flat)
