"""DeepSeekMoE: shared experts plus fine-grained routed experts with top-k routing.

Legend: B batch, S sequence, T tokens (B*S), D dim, E routed experts, K activated experts per
token, F expert width (moe_inter_dim), G expert groups.

Routing (DeepSeek-V3 section 2.1.2; V2 section 2.2): affinities s = sigmoid (V3) or softmax (V2)
of the router logits. The choice uses s + b, where b is the auxiliary-loss-free balancing bias;
the gate weights use s alone, renormalized over the top-k when norm_topk_prob, times route_scale.
Group-limited routing keeps the topk_group best of n_group groups first; a group's score is the
sum of its two best biased affinities under sigmoid (V3) and its best affinity under softmax (V2).

Compute: token copies are sorted by expert and run through grouped matmuls (one kernel for all
experts) instead of a Python loop per expert. The sorted layout and the per-expert counts are
what expert parallelism exchanges with all_to_all.

Host syncs: none where the grouped kernel runs (bf16 everywhere; fp32 and fp16 on the CPU): the
offsets stay on the device. Where it cannot (fp32 or fp16 on CUDA, whose `_grouped_mm` takes
bf16 only, and FP8, which has no grouped blockwise kernel: `fp8_grouped.py`), the experts need
their split sizes as ints: one read per MoE layer and micro-batch, shared by the three GEMMs
(`grouped_swiglu`'s `sizes`), which expert parallelism takes from its own all-to-all read.
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from dstrain.config.model_args import ModelArgs
from dstrain.model.ffn import FeedForward
from dstrain.model.fp8_grouped import fp8_grouped_mm

_GROUPED_MM = getattr(F, "grouped_mm", None)  # torch >= 2.9; the loop below serves older torch
_GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class Router(nn.Module):
    """Scores, group limits, top-k, and the load statistics the balancing bias learns from."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.num_experts, self.top_k = args.num_routed_experts, args.num_activated_experts
        self.n_group, self.topk_group = args.n_group, args.topk_group
        self.score_func, self.route_scale = args.score_func, args.route_scale
        self.norm_topk_prob = args.norm_topk_prob
        self.gate = nn.Linear(args.dim, self.num_experts, bias=False)
        # Checkpointed: the bias is training state. Counts are per step and not saved.
        self.register_buffer("expert_bias", torch.zeros(self.num_experts))
        self.register_buffer("tokens_per_expert", torch.zeros(self.num_experts), persistent=False)

    def forward(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(gate weights [T, K] fp32, expert ids [T, K], affinities [T, E] fp32)."""
        # Routing in at least fp32 (a bf16 router flips top-k choices); fp64 stays fp64.
        wide = torch.promote_types(x_TD.dtype, torch.float32)
        logits_TE = F.linear(x_TD.to(wide), self.gate.weight.to(wide))
        scores_TE = logits_TE.sigmoid() if self.score_func == "sigmoid" else logits_TE.softmax(-1)
        choice_TE = scores_TE + self.expert_bias
        if self.n_group > 1:
            choice_TE = self._limit_groups(choice_TE)
        experts_TK = choice_TE.topk(self.top_k, dim=-1).indices
        weights_TK = scores_TE.gather(1, experts_TK)
        if self.norm_topk_prob:
            weights_TK = weights_TK / (weights_TK.sum(-1, keepdim=True) + 1e-20)
        return weights_TK * self.route_scale, experts_TK, scores_TE

    def _limit_groups(self, choice_TE: torch.Tensor) -> torch.Tensor:
        grouped_TGe = choice_TE.view(choice_TE.size(0), self.n_group, -1)
        if self.score_func == "sigmoid" and grouped_TGe.size(-1) > 1:
            group_scores_TG = grouped_TGe.topk(2, dim=-1).values.sum(-1)
        else:
            group_scores_TG = grouped_TGe.amax(-1)
        keep_TG = group_scores_TG.topk(self.topk_group, dim=-1).indices
        mask_TG = torch.ones_like(group_scores_TG, dtype=torch.bool).scatter_(1, keep_TG, False)
        return grouped_TGe.masked_fill(mask_TG.unsqueeze(-1), float("-inf")).flatten(1)

    @torch.no_grad()
    def count(self, experts_TK: torch.Tensor, rows_T: torch.Tensor | None = None) -> None:
        """Add the choices of the MoE's tokens to the load counters (the MoE calls it on all of its
        tokens, also when each tp rank routed a share of them); `rows_T`: only these rows'."""
        # Activation checkpointing re-runs the forward inside backward; count the first pass only.
        if torch._C._current_graph_task_id() == -1:
            counts = count_per_expert(experts_TK, self.num_experts, rows_T)
            self.tokens_per_expert += counts.to(self.tokens_per_expert.dtype)

    @torch.no_grad()
    def update_bias(self, tokens_per_expert: torch.Tensor, speed: float) -> None:
        """Auxiliary-loss-free balancing (V3 eq. 16 ff.): raise the bias of under-loaded experts
        by `speed`, lower it for over-loaded ones. `tokens_per_expert` covers the global batch."""
        load = tokens_per_expert.to(self.expert_bias.dtype)
        self.expert_bias += speed * torch.sign(load.mean() - load)


