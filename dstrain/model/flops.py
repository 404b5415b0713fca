"""Parameter counts and model FLOPs of a DeepSeek-style decoder, from its ModelArgs alone.

Pure Python (no torch): `dstrain check`, the planner, the start-up log and the MFU metric all call
these same formulas, on a laptop or on a rank. The shapes are the ones `dstrain/model/` builds:
untied embedding and head, RMSNorm weights without biases, MLA or MHA attention, dense FFN for the
first `first_k_dense` layers and DeepSeekMoE after them, and `num_mtp_modules` MTP modules that
share the main model's embedding and head.

Sources for the published figures the conventions below reproduce:
- DeepSeek-V3 technical report (arXiv 2412.19437), sec. 4.2: 671B total, 37B activated; the HF model
  card: 685B = 671B main model + 14B MTP module (the checkpoint stores the MTP module's own copy of
  the embedding and head, which we share and do not count again).
- DeepSeek-V2 report (arXiv 2405.04434), appendix B: DeepSeek-V2-Lite 15.7B total, 2.4B activated.
- DeepSeekMoE (arXiv 2401.06066), table "DeepSeekMoE 16B": 16.4B total, 2.8B activated.
- DeepSeek LLM (arXiv 2401.02954): DeepSeek-LLM-7B, 6.9B parameters (HF: 6.91B).
"""

from dataclasses import dataclass, fields

from dstrain.config.model_args import ModelArgs


@dataclass(frozen=True)
class _Block:
    """One transformer block's parameters by kind: a main-model layer or an MTP module's block."""

    attention: int  # projection matrices only; q_norm/kv_norm are in `norms`
    norms: int
    dense_ffn: int
    routed_experts: int  # all routed experts
    activated_routed_experts: int  # the top-k a token is sent to
    shared_experts: int
    router: int

    @property
    def total(self) -> int:
        return self.activated - self.activated_routed_experts + self.routed_experts

    @property
    def activated(self) -> int:
        return (
            self.attention
            + self.norms
            + self.dense_ffn
            + self.activated_routed_experts
            + self.shared_experts
            + self.router
        )

    @property
    def matmul_per_token(self) -> int:
        """Weights one token multiplies by: norms are elementwise, not matmuls."""
        return self.activated - self.norms


@dataclass(frozen=True)
class ParamCounts:
    """Parameter counts of a model, in parameters (not bytes).

    Per-kind fields sum over the main model's layers; `mtp` holds the MTP modules apart.

    Convention for `activated` (the one most DeepSeek figures follow): every parameter a token of
    the main model touches, counting the whole embedding table and the output head, all norms, the
    router, the shared experts and only the top-k routed experts; MTP modules are excluded (they
    are a training objective, dropped or used for speculative decoding at inference). Counting
    the embedding and head makes a dense model's `activated` equal its total and reproduces
    DeepSeekMoE-16B's 2.8B (which the DeepSeekMoE paper sets beside LLaMA2-7B's full 6.7B),
    DeepSeek-V2's 21B (21.4B) and DeepSeek-V3's 37B (37.55B; the quotes look truncated).
    DeepSeek-V2-Lite's published 2.4B is NOT reproduced by this convention (2.66B); see
    deepseek-ai/DeepSeek-V2 issue #73, where the same 2.6B was computed and left unanswered.
    """

    total: int  # main model + MTP modules: what optimizer state and checkpoints must hold
    main_model_total: int  # the "671B" of DeepSeek-V3
    activated: int
    embedding: int
    head: int
    attention: int
    dense_ffn: int
    routed_experts: int
    activated_routed_experts: int
    shared_experts: int
    router: int
    norms: int  # every RMSNorm weight of the main model, the final norm included
    mtp: int  # all MTP modules, without the shared embedding and head
    mtp_activated: int  # the MTP parameters one token touches (top-k experts only)

    @property
    def activated_non_embedding(self) -> int:
        """`activated` without the embedding table: the lookup is not a matmul, the head is."""
        return self.activated - self.embedding


def _mla_params(args: ModelArgs) -> int:
    """MLA projections (DeepSeek-V2 report, sec. 2.1): low-rank query, shared KV latent, output."""
    d, h = args.dim, args.num_heads
    qk_head_dim = args.qk_nope_head_dim + args.qk_rope_head_dim
    if args.q_lora_rank > 0:
        query = args.q_lora_rank * d + h * qk_head_dim * args.q_lora_rank  # wq_a, wq_b
    else:
        query = h * qk_head_dim * d  # wq
    wkv_a = (args.kv_lora_rank + args.qk_rope_head_dim) * d
    wkv_b = h * (args.qk_nope_head_dim + args.v_head_dim) * args.kv_lora_rank
    wo = d * h * args.v_head_dim
    return query + wkv_a + wkv_b + wo


