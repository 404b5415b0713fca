"""Routed experts under tensor parallelism: each tp rank routes its share of the tokens.

Legend: T tokens of the MoE's input on every tp rank, t = about T / tp this rank's rows, D dim,
E routed experts, K activated experts per token.

Without this every tp rank routes the same T tokens through the same full experts (the router
and experts are not tensor-parallel), so expert FLOPs, expert activations and EP all-to-all
bytes are tp times what the tokens need. With it (`parallel.moe_tp = "split_tokens"`, the
default) the MoE routes, dispatches and computes only its rank's rows of the input and
all-gathers the combined result:

    x [T, D] (identical on all tp ranks) -> rows [t, D] of this rank -> router, experts (local or
    expert-parallel), combine -> all-gather over tp -> [T, D]

The other way, tensor-parallel experts (each expert's F split over tp, as Megatron's expert-TP),
was not chosen: it splits every expert GEMM's inner width, so a fine-grained expert (F = 2048 in
DeepSeek-V3, 256 in our debug model) becomes tp narrower GEMMs and FP8 blocks of 128 stop
fitting sooner, and it adds an all-reduce per MoE layer; token splitting keeps the grouped GEMMs
whole and its one all-gather replaces nothing that was cheaper. It is also DeepSeek-V3's
choice: it trains without TP (report, Sec. 3.2), and its serving layout splits attention with TP
but runs the MoE part on EP alone (Sec. 3.4.1).

Autograd (DTensor's redistributes, all at the autograd boundary):
    rows of x: Replicate -> Shard(0): a local slice forward, an all-gather of the rows'
        gradients backward, so the MoE's input gradient is whole and equal on every tp rank;
    routed output, affinities, expert ids: Shard(0) -> Replicate: an all-gather forward, a local
        slice of the (equal) gradient backward.
The router's weight and unsharded experts then get only their rows' share of the gradient on
each tp rank: `reduce_split_grads` sums them over tp after backward. Expert-parallel experts
need nothing more: ep folds over the tp ranks first, so the dispatch's backward already sums
every rank's rows; their scale loses the 1/tp that paid for the repeated copies (`expert_grad_
scale`). Uneven T (T % tp != 0) is DTensor's uneven sharding: torch.chunk's split sizes.
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from dstrain.model.moe import MoE
from dstrain.parallel.expert_parallel import ExpertParallelExperts

MODES = ("split_tokens", "repeat")


class TokenShare:
    """The MoE's hook for splitting its routed work over tp (`MoE.token_share`)."""

    def __init__(self, tp_mesh: DeviceMesh) -> None:
        self.mesh = tp_mesh

    def rows(self, x_TD: torch.Tensor) -> torch.Tensor:
        """This rank's rows of `x_TD` (equal on every tp rank)."""
        full = DTensor.from_local(x_TD, self.mesh, [Replicate()], run_check=False)
        return full.redistribute(self.mesh, [Shard(0)]).to_local()

    def gather(self, part: torch.Tensor, total_rows: int) -> torch.Tensor:
        """Every rank's rows of a per-token result, in order: [total_rows, ...] on every rank."""
        shape = (total_rows, *part.shape[1:])
        stride = torch.empty(shape, device="meta").stride()
        local = DTensor.from_local(
            part, self.mesh, [Shard(0)], run_check=False, shape=shape, stride=stride
        )
        return local.redistribute(self.mesh, [Replicate()]).to_local()


def apply_token_split(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Every MoE of `model` routes its tp rank's share of the tokens (module docstring)."""
    if tp_mesh.size() == 1:
        return
    share = TokenShare(tp_mesh)
    for moe in model.modules():
        if isinstance(moe, MoE):
            moe.token_share = share


def split_grad_params(model: nn.Module) -> list[nn.Parameter]:
    """The parameters whose gradient each tp rank holds only its rows' share of: the routers'
    weights and, when they are not expert-parallel, the routed experts'."""
    params = []
    for moe in model.modules():
        if isinstance(moe, MoE) and moe.token_share is not None:
            params += [p for m in (moe.router, moe.experts) for p in _plain_params(m)]
    return params


def _plain_params(module: nn.Module) -> list[nn.Parameter]:
    # Expert-parallel experts are DTensors on the ep mesh: their dispatch's backward sums them.
    if isinstance(module, ExpertParallelExperts):
        return []
    return list(module.parameters())


def reduce_split_grads(model: nn.Module, tp_group: dist.ProcessGroup) -> None:
    """Sum the split parameters' gradients over tp, in one all-reduce. The gradients may be
    FSDP2 shards (DTensors on the dp mesh): each tp rank holds the same shard of them, so their
    local tensors are summed."""
    grads = [_local(p.grad) for p in split_grad_params(model) if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1).to(torch.float32) for g in grads])
    dist.all_reduce(flat, group=tp_group)
    for grad, part in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
        grad.copy_(part.view_as(grad))


def expert_grad_scale(dp: int, tp: int, mode: str) -> float:
    """The factor that turns expert-parallel experts' summed gradients into the one-process
    gradient: 1 / dp (the loss was multiplied by dp), and 1 / tp more when every tp rank routed
    its own copy of every token (`repeat`)."""
    return 1.0 / (dp * (tp if mode == "repeat" else 1))


def _local(grad: torch.Tensor) -> torch.Tensor:
    return grad.to_local() if isinstance(grad, DTensor) else grad
