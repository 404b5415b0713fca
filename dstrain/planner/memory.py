"""Memory per GPU of a layout: model states (ZeRO), activations (per schedule), overheads.

Model states, per parameter (ZeRO paper, Rajbhandari et al. 2020, sec. 3.1, mixed-precision
Adam): 2 bytes of 16-bit weights, 2 of 16-bit gradients and K = 12 of optimizer state (fp32
master weights, momentum and variance), 16 bytes in all. ZeRO-1 shards the 12 over the N_d
data-parallel ranks, ZeRO-2 also the gradients, ZeRO-3 also the weights:

    ZeRO-0  (2 + 2 + 12) P        ZeRO-2  2P + (2 + 12) P / N_d
    ZeRO-1  (2 + 2) P + 12 P / N_d    ZeRO-3  16 P / N_d

(7.5B parameters on 64 GPUs: 120, 31.4, 16.6 and 1.9 GB, the paper's Figure 1.) Dense parameters
shard over dp x cp (the trainer's FSDP mesh), routed experts over their own data-parallel ranks
(dp x cp x tp / ep). `offload` keeps the optimizer's 12 bytes in host memory. fp8 training keeps
16-bit weights and adds no state here (per-tensor scales are negligible).

Activations: the tensors each layer saves for backward, counted per token in the manner of
Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", sec.
4.1), for MLA, SwiGLU and DeepSeekMoE with FlashAttention (no s x s score matrix is stored: only
q, k, v, the output and the log-sum-exp). Tensor parallelism divides the head- and FFN-sharded
tensors by tp; sequence parallelism also the hidden-size ones (norm inputs, residual). Recompute:
`selective` keeps only the inputs of attention and of the FFN (the trainer checkpoints those two),
`full` only the block input; the layer being recomputed holds its full activations once.

In flight on the busiest rank, in micro-batches of its own layers (m micro-batches per step):
gpipe m; 1f1b p (Narayanan et al. 2021); interleaved-1f1b p (1 + (p-1)/(p v)) (Korthikanti et
al. 2022, sec. 4.2.3); zbv p, the 1F1B peak (Qi et al. 2024, ZB-V); dualpipev p + 1 (DeepSeek-V3
report, Table 2: DualPipe's activation column, PP + 1). Never more than m.

MoE: the routed copies of the tokens are counted top-k times, times a routing-imbalance headroom
(the busiest expert rank receives more than the mean; 1.25, GShard's usual capacity factor).
Logits: the head's output and its gradient in fp32 over the vocabulary shard, on the last stage,
for the main head and each MTP module, with the MTP blocks: one micro-batch's worth, since the
last stage runs a micro-batch's backward right after its forward under every schedule.

Overhead: CUDA context, NCCL buffers and cuBLAS workspaces (a fixed 3 GiB), plus allocator
fragmentation (10% of activations); ZeRO-3 also holds the largest layer gathered twice
(the current one and the prefetched one).
"""

from dataclasses import asdict, dataclass

from dstrain.config.model_args import ModelArgs
from dstrain.model.flops import score_head_dims
from dstrain.planner.layout import Cluster, Layout
from dstrain.planner.memo import per_model
from dstrain.planner.shape import RankShape, rank_shapes

GiB = 2**30
WEIGHT_BYTES = 2
GRAD_BYTES = 2
OPTIMIZER_BYTES = 12
ROUTING_HEADROOM = 1.25
FIXED_OVERHEAD_BYTES = 3 * GiB
FRAGMENTATION = 0.10


@dataclass(frozen=True)
class Memory:
    """Bytes per GPU on the busiest pipeline rank, by part."""

    weights: float
    gradients: float
    optimizer: float
    activations: float
    overhead: float
    rank: int  # the pipeline rank it is

    @property
    def model_states(self) -> float:
        return self.weights + self.gradients + self.optimizer

    @property
    def peak(self) -> float:
        return self.model_states + self.activations + self.overhead

    def to_json(self) -> dict[str, float]:
        parts = asdict(self)
        rank = parts.pop("rank")
        gib = {k: v / GiB for k, v in parts.items()}
        return {
            "peak": self.peak / GiB,
            **gib,
            "model_states": self.model_states / GiB,
            "pipeline_rank": rank,
        }