def count_per_expert(
    experts_TK: torch.Tensor, num_experts: int, rows_T: torch.Tensor | None = None
) -> torch.Tensor:
    """Token copies per expert [E] (int64), of the rows where `rows_T` (bool [T]) is set, else
    of all. A scatter-add (of zeros for the rows left out) rather than `bincount` or a boolean
    index, whose output lengths depend on the data, so that fake-tensor tracing (dry runs,
    torch.compile) sees static shapes."""
    ids = experts_TK.flatten()
    ones = torch.ones_like(ids)
    if rows_T is not None:
        ones = rows_T[:, None].expand_as(experts_TK).flatten().to(ids.dtype)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
    return counts.scatter_add_(0, ids, ones)


class GroupedExperts(nn.Module):
    """E SwiGLU experts as 3-D weights: w1, w3 [E, F, D] (gate, up) and w2 [E, D, F] (down).
    `fp8_backend` (set by `fp8_linear.apply_fp8`): their GEMMs run in FP8 on it."""

    fp8_backend: str | None = None

    def __init__(self, num_experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden, dim))

    def forward(
        self,
        x_TD: torch.Tensor,
        counts_E: torch.Tensor,
        meanwhile: Callable[[], None] | None = None,
    ) -> torch.Tensor:
        """x sorted by expert, counts_E[e] rows for expert e (zero allowed). `meanwhile`: work
        independent of the result, run while the experts' communication is in flight (here,
        with none, first)."""
        if meanwhile is not None:
            meanwhile()
        return grouped_swiglu(x_TD, self.w1, self.w2, self.w3, counts_E, self.fp8_backend)


def grouped_swiglu(
    x_TD: torch.Tensor,
    w1_EFD: torch.Tensor,
    w2_EDF: torch.Tensor,
    w3_EFD: torch.Tensor,
    counts_E: torch.Tensor,
    fp8_backend: str | None = None,
    sizes: list[int] | None = None,
) -> torch.Tensor:
    """SwiGLU of every expert on its rows of x (sorted by expert): w2(silu(w1 x) * w3 x), in the
    compute dtype (autocast's, else x's): autocast does not cover grouped GEMMs, and
    `grouped_mm` refuses mixed dtypes (bf16 activations on fp32 experts kept out of FSDP2).
    With `fp8_backend`, each GEMM runs in FP8 on it instead (`fp8_grouped.py`). `sizes`:
    counts_E as ints where the caller already read them (expert parallelism)."""
    if fp8_backend is not None:
        sizes = split_sizes(counts_E, sizes)
        gate_TF = fp8_grouped_mm(x_TD, w1_EFD, counts_E, sizes, fp8_backend)
        up_TF = fp8_grouped_mm(x_TD, w3_EFD, counts_E, sizes, fp8_backend)
        return fp8_grouped_mm(F.silu(gate_TF) * up_TF, w2_EDF, counts_E, sizes, fp8_backend)
    dtype = compute_dtype(x_TD)
    x_TD = x_TD.to(dtype)
    w1_EFD, w2_EDF, w3_EFD = (w.to(dtype) for w in (w1_EFD, w2_EDF, w3_EFD))
    matmul = _grouped_matmul
    if dtype != torch.bfloat16 and torch.compiler.is_compiling():
        matmul = _eager_grouped_matmul
    sizes = None if _can_group(x_TD, w1_EFD) else split_sizes(counts_E, sizes)
    gate_TF = matmul(x_TD, w1_EFD, counts_E, sizes)
    up_TF = matmul(x_TD, w3_EFD, counts_E, sizes)
    return matmul(F.silu(gate_TF) * up_TF, w2_EDF, counts_E, sizes)


