"""The NCCL and torch environment per network preset, the same for Kubernetes, Slurm and bare
metal (docs/deploy.md lists it)."""

from dstrain.deploy.spec import DeploySpec

# Kubernetes pods see one interface named eth0; on bare metal and Slurm we exclude loopback and
# docker bridges instead of guessing the NIC's name (NCCL's `^` prefix means "not these").
DEFAULT_IFNAME = {"k8s": "eth0", "slurm": "^lo,docker", "bare": "^lo,docker"}
# RoCE v2 over IPv4 is GID index 3 on the usual Mellanox/NVIDIA setups; IB needs no GID index.
ROCE_GID_INDEX = "3"


def nccl_env(spec: DeploySpec, target: str) -> dict[str, str]:
    """Variables every rank gets. Order is stable so rendered files diff cleanly."""
    env = {
        "NCCL_DEBUG": "WARN",
        "NCCL_SOCKET_IFNAME": spec.socket_ifname or DEFAULT_IFNAME[target],
    }
    env.update(_transport(spec.network_family))
    # A failed or hung collective tears the process down (3 = without cleanup, so a dead peer
    # cannot wedge the exit), the agent sees the worker die and restarts the group.
    env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "3"
    # Restarted workers must not read the previous attempt's rendezvous keys
    # (TORCH-CPU-NOTES: elastic restarts recover only about half the time without this).
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    return env


def _transport(family: str) -> dict[str, str]:
    if family == "ib":
        # All HCAs whose name starts with mlx5 (NCCL matches the prefix); NCCL picks the
        # GPU-nearest one and GPUDirect RDMA by itself.
        return {"NCCL_IB_DISABLE": "0", "NCCL_IB_HCA": "mlx5"}
    if family == "roce":
        return {
            "NCCL_IB_DISABLE": "0",
            "NCCL_IB_HCA": "mlx5",
            "NCCL_IB_GID_INDEX": ROCE_GID_INDEX,
        }
    # Plain Ethernet: TCP sockets only; without this NCCL probes for IB devices that are absent.
    return {"NCCL_IB_DISABLE": "1"}