def state_bytes(precision: str, moments: str = "fp32") -> tuple[int, int, int]:
    """(weight, gradient, optimizer) bytes per parameter: mixed precision keeps 16-bit weights
    and gradients and fp32 master weights + Adam moments (2, 2, 12); fp32 training has no
    master copy: fp32 weights and gradients and the two moments (4, 4, 8). bf16 moments (as
    DeepSeek-V3 keeps them, report sec. 3.3.3) save 4 bytes of the 12 (or 8)."""
    saved = 4 if moments == "bf16" else 0
    if precision == "fp32":
        return 4, 4, 8 - saved
    return WEIGHT_BYTES, GRAD_BYTES, OPTIMIZER_BYTES - saved


def model_state_bytes(
    params: float,
    zero: int,
    shard: int,
    offload: bool,
    precision: str = "bf16",
    moments: str = "fp32",
) -> tuple[float, ...]:
    """(weights, gradients, optimizer) bytes of `params` parameters sharded over `shard` ranks."""
    weight, grad, state = state_bytes(precision, moments)
    weights = weight * params / (shard if zero >= 3 else 1)
    grads = grad * params / (shard if zero >= 2 else 1)
    optimizer = 0.0 if offload else state * params / (shard if zero >= 1 else 1)
    return weights, grads, optimizer


def memory_per_gpu(args: ModelArgs, layout: Layout, cluster: Cluster | None = None) -> Memory:
    """The busiest pipeline rank's memory (the first, last and second ranks are compared)."""
    return max(
        (_rank_memory(args, layout, shape) for shape in rank_shapes(args, layout)),
        key=lambda m: m.peak,
    )


def resting_model_states(args: ModelArgs, layout: Layout) -> float:
    """Model states between steps on the rank holding the most, what the trainer's
    memory/model_states_mb counts (max over ranks): ZeRO-2's gathered weights are sharded again
    by then (FSDP2 reshards after backward), so its weights count sharded."""
    best = 0.0
    for shape in rank_shapes(args, layout):
        m = _rank_memory(args, layout, shape)
        weights = m.weights / (layout.dp * layout.cp) if layout.zero == 2 else m.weights
        best = max(best, weights + m.gradients + m.optimizer)
    return best


def _rank_memory(args: ModelArgs, layout: Layout, shape: RankShape) -> Memory:
    dense = model_state_bytes(
        shape.dense_params,
        layout.zero,
        layout.dp * layout.cp,
        layout.offload,
        layout.precision,
        layout.adam_moments,
    )
    experts = model_state_bytes(
        shape.expert_params,
        layout.zero,
        layout.expert_shard,
        layout.offload,
        layout.precision,
        layout.adam_moments,
    )
    weights, grads, optimizer = (d + e for d, e in zip(dense, experts, strict=True))
    activations = activation_bytes(args, layout, shape)
    overhead = FIXED_OVERHEAD_BYTES + FRAGMENTATION * activations
    if layout.zero >= 3:
        overhead += 2 * WEIGHT_BYTES * _largest_layer_params(shape)
    return Memory(weights, grads, optimizer, activations, overhead, shape.rank)


def activation_bytes(args: ModelArgs, layout: Layout, shape: RankShape) -> float:
    tokens = layout.micro_batch * layout.seq_len / layout.cp
    dense_layer = layer_bytes_per_token(args, layout, moe=False)
    moe_layer = layer_bytes_per_token(args, layout, moe=True)
    per_microbatch = tokens * (shape.dense_layers * dense_layer + shape.moe_layers * moe_layer)
    if shape.has_embedding:
        per_microbatch += tokens * 2 * args.dim / _sp(layout)
    resident = per_microbatch * in_flight(layout)
    if shape.has_head:  # the last stage runs each micro-batch's backward right after its forward
        resident += tokens * _head_bytes_per_token(args, layout)
    if layout.recompute != "none":  # the layer being recomputed, at full size
        full = layout.with_(recompute="none")
        biggest = max(
            layer_bytes_per_token(args, full, moe=m) for m in (False, shape.moe_layers > 0)
        )
        resident += tokens * biggest
    return resident


