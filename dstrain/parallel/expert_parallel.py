"""Expert parallelism: the routed experts of every MoE split over the `ep` ranks, tokens sent to
the rank that holds their expert and back.

Legend: T token copies this rank routed (tokens x K), D dim, F expert width, E routed experts,
W ep ranks, L = E / W experts per rank, R token copies this rank receives.

Who holds what: ep rank r holds the contiguous block of experts [r*L, (r+1)*L) of every MoE
(main layers and MTP blocks). The router, its balancing bias and its load counters stay
replicated: every rank routes its own tokens with the full router, and the shared experts are
dense parameters like any other.

Who receives what: the MoE hands its experts the token copies sorted by global expert id, with
counts over all E experts. Dispatch sends rank i the rows for rank i's experts; they arrive
grouped by source rank, then by local expert, and are re-sorted by local expert for one grouped
matmul. Combine undoes the re-sort and returns every row to the rank it came from, in its
original position, so the MoE sees exactly what the unsharded experts would have returned.

Collectives, at the autograd boundary: all-to-all in forward, all-to-all in backward. Forward
runs an all-to-all of the per-(rank, expert) counts (no gradient), then the rows' dispatch and
combine all-to-alls with uneven splits (`all_to_all_single_autograd`); backward runs each of the
two row all-to-alls with its splits swapped. The backward of dispatch is what sums rank r's
expert weight gradients over all ep ranks' tokens: nothing else is reduced for the experts over
ep. Under FSDP the experts get an FSDP2 of their own over the ranks holding the same experts
(`edp`); under DDP they stay outside it and `reduce_expert_grads` sums their gradients over edp.

Weights are DTensors `Shard(0)` on the ep mesh (each rank stores only its L experts' local
shards), not plain local tensors, because that is what composes: the state dict keeps the global
[E, F, D] shapes under the unchanged names, so DCP saves every shard (plain same-named tensors
would be deduplicated as replicas) and reshards across ep degrees, the HF key map still sees E
experts after `full_tensor()`, and FSDP2 on the `efsdp` mesh (a sibling of `ep` under one root)
shards them further as a 2-D (efsdp, ep) parameter, as torchtitan does.
"""

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from dstrain.metrics.comm_timer import label_backward
from dstrain.model.moe import MoE, grouped_swiglu
from dstrain.model.transformer import Transformer

EXPERT_WEIGHTS = ("w1", "w2", "w3")


def apply_ep(model: Transformer | MoE, ep_mesh: DeviceMesh, *, overlap_shared: bool = True) -> None:
    """Split the routed experts of every MoE in `model` (main layers and MTP blocks; or one MoE)
    over the 1-D `ep_mesh`, in place: ep rank r keeps experts [r*E/ep, (r+1)*E/ep) as DTensor
    `Shard(0)` shards of w1, w2, w3 (same names, global shapes), and the experts' forward becomes
    dispatch -> local grouped matmuls -> combine. Works on a `meta` model (materialize after).

    The full weights must be identical on every ep rank (same seed or checkpoint): each rank
    slices its block locally, without communication. `overlap_shared` (`parallel.ep_overlap`):
    the shared experts run while the dispatch is in flight. A no-op when ep is 1."""
    if ep_mesh.ndim != 1:
        raise ValueError(f"apply_ep needs a 1-D ep mesh, got {ep_mesh.ndim}-D: pass meshes['ep']")
    if ep_mesh.size() == 1:
        return
    for moe in [m for m in model.modules() if isinstance(m, MoE)]:
        if moe.num_experts % ep_mesh.size() != 0:
            raise ValueError(
                f"ep={ep_mesh.size()} must divide num_routed_experts={moe.num_experts}: every "
                f"rank holds the same number of experts; choose ep among the divisors of "
                f"{moe.num_experts}"
            )
        moe.experts = ExpertParallelExperts(moe.experts, ep_mesh)
        moe.overlap_shared = overlap_shared


