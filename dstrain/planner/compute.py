"""Compute time of one micro-batch on one pipeline rank, from its matmuls and memory traffic.

Each matmul (M x K times K x N, 16-bit) takes the roofline time (Williams et al. 2009):

    max(2 M K N / (peak x gemm_efficiency), 2 (M K + K N + M N) / (HBM bandwidth x mem_efficiency))

so small matmuls (a thin micro-batch, an expert that receives few tokens) are memory-bound and
run far below peak: matmul size matters. `gemm_efficiency` is the share of the datasheet peak
that large cuBLAS matmuls reach (about 0.7-0.8 on A100/H100 in NVIDIA's published GEMM
benchmarks; 0.75 here, fitted by `dstrain plan --calibrate`). Backward runs two matmuls per
forward matmul (input and weight gradients: Kaplan et al. 2020, sec. 2.1).

Attention's score and value products run in a fused kernel (FlashAttention, Dao 2023) at
`attention_efficiency` of peak (FlashAttention-2 reports 50-73% on A100), its backward at 2.5x
the forward's FLOPs (it recomputes the scores). Norms, RoPE, activations, residual adds and the
MoE permutation are memory-bound: their traffic per token and layer is about ELEMENTWISE_PASSES
passes over a hidden-size tensor (and top-k for the routed copies), at HBM bandwidth; so is the
cross-entropy over the vocabulary (LOSS_BYTES_PER_LOGIT per logit), and an unfused attention's
pass over its scores (UNFUSED_SCORE_TRAFFIC each). Every layer
also pays a fixed launch cost (kernels x a few microseconds).

FP8 (`precision = fp8`) is what the trainer runs (model/fp8.py, DeepSeek-V3's recipe): the
attention projections, dense and shared-expert SwiGLUs, routed experts and MTP projection at the
FP8 peak, their operands read in 1 byte plus the online quantisation of each input (read 2 bytes,
write 1); the router, the output head and attention's fused kernel at the bf16 peak.

Recompute (`selective`, which in the trainer checkpoints attention and the FFN, and `full`) runs
the forward again in backward.
"""

from dataclasses import dataclass

from dstrain.config.model_args import ModelArgs
from dstrain.model.flops import score_head_dims
from dstrain.planner.layout import Cluster, Layout
from dstrain.planner.memo import per_model
from dstrain.planner.memory import GRAD_BYTES, MASTER_BYTES, moment_bytes
from dstrain.planner.shape import RankShape

ELEMENTWISE_PASSES = 16  # reads and writes of a hidden-size tensor per layer, per token
# The eager cross-entropy over logits upcast to fp32 (`train/loss.py`; torchtitan's and
# Megatron-LM's vocab-parallel one are alike), bytes moved per logit. Forward: read the 16-bit
# logits and write them in fp32 (2 + 4), the log-softmax's max and sum passes and its output
# (4 + 4 + 4 + 4). Backward: the loss's dense gradient (4), the log-softmax's backward (read 4 + 4,
# write 4) and the cast back to 16 bits (4 + 2). About 20 each way; the backward is counted as
# the forward's size again (`_stage_times`), so the forward carries 20.
LOSS_BYTES_PER_LOGIT = 20
# An unfused attention (`layout.attention = "unfused"`: Megatron-LM's fused scale-mask-softmax
# between two batched GEMMs, no FlashAttention) writes the full s x s scores in 16 bits and passes
# over them, bytes per score in the forward: QK^T's output (2), the softmax (read 2, write 2),
# dropout (read 2, write 2, its mask 1) and PV's read (2). Its two GEMMs run at GEMM speed over
# the whole square (no causal skipping); backward counts both again, as for any matmul.
UNFUSED_SCORE_TRAFFIC = 13


@dataclass(frozen=True)
class ComputeConstants:
    gemm_efficiency: float = 0.75
    attention_efficiency: float = 0.5
    memory_efficiency: float = 0.8  # share of HBM bandwidth streaming kernels reach
    layer_overhead_s: float = 40 * 4e-6  # per layer and pass: ~40 kernel launches of ~4 us


@dataclass(frozen=True)
class StageTimes:
    """Seconds of one micro-batch on one rank: forward, input-gradient and weight-gradient
    backward (recompute included in the input-gradient part); `shared_forward`: of the forward,
    the shared experts' (what `parallel.ep_overlap` runs under the dispatch all-to-all)."""

    forward: float
    backward: float
    weight: float
    shared_forward: float = 0.0

    @property
    def total(self) -> float:
        return self.forward + self.backward + self.weight