def split_sizes(counts_E: torch.Tensor, sizes: list[int] | None) -> list[int]:
    """The experts' row counts as ints: `sizes` where the caller has them, else read."""
    if sizes is not None:
        return sizes
    # Host-device sync: the per-expert slices need their sizes on the host (module docstring).
    return counts_E.tolist()


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """What a matmul on `x` computes in: autocast's dtype where autocast is on, else x's."""
    device = x.device.type
    if device in ("cpu", "cuda") and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return x.dtype


def _grouped_matmul(
    x_TI: torch.Tensor,
    w_EOI: torch.Tensor,
    counts_E: torch.Tensor,
    sizes: list[int] | None = None,
) -> torch.Tensor:
    """Rows of x for expert e times w[e]^T, for every e at once; per expert on `sizes` where
    the grouped kernel cannot run (`_can_group`: fp32 or fp16 on CUDA)."""
    if x_TI.size(0) == 0:
        # No rows (an EP rank every token passed by): grouped_mm's backward fails on them in
        # torch 2.13 ("Invalid strides/sizes"). An empty product keeps x in the graph.
        return x_TI @ w_EOI[0].T
    if sizes is None:
        offsets = torch.cumsum(counts_E, 0, dtype=torch.int32)
        return _GROUPED_MM(x_TI, w_EOI.transpose(-2, -1), offs=offsets)
    chunks = x_TI.split(sizes)
    return torch.cat([chunk @ w.T for chunk, w in zip(chunks, w_EOI, strict=True)])


def fp8_grouped_matmul(
    x_TI: torch.Tensor, w_EOI: torch.Tensor, counts_E: torch.Tensor, backend: str
) -> torch.Tensor:
    """`_grouped_matmul` in FP8 on `backend` (`fp8_grouped.Fp8GroupedMatmul`)."""
    return fp8_grouped_mm(x_TI, w_EOI, counts_E, split_sizes(counts_E, None), backend)


@torch.compiler.disable
def _eager_grouped_matmul(
    x_TI: torch.Tensor,
    w_EOI: torch.Tensor,
    counts_E: torch.Tensor,
    sizes: list[int] | None = None,
) -> torch.Tensor:
    """`_grouped_matmul` outside torch.compile's graph: torch 2.13's meta kernel of
    `_grouped_mm`, which compile traces with, takes bf16 only, while the eager CPU kernel runs
    fp32 and fp16. The graph breaks around the experts; the rest of the block compiles."""
    return _grouped_matmul(x_TI, w_EOI, counts_E, sizes)


def _can_group(x_TI: torch.Tensor, w_EOI: torch.Tensor) -> bool:
    """grouped_mm needs: torch >= 2.9; fp32/bf16/fp16 on CPU, bf16 on CUDA (its tested kernel);
    and rows whose byte strides are multiples of 16 (dim = 30 in fp32 is not)."""
    if _GROUPED_MM is None or x_TI.dtype not in _GROUPED_DTYPES:
        return False
    if x_TI.device.type != "cpu" and x_TI.dtype != torch.bfloat16:
        return False
    return all(n * x_TI.element_size() % 16 == 0 for n in w_EOI.shape[1:])


