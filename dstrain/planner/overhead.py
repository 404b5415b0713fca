"""Memory a training process holds besides its model states and activations: the CUDA context
and NCCL's buffers (outside PyTorch's allocator: only nvidia-smi sees them), cuBLAS workspaces
and the caching allocator's fragmentation (inside it: `max_memory_reserved` sees them).

Each term is what the sources measured, not a fixed pad:
- the CUDA context: about 400 MiB with lazy module loading, the default since CUDA 12.2
  (NVIDIA's ptrblck, pytorch/pytorch#109888; 274 MiB in PR #86509's measurement, 426 MiB on an
  RTX 6000 Ada with torch 2.10);
- NCCL: every communicator holds a buffer per connection and channel, 9.19 MiB for its three
  protocols (Simple 4 MiB, LL 512 KiB, LL128 4.69 MiB: `src/include/device.h`), rounded up to
  2 MiB pages since NCCL 2.19 (10 MiB, NVIDIA/nccl#1685). Rings and trees keep 2 or 3
  connections per channel whatever the scale (NVIDIA/nccl#864); 8 x A100 run 24 channels,
  8 x H100 32. That gives 480 and 720 MiB on A100, where 4 x A100 measured 544 MB for a
  2-rank group and 688 MB for a larger one (NVIDIA/nccl#964). NVLink SHARP adds 16 channels x
  2 x 1 MiB x 8 heads = 256 MiB on Hopper (`src/transport/nvls.cc`; older releases took 2.25
  GiB, vllm#9699). Point-to-point peers (pipeline sends, expert all-to-alls) add buffers per
  peer: the first all-to-all over 8 H100s took 3.28 GB more (NVIDIA/nccl#1685), 470 MiB per
  peer in a node; a peer across the network uses NCCL_NCHANNELS_PER_NET_PEER (2) channels;
- cuBLAS's workspace: 32 MiB per stream on Hopper, 8.125 MiB elsewhere (torch's
  `CublasHandlePool.cpp`), on the compute and the communication streams;
- fragmentation: what the caching allocator reserves beyond what tensors hold. Megatron-LM's
  FSDP run reserved 8.9 % more than it allocated (NVIDIA/Megatron-LM#6885), the GMLake paper
  measured 15 % on average over eight LLMs (arXiv 2401.08156); the allocated memory that comes
  and goes is the activations', so FRAGMENTATION of them.
"""

import functools

from dstrain.planner.comm import group_span, ranks_per_node
from dstrain.planner.layout import Cluster, Layout

MiB = 2**20
GiB = 2**30
CONTEXT_BYTES = 400 * MiB
CONNECTION_BYTES = 10 * MiB  # per connection and channel: 9.19 MiB in 2 MiB pages
RING_CHANNELS = {"ampere": 24, "hopper": 32, "blackwell": 32}
OTHER_CHANNELS = 16
NVLS_BYTES = 256 * MiB
PEER_IN_NODE_BYTES = 3.28e9 / 7  # NVIDIA/nccl#1685: 8 x H100, one all-to-all
NET_PEER_CHANNELS = 2
WORKSPACE_BYTES = {"hopper": 32 * MiB, "blackwell": 32 * MiB}
OTHER_WORKSPACE_BYTES = 8.125 * MiB
STREAMS = 2  # compute and communication
FRAGMENTATION = 0.09
# The axes whose groups talk in point-to-point messages (pipeline sends, all-to-alls) and the
# ones that run collectives on rings and trees
POINT_TO_POINT = ("pp", "ep")
COLLECTIVE = ("dp", "tp", "cp", "edp")


def outside_allocator(layout: Layout, cluster: Cluster) -> float:
    """Bytes no torch counter sees: the CUDA context and NCCL's buffers."""
    return CONTEXT_BYTES + _nccl_by_degrees(
        (layout.dp, layout.tp, layout.pp, layout.ep, layout.cp), cluster
    )


@functools.lru_cache(maxsize=4096)
def _nccl_by_degrees(degrees: tuple[int, int, int, int, int], cluster: Cluster) -> float:
    """`nccl_bytes` for the degrees alone (what it depends on), cached: the search asks for the
    same degrees with every ZeRO stage, micro-batch, schedule and recompute."""
    dp, tp, pp, ep, cp = degrees
    return nccl_bytes(Layout(dp=dp, tp=tp, pp=pp, ep=ep, cp=cp), cluster)


def nccl_bytes(layout: Layout, cluster: Cluster) -> float:
    """NCCL's buffers for the communicators the trainer opens: the world's and one per mesh
    axis of more than one rank."""
    arch = cluster.gpu.arch
    channels = RING_CHANNELS.get(arch, OTHER_CHANNELS)
    total = _collective(channels, layout.world)
    for axis in COLLECTIVE:
        n, _ = group_span(axis, layout)
        if n > 1 and not (axis == "edp" and layout.ep == 1):
            total += _collective(channels, n)
            if n > 2 and _nvls(layout, cluster, axis):
                total += NVLS_BYTES
    for axis in POINT_TO_POINT:
        n, stride = group_span(axis, layout)
        if n <= 1:
            continue
        peers = 2 if axis == "pp" else n - 1
        in_node = min(peers, ranks_per_node(n, stride, cluster.gpus_per_node) - 1)
        total += in_node * PEER_IN_NODE_BYTES
        total += (peers - in_node) * NET_PEER_CHANNELS * 2 * CONNECTION_BYTES
    return total


def workspace_bytes(cluster: Cluster) -> float:
    """cuBLAS's workspaces, one per stream that runs matmuls (inside the allocator)."""
    return STREAMS * WORKSPACE_BYTES.get(cluster.gpu.arch, OTHER_WORKSPACE_BYTES)


def _collective(channels: int, n: int) -> float:
    """A ring (2 connections per channel) and, beyond 2 ranks, a tree (one more)."""
    if n <= 1:
        return 0.0
    return channels * (2 if n == 2 else 3) * CONNECTION_BYTES


def _nvls(layout: Layout, cluster: Cluster, axis: str) -> bool:
    """NVLink SHARP serves an all-reduce group inside a Hopper (or newer) node."""
    n, stride = group_span(axis, layout)
    inside = n * stride <= cluster.gpus_per_node
    return inside and cluster.gpu.arch in ("hopper", "blackwell")