def stage_times(
    args: ModelArgs,
    layout: Layout,
    cluster: Cluster,
    shape: RankShape,
    consts: ComputeConstants | None = None,
) -> StageTimes:
    """Cached on what the times depend on (the search asks for the same stage many times,
    with only ZeRO, the schedule or the batch count changed)."""
    key = (
        layout.tp,
        layout.ep,
        layout.cp,
        layout.micro_batch,
        layout.seq_len,
        layout.recompute,
        layout.precision,
        layout.sequence_parallel,
        layout.moe_tp,
        layout.attention,
    )
    return _stage_times(args, key, cluster, shape, consts or ComputeConstants())


@per_model
def _stage_times(
    args: ModelArgs, key: tuple, cluster: Cluster, shape: RankShape, consts: ComputeConstants
) -> StageTimes:
    tp, ep, cp, mb, seq, recompute, precision, sp, moe_tp, attention = key
    layout = Layout(
        dp=1,
        tp=tp,
        ep=ep,
        cp=cp,
        micro_batch=mb,
        seq_len=seq,
        recompute=recompute,
        precision=precision,
        sequence_parallel=sp,
        moe_tp=moe_tp,
        attention=attention,
    )
    chip = _Chip(cluster, layout.precision, consts)
    tokens = layout.micro_batch * layout.seq_len / layout.cp
    dense = _layer(args, layout, chip, tokens, moe=False)
    moe = _layer(args, layout, chip, tokens, moe=True) if shape.moe_layers else (0.0, 0.0)
    forward = shape.dense_layers * dense[0] + shape.moe_layers * moe[0]
    attention = shape.dense_layers * dense[1] + shape.moe_layers * moe[1]
    if shape.has_head:
        head, head_attention = _head(args, layout, chip, tokens)
        forward += head
        attention += head_attention
    gemm_forward = forward - attention
    recompute = forward if layout.recompute != "none" else 0.0
    width = args.num_shared_experts * args.moe_inter_dim
    shared = shape.moe_layers * _swiglu(args, chip, tokens, width, layout.tp) if width else 0.0
    # Backward: one more matmul of the forward's size each for input and weight gradients;
    # attention's backward (input side) at 2.5x its forward.
    backward = gemm_forward + 2.5 * attention + recompute
    return StageTimes(forward, backward, gemm_forward, shared)


class _Chip:
    def __init__(self, cluster: Cluster, precision: str, consts: ComputeConstants) -> None:
        gpu = cluster.gpu
        self.fp8 = precision == "fp8"
        self.peak = gpu.peak_tflops(precision) * 1e12  # the recipe's GEMMs (all, unless fp8)
        self.peak16 = gpu.peak_tflops("bf16") * 1e12 if self.fp8 else self.peak
        self.hbm = gpu.hbm_tbps * 1e12 * consts.memory_efficiency
        self.consts = consts

    def gemm(
        self, m: float, k: float, n: float, count: float = 1.0, *, recipe: bool = True
    ) -> float:
        """`recipe`: a GEMM the FP8 recipe covers (False: the router and the head, bf16)."""
        flops = 2 * m * k * n
        if self.fp8 and recipe:
            # E4M3 operands (1 byte), bf16 output, and quantising both inputs (2 in, 1 out).
            peak, traffic = self.peak, (m * k + k * n) * (1 + 3) + 2 * m * n
        else:
            peak, traffic = self.peak16, 2 * (m * k + k * n + m * n)
        return count * max(flops / (peak * self.consts.gemm_efficiency), traffic / self.hbm)

    def matmul(self, flops: float) -> float:
        """Compute-bound 16-bit GEMM FLOPs (batched products whose traffic is counted apart)."""
        return flops / (self.peak16 * self.consts.gemm_efficiency)

    def attention(self, flops: float) -> float:
        return flops / (self.peak16 * self.consts.attention_efficiency)

    def stream(self, nbytes: float) -> float:
        return nbytes / self.hbm


def optimizer_seconds(
    params: float, layout: Layout, cluster: Cluster, consts: ComputeConstants | None = None
) -> float:
    """AdamW's step over the `params` this rank updates: memory-bound, it reads the fp32 weights,
    gradients and both moments and writes the weights and moments once."""
    state = MASTER_BYTES + moment_bytes(layout.adam_moments)
    chip = _Chip(cluster, layout.precision, consts or ComputeConstants())
    return chip.stream(params * (GRAD_BYTES + 2 * state))