class AddAuxiliaryLoss(torch.autograd.Function):
    """Identity on x that also back-propagates into `aux_loss` (DeepSeek-V2's trick), so the
    balance loss needs no extra output from the model."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
        ctx.dtype = aux_loss.dtype
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grad, torch.ones((), dtype=ctx.dtype, device=grad.device)


class MoE(nn.Module):
    """`token_share` (set by `parallel/moe_tokens.apply_token_split` under TP): an object with
    `rows(x)` and `gather(part, total_rows)`; the MoE then routes only its tp rank's rows.
    `tail_padding` (k in MTP depth k's MoE): under context parallelism the last k positions of
    every sequence carry no target (below).
    `overlap_shared` (`parallel.ep_overlap`): the shared experts run while the routed experts'
    dispatch all-to-all is in flight (the experts' `meanwhile`), instead of after the combine."""

    token_share = None
    overlap_shared = False
    # Context parallelism's MTP depth k runs positions that one process does not have (the last
    # k of each sequence, past its end for that depth): their choices must not move the
    # balancing bias nor enter the balance loss. Fixed per module, not set around a call: a
    # checkpointed block's recomputation must see what its forward saw.
    tail_padding = 0
    # Context parallelism (`parallel/context_parallel.py`): this rank holds part of every
    # sequence; the balance loss's statistics are summed over the cp group.
    context = None

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.num_experts, self.top_k = args.num_routed_experts, args.num_activated_experts
        self.aux_loss_alpha, self.seq_aux = args.aux_loss_alpha, args.seq_aux
        self.router = Router(args)
        self.experts = GroupedExperts(args.num_routed_experts, args.dim, args.moe_inter_dim)
        shared = args.num_shared_experts * args.moe_inter_dim
        self.shared_experts = FeedForward(args.dim, shared) if shared else None
        # Scales the balance loss's gradient; the trainer sets 1 / micro-batches per step.
        self.aux_loss_scale = 1.0
        self.register_buffer("last_aux_loss", torch.zeros(()), persistent=False)  # for metrics

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        B, S, D = x_BSD.shape
        x_TD = x_BSD.reshape(-1, D)
        share = self.token_share
        # Under TP with split tokens, route and compute this rank's rows only, then gather.
        mine_TD = share.rows(x_TD) if share is not None else x_TD
        weights_TK, experts_TK, scores_TE = self.router(mine_TD)
        shared: list[torch.Tensor] = []
        meanwhile = None
        if self.shared_experts is not None and self.overlap_shared:
            meanwhile = lambda: shared.append(self.shared_experts(x_TD))  # noqa: E731
        routed_TD = self._routed(mine_TD, weights_TK, experts_TK, meanwhile)
        if share is not None:
            T = x_TD.size(0)
            routed_TD, scores_TE, experts_TK = (
                share.gather(t, T) for t in (routed_TD, scores_TE, experts_TK)
            )
        counted = self._counted_rows(B, S, x_BSD.device)
        self.router.count(experts_TK, counted)
        out_TD = routed_TD
        if self.shared_experts is not None:
            out_TD = out_TD + (shared[0] if shared else self.shared_experts(x_TD))
        out = out_TD.view(B, S, D)
        if self.aux_loss_alpha > 0 and self.training and torch.is_grad_enabled():
            # Without seq_aux the micro-batch is one sequence of B*S tokens (V2's batch form).
            rows = B if self.seq_aux else 1
            scores_BSE = scores_TE.view(rows, -1, scores_TE.size(-1))
            experts_BSK = experts_TK.view(rows, -1, self.top_k)
            if self.context is None:
                aux = value = self._balance_loss(scores_BSE, experts_BSK)
            else:
                kept = None if counted is None else counted.view(rows, -1)
                aux, value = self._split_balance_loss(scores_BSE, experts_BSK, kept)
            self.last_aux_loss.copy_(value.detach())
            out = AddAuxiliaryLoss.apply(out, aux * self.aux_loss_scale)
        return out

    def _counted_rows(self, B: int, L: int, device: torch.device) -> torch.Tensor | None:
        """[B x L] bool: the rows whose routing counts (None: all), by position: under context
        parallelism with `tail_padding`, those before the sequence's last `tail_padding`."""
        if self.context is None or not self.tail_padding:
            return None
        positions = self.context.positions(L, device)
        kept = positions < L * self.context.size - self.tail_padding
        return kept.expand(B, -1).flatten()

    def _routed(
        self,
        x_TD: torch.Tensor,
        weights_TK: torch.Tensor,
        experts_TK: torch.Tensor,
        meanwhile: Callable[[], None] | None,
    ) -> torch.Tensor:
        """The routed experts' weighted sum for each token: copies sorted by expert, through the
        experts (running `meanwhile` while their communication is in flight), scaled by their
        gate weights and added back to their tokens."""
        order = experts_TK.flatten().argsort(stable=True)
        token_of = order // self.top_k
        counts_E = count_per_expert(experts_TK, self.num_experts)
        routed_TD = self.experts(x_TD[token_of], counts_E, meanwhile=meanwhile)
        routed_TD = (routed_TD.to(weights_TK.dtype) * weights_TK.flatten()[order, None]).to(
            x_TD.dtype
        )
        return torch.zeros_like(x_TD).index_add_(0, token_of, routed_TD)

    def _balance_loss(self, scores_BSE: torch.Tensor, experts_BSK: torch.Tensor) -> torch.Tensor:
        """Sequence-wise balance loss (V3 eq. 17-20): alpha * sum_e f_e * P_e per sequence,
        averaged over the batch; f_e = E/(K S) * tokens routed to e, P_e = mean normalized
        affinity."""
        B, S, E = scores_BSE.shape
        normalized = scores_BSE / scores_BSE.sum(-1, keepdim=True)
        hits_BE = torch.zeros(B, E, device=scores_BSE.device).scatter_add_(
            1, experts_BSK.flatten(1), torch.ones(B, S * self.top_k, device=scores_BSE.device)
        )
        f_BE = hits_BE * E / (self.top_k * S)
        p_BE = normalized.mean(1)
        return self.aux_loss_alpha * (f_BE * p_BE).sum(-1).mean()

    def _split_balance_loss(
        self, scores_BLE: torch.Tensor, experts_BLK: torch.Tensor, kept_BL: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The same loss when each sequence is split over the cp ranks (this one holds L of its
        tokens): the expert hits, the summed affinities and the token count of every sequence
        are summed over the group (one all-reduce of [B, 2E + 1], no gradient), then this rank's
        term is f_e (the whole sequence's) times its own tokens' affinities over the whole
        length. The terms of the cp ranks add up to one process's loss, and so do their
        gradients (the trainer scales the balance loss's backward by cp, as FSDP averages what
        here must add up). `kept_BL`: the positions that count (MTP's padded ones do not).
        Returns (this rank's term, the whole loss for the metrics)."""
        B, L, E = scores_BLE.shape
        device = scores_BLE.device
        kept = torch.ones(B, L, device=device) if kept_BL is None else kept_BL.to(torch.float32)
        normalized = scores_BLE / scores_BLE.sum(-1, keepdim=True)
        hits_BE = torch.zeros(B, E, device=device).scatter_add_(
            1, experts_BLK.flatten(1), kept.repeat_interleave(self.top_k, dim=1)
        )
        affinity_BE = (normalized * kept[..., None]).sum(1)
        local = torch.cat([hits_BE, affinity_BE.detach(), kept.sum(1, keepdim=True)], dim=-1)
        whole = self.context.sum(local)
        hits_BE, all_affinity_BE, tokens_B1 = whole.split([E, E, 1], dim=-1)
        f_BE = hits_BE * E / (self.top_k * tokens_B1)
        term = self.aux_loss_alpha * (f_BE * affinity_BE / tokens_B1).sum(-1).mean()
        value = self.aux_loss_alpha * (f_BE * all_affinity_BE / tokens_B1).sum(-1).mean()
        return term, value