def _mha_params(args: ModelArgs) -> int:
    head_dim = args.head_dim or args.dim // args.num_heads
    q_width = args.num_heads * head_dim
    kv_width = args.kv_heads * head_dim
    return 2 * q_width * args.dim + 2 * kv_width * args.dim  # wq, wo; wk, wv


def _attention_params(args: ModelArgs) -> int:
    return _mla_params(args) if args.attention == "mla" else _mha_params(args)


def _block_norm_params(args: ModelArgs) -> int:
    """attention_norm and ffn_norm, plus MLA's q_norm (only with a query LoRA) and kv_norm."""
    norms = 2 * args.dim
    if args.attention == "mla":
        norms += args.kv_lora_rank + args.q_lora_rank  # q_lora_rank == 0: no q_norm
    return norms


def _block(args: ModelArgs, *, moe: bool) -> _Block:
    """A layer with the dense FFN (`moe=False`) or with DeepSeekMoE (`moe=True`)."""
    expert = 3 * args.dim * args.moe_inter_dim  # every expert is a SwiGLU: w1, w3, w2
    dense_mats = 3 if args.mlp == "swiglu" else 2
    return _Block(
        attention=_attention_params(args),
        norms=_block_norm_params(args),
        dense_ffn=0 if moe else dense_mats * args.dim * args.inter_dim,
        routed_experts=args.num_routed_experts * expert if moe else 0,
        activated_routed_experts=args.num_activated_experts * expert if moe else 0,
        # The shared experts are one SwiGLU num_shared_experts times as wide: the same count.
        shared_experts=args.num_shared_experts * expert if moe else 0,
        router=args.num_routed_experts * args.dim if moe else 0,
    )


def block_params(args: ModelArgs, *, moe: bool) -> _Block:
    """One main-model layer's parameters by kind (the planner places them on ranks)."""
    return _block(args, moe=moe)


@dataclass(frozen=True)
class MtpModuleParams:
    block: _Block
    own: int  # its norms and its projection M_k


def mtp_module_params(args: ModelArgs) -> MtpModuleParams:
    """One MTP module's parameters, without the embedding and head it shares."""
    norms, proj = _mtp_own_params(args)
    return MtpModuleParams(_mtp_block(args), norms + proj)


def _num_moe_layers(args: ModelArgs) -> int:
    return args.num_layers - args.first_k_dense if args.num_routed_experts > 0 else 0


def _mtp_block(args: ModelArgs) -> _Block:
    """An MTP module's block has the shapes of a main-model layer past `first_k_dense`."""
    return _block(args, moe=args.num_routed_experts > 0)


def _mtp_own_params(args: ModelArgs) -> tuple[int, int]:
    """(norms, proj) of one MTP module besides its block.

    Norms: enorm, hnorm and the output norm before the shared head (HF `shared_head.norm`, which
    `dstrain/model/transformer.py` builds too); proj: M_k [D, 2D] (DeepSeek-V3 report, sec. 2.2).
    """
    return 3 * args.dim, 2 * args.dim * args.dim


def _sum_layers(args: ModelArgs) -> _Block:
    dense, moe = _block(args, moe=False), _block(args, moe=True)
    num_moe = _num_moe_layers(args)
    num_dense = args.num_layers - num_moe
    return _Block(
        **{
            f.name: num_dense * getattr(dense, f.name) + num_moe * getattr(moe, f.name)
            for f in fields(_Block)
        }
    )


def param_counts(args: ModelArgs) -> ParamCounts:
    """Parameters of the model built from `args`, by kind; see ParamCounts for the conventions.

    Counts trainable parameters only: MoE routers' load-balancing bias is a buffer, not counted.
    """
    layers = _sum_layers(args)
    embedding = head = args.vocab_size * args.dim
    final_norm = args.dim
    main_total = embedding + head + final_norm + layers.total
    mtp_norms, mtp_proj = _mtp_own_params(args)
    mtp_block = _mtp_block(args)
    num_mtp = args.num_mtp_modules
    return ParamCounts(
        total=main_total + num_mtp * (mtp_block.total + mtp_norms + mtp_proj),
        main_model_total=main_total,
        activated=embedding + head + final_norm + layers.activated,
        embedding=embedding,
        head=head,
        attention=layers.attention,
        dense_ffn=layers.dense_ffn,
        routed_experts=layers.routed_experts,
        activated_routed_experts=layers.activated_routed_experts,
        shared_experts=layers.shared_experts,
        router=layers.router,
        norms=layers.norms + final_norm,
        mtp=num_mtp * (mtp_block.total + mtp_norms + mtp_proj),
        mtp_activated=num_mtp * (mtp_block.activated + mtp_norms + mtp_proj),
    )


def score_head_dims(args: ModelArgs) -> tuple[int, int]:
    """(query/key, value) width per head in the score and value products (the planner's too)."""
    if args.attention == "mla":
        return args.qk_nope_head_dim + args.qk_rope_head_dim, args.v_head_dim
    head_dim = args.head_dim or args.dim // args.num_heads
    return head_dim, head_dim