def _layer(
    args: ModelArgs, layout: Layout, chip: _Chip, tokens: float, *, moe: bool
) -> tuple[float, float]:
    """(forward seconds, of which attention's fused kernel) of one layer."""
    tp, d = layout.tp, args.dim
    projections = sum(chip.gemm(tokens, k, n / s) for k, n, s in _attention_matmuls(args, tp))
    qk, v = score_head_dims(args)
    heads = args.num_heads / tp
    if layout.attention == "unfused":
        scores = tokens * heads * layout.seq_len
        unfused = chip.matmul(2 * scores * (qk + v)) + chip.stream(UNFUSED_SCORE_TRAFFIC * scores)
        attention, projections = 0.0, projections + unfused
    else:
        context = layout.seq_len / 2  # causal: half the scores on average
        attention = chip.attention(2 * tokens * heads * (qk + v) * context)
    ffn = (
        _moe(args, layout, chip, tokens) if moe else _swiglu(args, chip, tokens, args.inter_dim, tp)
    )
    passes = ELEMENTWISE_PASSES + (4 * args.num_activated_experts if moe else 0)
    stream = chip.stream(passes * tokens * 2 * d / (tp if layout.sequence_parallel else 1))
    return projections + attention + ffn + stream + chip.consts.layer_overhead_s, attention


def _attention_matmuls(args: ModelArgs, tp: int) -> list[tuple[float, float, float]]:
    """(K, N, split) of each projection: split = tp for the head-parallel ones."""
    d, h = args.dim, args.num_heads
    if args.attention == "mla":
        qk = args.qk_nope_head_dim + args.qk_rope_head_dim
        query = (
            [(d, args.q_lora_rank, 1), (args.q_lora_rank, h * qk, tp)]
            if args.q_lora_rank
            else [(d, h * qk, tp)]
        )
        kv = [
            (d, args.kv_lora_rank + args.qk_rope_head_dim, 1),
            (args.kv_lora_rank, h * (args.qk_nope_head_dim + args.v_head_dim), tp),
        ]
        return [*query, *kv, (h * args.v_head_dim, d, tp)]
    head_dim, _ = score_head_dims(args)
    return [
        (d, h * head_dim, tp),
        (d, 2 * args.kv_heads * head_dim, tp),
        (h * head_dim, d, tp),
    ]


def _swiglu(args: ModelArgs, chip: _Chip, tokens: float, width: float, tp: int) -> float:
    ups = 2 if args.mlp == "swiglu" else 1
    return chip.gemm(tokens, args.dim, width / tp, ups) + chip.gemm(tokens, width / tp, args.dim)


def _moe(args: ModelArgs, layout: Layout, chip: _Chip, tokens: float) -> float:
    """Router, shared experts (tp-split) and this rank's routed experts: the rank routes its
    share of the tokens (1 / tp of them under moe_tp = split_tokens, all under repeat) and
    receives about as many x top-k routed copies (balanced), spread over its E / ep experts."""
    routed_tokens = tokens / layout.routed_split
    router = chip.gemm(routed_tokens, args.dim, args.num_routed_experts, recipe=False)
    width = args.num_shared_experts * args.moe_inter_dim
    shared = _swiglu(args, chip, tokens, width, layout.tp) if width else 0.0
    local_experts = args.num_routed_experts / layout.ep
    per_expert = routed_tokens * args.num_activated_experts / local_experts
    inter = args.moe_inter_dim
    routed = chip.gemm(per_expert, args.dim, inter, 2 * local_experts) + chip.gemm(
        per_expert, inter, args.dim, local_experts
    )
    return router + shared + routed


def _head(args: ModelArgs, layout: Layout, chip: _Chip, tokens: float) -> tuple[float, float]:
    """The output head over this rank's vocabulary shard, and each MTP module (its projection,
    block and another head application)."""
    head = chip.gemm(tokens, args.dim, args.vocab_size / layout.tp, recipe=False)
    head += chip.stream(LOSS_BYTES_PER_LOGIT * tokens * args.vocab_size / layout.tp)
    if not args.num_mtp_modules:
        return head, 0.0
    block, attention = _layer(args, layout, chip, tokens, moe=args.num_routed_experts > 0)
    proj = chip.gemm(tokens, 2 * args.dim, args.dim)
    return head + args.num_mtp_modules * (block + proj + head), args.num_mtp_modules * attention