def in_flight(layout: Layout) -> float:
    """Micro-batches whose activations the busiest (first) rank holds at the peak."""
    p, m, v = layout.pp, layout.microbatches, layout.virtual_stages
    held = {
        "gpipe": m,
        "1f1b": p,
        "interleaved-1f1b": p * (1 + (p - 1) / (p * v)),
        "zbv": p,
        "dualpipev": p + 1,
    }[layout.schedule]
    return min(held, max(m, 1)) if p > 1 else 1


def layer_bytes_per_token(args: ModelArgs, layout: Layout, *, moe: bool) -> float:
    """Bytes one layer saves for backward per token, 16-bit activations."""
    return _layer_bytes(args, layout, layout.recompute, moe)


def _layer_bytes(args: ModelArgs, layout: Layout, recompute: str, moe: bool) -> float:
    return _cached_layer_bytes(args, layout.tp, layout.sequence_parallel, recompute, moe)


@per_model
def _cached_layer_bytes(args: ModelArgs, tp: int, sp: bool, recompute: str, moe: bool) -> float:
    hidden = 2 * args.dim / (tp if sp else 1)  # one hidden-size tensor
    if recompute == "full":
        return hidden
    if recompute == "selective":
        return 3 * hidden  # the block input, and the inputs of attention and of the FFN
    attention = _attention_bytes(args, tp)
    ffn = _moe_bytes(args, tp) if moe else _dense_ffn_bytes(args, args.inter_dim, tp)
    return 4 * hidden + attention + ffn  # the block input, norm inputs and outputs


def _sp(layout: Layout) -> int:
    return layout.tp if layout.sequence_parallel else 1


def _attention_bytes(args: ModelArgs, tp: int) -> float:
    """MLA: the latents (replicated across tp) and the per-head tensors (split): q, k, v as the
    attention kernel keeps them, the up-projections' outputs, the output and its log-sum-exp."""
    heads = args.num_heads / tp
    if args.attention == "mla":
        qk = args.qk_nope_head_dim + args.qk_rope_head_dim
        latents = 2 * args.q_lora_rank + 2 * args.kv_lora_rank + args.qk_rope_head_dim
        per_head = 3 * qk + (args.qk_nope_head_dim + args.v_head_dim) + 2 * args.v_head_dim
    else:
        head_dim, _ = score_head_dims(args)
        latents = 0
        kv_share = args.kv_heads / args.num_heads
        per_head = head_dim * (1 + 2 * kv_share) + 2 * head_dim
    return 2 * (latents + heads * per_head) + 4 * heads  # + fp32 log-sum-exp per head


def _dense_ffn_bytes(args: ModelArgs, width: float, tp: int) -> float:
    """SwiGLU: w1 and w3 outputs, the activation and the product (w2's input); GELU: the up
    projection's output and the activation."""
    tensors = 4 if args.mlp == "swiglu" else 2
    return 2 * tensors * width / tp


def _moe_bytes(args: ModelArgs, tp: int) -> float:
    """Router scores (fp32), each routed copy's input, expert intermediates and output, times
    the routing headroom; the shared experts like a dense FFN split over tp."""
    k = args.num_activated_experts
    routed = (
        k * ROUTING_HEADROOM * (2 * 2 * args.dim + _dense_ffn_bytes(args, args.moe_inter_dim, 1))
    )
    shared = _dense_ffn_bytes(args, args.num_shared_experts * args.moe_inter_dim, tp)
    return 4 * args.num_routed_experts + routed + shared


def _head_bytes_per_token(args: ModelArgs, layout: Layout) -> float:
    """fp32 logits and their gradient over this rank's vocabulary shard, for the main head and
    every MTP module, plus each MTP module's block."""
    heads = 1 + args.num_mtp_modules
    logits = heads * 2 * 4 * args.vocab_size / layout.tp
    mtp_blocks = args.num_mtp_modules * layer_bytes_per_token(args, layout, moe=True)
    return logits + mtp_blocks


def _largest_layer_params(shape: RankShape) -> float:
    return (shape.dense_params + shape.expert_params) / max(shape.layers, 1)
