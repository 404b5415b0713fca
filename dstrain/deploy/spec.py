"""DeploySpec: everything the renderers need, resolved once from the config plus the flags, and
the placement rule that keeps TP/CP/EP groups inside one node."""

import math
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

from dstrain import __version__
from dstrain.config.parallel_dims import ParallelDims
from dstrain.config.schema import DstrainConfig
from dstrain.errors import UserError
from dstrain.hardware import network_gbps

RDZV_PORT = 29400  # torchrun's documented default c10d rendezvous port
CONFIG_NAME = "config.toml"
DEFAULT_IMAGE = f"dstrain:{__version__}"  # what `docker build -t` is told in docs/deploy.md
# JobSet pod hostnames are `<name>-node-<i>-0` and must stay a DNS-1123 label (<= 63 chars).
_MAX_NAME = 40


@dataclass(frozen=True)
class DeploySpec:
    """One launch, independent of the target. `config_toml` is exactly what every node runs."""

    job_name: str
    nodes: int
    gpus_per_node: int
    network: str  # the cluster.network preset: ib-*, roce-* or eth-*
    config_toml: str
    run_root: str  # run.root as written in the config (relative to the working directory)
    image: str = DEFAULT_IMAGE
    max_restarts: int = 3  # torchrun's group restarts, and the controller's pod restarts
    rdzv_port: int = RDZV_PORT
    socket_ifname: str | None = None  # None = the target's default
    shm_size: str = "64Gi"
    rdma_resource: str = "rdma/ib"  # "none" = request no RDMA device
    k8s_kind: str = "jobset"
    gang: str | None = None  # "volcano" or None
    volcano_queue: str = "default"
    node_selector: dict[str, str] = field(default_factory=dict)
    pvc: str | None = None
    cuda: str = "cu128"
    cpus_per_task: int = 16  # Slurm: CPUs for the node's agent and its ranks (dataloaders)
    time: str | None = None  # Slurm --time; None = the partition's default
    partition: str | None = None

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def network_family(self) -> str:
        """`ib`, `roce` or `eth`: what decides the NCCL transport settings."""
        return self.network.split("-", 1)[0]

    @property
    def uses_rdma(self) -> bool:
        return self.network_family in ("ib", "roce") and self.rdma_resource != "none"

    @property
    def cpu_only(self) -> bool:
        """A CPU run (comm.backend gloo, or cluster.gpu `cpu`), read from the config every node
        runs: it asks the scheduler for no GPU, which a cluster without GPU GRES would refuse.
        `auto` picks NCCL on a GPU node, so it asks."""
        config = tomllib.loads(self.config_toml)
        backend = config.get("comm", {}).get("backend")
        return backend == "gloo" or str(config.get("cluster", {}).get("gpu")).lower() == "cpu"


def dns_label(text: str) -> str:
    """`text` as a DNS-1123 label short enough for the pod hostnames derived from it."""
    label = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")
    label = label[:_MAX_NAME].rstrip("-")
    if not label or not label[0].isalpha():
        label = f"dstrain-{label}".rstrip("-")[:_MAX_NAME]
    return label


def check_network(preset: str) -> str:
    network_gbps(preset)  # an unknown preset is a UserError naming the known ones
    return preset.strip().lower()


def check_placement(
    config: DstrainConfig, nodes: int, gpus_per_node: int, allow_cross_node_ep: bool = False
) -> list[str]:
    """Refuse a layout whose TP or EP groups would cross nodes; returns warnings.

    Ranks are row-major over (pp, dp_replicate, dp_shard, cp, tp), a node holds gpus_per_node
    consecutive ranks, and ep takes the innermost ep ranks of dp_shard x cp x tp
    (parallel/mesh.py). So a CP x TP group is cp x tp consecutive ranks and an EP group ep
    consecutive ranks (it contains the TP groups when ep >= tp): each stays in one node when its
    size divides gpus_per_node. TP all-reduces and EP all-to-alls run every layer and need the
    intra-node links; across nodes they run at network speed."""
    if nodes == 1:
        return []
    dims = ParallelDims.of(config.parallel, nodes * gpus_per_node)
    inner = dims.cp * dims.tp
    if gpus_per_node % inner:
        raise UserError(
            f"placement: tensor-parallel groups span nodes: cp x tp = {inner} consecutive ranks "
            f"must share a node, but a node has {gpus_per_node} GPUs",
            f"choose tp (x cp) among the divisors of {gpus_per_node} (e.g. --set parallel.tp="
            f"{math.gcd(dims.tp, gpus_per_node)}), or --gpus-per-node a multiple of {inner}; "
            "spread across nodes with pp or dp instead",
            exit_code=1,
        )
    block = math.lcm(inner, dims.ep)
    if gpus_per_node % block == 0:
        return []
    message = (
        f"placement: expert-parallel groups span nodes: lcm(cp x tp, ep) = {block} consecutive "
        f"ranks, but a node has {gpus_per_node} GPUs, so every MoE layer's all-to-all crosses "
        "the network"
    )
    if allow_cross_node_ep:
        return [message + " (allowed by --allow-cross-node-ep)"]
    raise UserError(
        message,
        f"choose ep among the divisors of {gpus_per_node} (e.g. --set parallel.ep="
        f"{math.gcd(dims.ep, gpus_per_node)}), or pass --allow-cross-node-ep when the network "
        "is built for it (DeepSeek-V3 runs EP64 over 8 nodes of InfiniBand)",
        exit_code=1,
    )


def resolve_spec(config: DstrainConfig, config_toml: str, **flags: Any) -> DeploySpec:
    """The spec of `config` (whose cluster section already holds the resolved nodes and
    gpus_per_node); `flags` are the DeploySpec fields the command line set. Placement is
    checked by the caller (check_placement)."""
    c = config.cluster
    name = flags.pop("job_name", None) or config.run.name
    return DeploySpec(
        job_name=dns_label(str(name)),
        nodes=c.nodes,
        gpus_per_node=c.gpus_per_node,
        network=check_network(c.network),
        config_toml=config_toml,
        run_root=str(PurePosixPath(config.run.root.as_posix())),
        **flags,
    )