def attention_forward_flops_per_token(args: ModelArgs, seq_len: int) -> float:
    """Forward FLOPs per token of the attention scores (QK^T) and the weighted values (AV).

    Per layer and token: 2 * H * (d_qk + d_v) * context, with context = seq_len / 2, the average
    over a causal sequence (exactly (seq_len + 1) / 2; we drop the +1, as FlashAttention's causal
    FLOP count does). d_qk = qk_nope + qk_rope and d_v = v_head_dim for MLA; head_dim for MHA (GQA
    shares K/V heads but every query head still does its products). PaLM (arXiv 2204.02311,
    appendix B: 6N + 12*L*H*Q*T) and DeepSeek LLM (arXiv 2401.02954, sec. 3.1: M = 72*n_layer*
    d_model^2 + 12*n_layer*d_model*l_seq) count the full, non-causal square: twice this term. Each
    MTP module's block attends too, so it adds one layer's worth per module.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len={seq_len} must be at least 1")
    qk_dim, v_dim = score_head_dims(args)
    per_layer = 2 * args.num_heads * (qk_dim + v_dim) * (seq_len / 2)
    return per_layer * (args.num_layers + args.num_mtp_modules)


def matmul_params_per_token(args: ModelArgs) -> int:
    """Weights one token multiplies by in a training step: the "N" of 2N forward FLOPs.

    Main model: attention projections, dense FFN, the top-k routed and the shared experts, the
    router (it scores every routed expert) and the output head; not the embedding (a lookup) nor
    the norms (elementwise). Each MTP module adds its block, its proj, and one more application of
    the shared head (DeepSeek-V3 report, sec. 2.2: every module has its own output prediction).
    MTP module k sees seq_len - k positions; counting seq_len over-counts by k / seq_len.
    """
    main = _sum_layers(args).matmul_per_token + args.vocab_size * args.dim
    _, mtp_proj = _mtp_own_params(args)
    mtp_module = _mtp_block(args).matmul_per_token + mtp_proj + args.vocab_size * args.dim
    return main + args.num_mtp_modules * mtp_module


def forward_flops_per_token(args: ModelArgs, seq_len: int) -> float:
    """Model FLOPs of one forward pass per token: 2 * matmul params + causal attention.

    2 FLOPs per multiply-add (Kaplan et al., arXiv 2001.08361, sec. 2.1: C_forward ~ 2N). These are
    model FLOPs (PaLM, arXiv 2204.02311, appendix B: MFU, not HFU): activation recomputation is not
    counted, nor softmax, norms, RoPE or the routing top-k.
    """
    return 2 * matmul_params_per_token(args) + attention_forward_flops_per_token(args, seq_len)


def training_flops_per_token(args: ModelArgs, seq_len: int) -> float:
    """Model FLOPs of forward + backward per token: 3x the forward.

    The backward does two matmuls per forward matmul (gradients of the input and of the weight),
    for both the weights and the attention products: 6N + attention (Kaplan et al. sec. 2.1; PaLM
    appendix B), with attention halved for causality (see attention_forward_flops_per_token).
    Megatron-LM's 96*B*s*l*h^2*(1 + s/6h + V/16lh) (Narayanan et al., arXiv 2104.04473) is 4x the
    forward because it also counts the recomputed forward; we do not. MFU = this * tokens/s / peak.
    """
    return 3 * forward_flops_per_token(args, seq_len)


def _human(count: float) -> str:
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if count >= scale:
            return f"{count / scale:.1f}{suffix}"
    return f"{count:.0f}"


def describe(counts: ParamCounts) -> str:
    """One line for the start-up log, e.g. "671.0B total, 37.6B activated (+11.6B MTP)"."""
    text = f"{_human(counts.main_model_total)} total, {_human(counts.activated)} activated"
    if counts.mtp:
        text += f" (+{_human(counts.mtp)} MTP)"
    return text


def stage_forward_flops_per_token(
    args: ModelArgs, seq_len: int, layers: range, *, last: bool
) -> float:
    """Forward FLOPs per token of one pipeline stage: its blocks, and on the last stage the head
    and the MTP modules (the same conventions as `forward_flops_per_token`; the embedding is a
    lookup and costs nothing here). Balances the pipeline's default split."""
    dense, moe = _block(args, moe=False), _block(args, moe=True)
    is_moe = args.num_routed_experts > 0
    qk_dim, v_dim = score_head_dims(args)
    scores = 2 * args.num_heads * (qk_dim + v_dim) * (seq_len / 2)
    flops = sum(
        2 * (moe if is_moe and i >= args.first_k_dense else dense).matmul_per_token + scores
        for i in layers
    )
    if last:
        _, mtp_proj = _mtp_own_params(args)
        mtp_module = _mtp_block(args).matmul_per_token + mtp_proj + args.vocab_size * args.dim
        flops += 2 * (args.vocab_size * args.dim + args.num_mtp_modules * mtp_module)
        flops += args.num_mtp_modules * scores
    return flops