class ExpertParallelExperts(nn.Module):
    """The E grouped SwiGLU experts of `GroupedExperts`, L of them on this rank; same contract:
    forward(x sorted by global expert [T, D], counts over all E experts) -> [T, D], same order.

    `balanced` (a dry run on the fake process group, whose tensors hold no data): every rank
    sends and receives an equal share of its rows, so the split sizes need no data."""

    balanced = False

    def __init__(self, experts: nn.Module, ep_mesh: DeviceMesh) -> None:
        super().__init__()
        self.ep_mesh = ep_mesh
        self.num_experts = experts.w1.size(0)
        self.num_local_experts = self.num_experts // ep_mesh.size()
        self.fp8_backend = getattr(experts, "fp8_backend", None)
        first = ep_mesh.get_local_rank() * self.num_local_experts
        for name in EXPERT_WEIGHTS:
            full = getattr(experts, name)
            # clone: a view would keep the full [E, ...] storage alive on every rank.
            local = full.detach()[first : first + self.num_local_experts].clone()
            shard = DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False)
            self.register_parameter(name, nn.Parameter(shard, requires_grad=full.requires_grad))

    # Eager under torch.compile: the rows each rank receives change with the routing, and
    # dynamo's dynamic shapes over these data-dependent sizes fail to build their guards in
    # torch 2.13 ("sources must not be empty for symbol"); the graph breaks around the experts.
    @torch.compiler.disable
    def forward(
        self,
        x_TD: torch.Tensor,
        counts_E: torch.Tensor,
        meanwhile: Callable[[], None] | None = None,
    ) -> torch.Tensor:
        """`meanwhile` runs after the rows' dispatch is issued and before its result is first
        used: functional collectives are asynchronous until `wait_tensor` (a gloo worker thread
        on CPU, NCCL's stream on GPU, which the compute stream waits on only there)."""
        group = self.ep_mesh.get_group()
        W, L = self.ep_mesh.size(), self.num_local_experts
        if self.balanced:
            recv_WL, send_W, recv_W, sizes_L = _balanced_splits(x_TD, W, L)
        else:
            # recv_WL[i, l]: rows rank i sends to my local expert l (even splits of L counts).
            # Through the module (not imported names): the communication timer counts these.
            recv_WL = funcol.all_to_all_single(counts_E, None, None, group).view(W, L)
            # Host-device sync: the all-to-all split sizes must be Python ints; the one read
            # also brings the local experts' row counts, for the GEMMs that slice per expert.
            sizes = torch.cat([counts_E.view(W, L).sum(1), recv_WL.sum(1), recv_WL.sum(0)])
            sizes = sizes.tolist()
            send_W, recv_W, sizes_L = sizes[:W], sizes[W : 2 * W], sizes[2 * W :]
        x_RD = label_backward(funcol.all_to_all_single_autograd(x_TD, recv_W, send_W, group), "ep")
        if meanwhile is not None:
            meanwhile()
        order_R, inverse_R = _by_local_expert(recv_WL, sum(recv_W))
        y_RD = self._local_experts(x_RD[order_R], recv_WL.sum(0), sizes_L)[inverse_R]
        y_TD = funcol.all_to_all_single_autograd(y_RD, send_W, recv_W, group)
        return label_backward(y_TD, "ep")

    def _local_experts(
        self, x_RD: torch.Tensor, counts_L: torch.Tensor, sizes_L: list[int]
    ) -> torch.Tensor:
        # GroupedExperts.forward on the local shards.
        w1_LFD, w2_LDF, w3_LFD = (getattr(self, n).to_local() for n in EXPERT_WEIGHTS)
        return grouped_swiglu(x_RD, w1_LFD, w2_LDF, w3_LFD, counts_L, self.fp8_backend, sizes_L)


def _balanced_splits(
    x_TD: torch.Tensor, W: int, L: int
) -> tuple[torch.Tensor, list[int], list[int], list[int]]:
    """Routing as if perfectly balanced: T rows split as evenly as whole rows allow. (recv_WL,
    send_W, recv_W, rows per local expert), the sizes made on the host."""
    T = x_TD.size(0)
    send_W = [T // W + (1 if i < T % W else 0) for i in range(W)]
    per_expert = [[n // L + (1 if j < n % L else 0) for j in range(L)] for n in send_W]
    recv_WL = torch.tensor(per_expert, device=x_TD.device)
    sizes_L = [sum(row[j] for row in per_expert) for j in range(L)]
    return recv_WL, send_W, list(send_W), sizes_L


def _by_local_expert(recv_WL: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The permutation that re-sorts received rows (by source rank, then expert) by local expert,
    stably so each expert keeps the source-rank order, and its inverse."""
    W, L = recv_WL.shape
    expert_WL = torch.arange(L, device=recv_WL.device).repeat(W)
    expert_R = expert_WL.repeat_interleave(recv_WL.flatten(), output_size=num_rows)
    order_R = expert_R.argsort(stable=True)
    inverse_R = torch.empty_like(order_R)
    inverse_R[order_R] = torch.arange(num_rows, device=order_R.device)
    return order_R, inverse_R


def expert_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) of the expert-parallel experts' weights, if any."""
    return [
        (f"{name}.{pname}", param)
        for name, module in model.named_modules()
        if isinstance(module, ExpertParallelExperts)
        for pname, param in module.named_parameters()
    ]


def reduce_expert_grads(model: nn.Module, group: dist.ProcessGroup | None, scale: float) -> None:
    """Finish the experts' gradients, which DDP/FSDP leave alone: sum them over the ranks that
    hold the same experts (`group`: dp_replicate x efsdp; the backward all-to-all already summed
    over the ep group) and `scale` them (`moe_tokens.expert_grad_scale`: 1 / dp, the loss was
    multiplied by dp for the dense average, times 1 / tp where tp ranks route identical copies
    of each token)."""
    for _, param in expert_parameters(model):
        if param.grad is None:
            continue
        local = param.grad.to_local()
        if group is not None:
            dist.all_reduce(local, group=group)
        local.mul_(scale)


def scale_expert_grads(model: nn.Module, scale: float) -> None:
    """Multiply the experts' (already reduced, possibly sharded) gradients by `scale`."""
    for _, param in expert_parameters(model):
        if param.grad is not None:
            param.grad.mul_(scale)
