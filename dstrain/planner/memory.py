"""Memory per GPU of a layout: model states (ZeRO), activations (per schedule), overheads.

Model states as dstrain's runtime holds them (`dstrain/parallel/state_bytes.py` counts the same
from a built runtime, and `dstrain train --dry-run` reports it), per parameter P over the S ranks
that shard it, w = 2 bytes of gathered bf16 weights (4 under fp32 and fp16, which train fp32
weights under autocast), fp32 master weights and gradients (Megatron's distributed optimizer;
DeepSeek-V3 report sec. 3.3.3), K = 8 bytes of Adam moments (4 in bf16):

    ZeRO-0 (DDP)   4P + 4P + K P
    ZeRO-1         (4P/S + w P) + 4P + K P/S      weights gathered once per step, gradients
                                                   accumulated unsharded and reduced once
    ZeRO-2         (4P/S + w P) + 4P/S + K P/S    (under PP as ZeRO-1: the stages defer the sync)
    ZeRO-3         4P/S + 4P/S + K P/S            (+ the largest layer gathered twice: overhead;
                                                   under PP as ZeRO-2: upstream's pipelining
                                                   keeps the modules unsharded, as torchtitan)

Offload keeps the sharded master weights, gradients and moments in host memory. The ZeRO
paper's own accounting (Rajbhandari et al. 2020, sec. 3.1: 2 + 2 + 12 bytes, fp16 gradients) is
`paper_model_states`; it reproduces the paper's Figure 1 (7.5B parameters on 64 GPUs: 120, 31.4,
16.6 and 1.9 GB), and differs from the runtime's by the fp32 gradients (and, at ZeRO-3, nothing).
Dense parameters shard over dp x cp (the trainer's FSDP mesh), routed experts over their own
data-parallel ranks (dp x cp x tp / ep); under offload the trainer keeps expert-parallel experts
out of FSDP2, so they count as under DDP. fp8 (the trainer's recipe, model/fp8.py) keeps fp32 master
weights, gathers bf16 copies and saves its GEMM inputs in bf16, so its states and activations are
bf16's here: the E4M3 copies live only inside each GEMM, and the 1x128 / 128x128 scales are
1/128 and 1/16384 of a tensor.

Activations: the tensors each layer saves for backward, counted per token in the manner of
Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", sec.
4.1), for MLA, SwiGLU and DeepSeekMoE with FlashAttention (no s x s score matrix is stored: only
q, k, v, the output and the log-sum-exp). `Layout.attention = "unfused"` adds Korthikanti's
5 a s bytes per token and layer (the softmax output, 2 bytes, its dropout mask, 1, and the
dropout's output, 2, for every score), which selective and full recompute drop. Tensor
parallelism divides the head- and FFN-sharded tensors by tp; sequence parallelism also the
hidden-size ones (norm inputs, residual). Recompute: `selective` keeps only the inputs of
attention and of the FFN (the trainer checkpoints those two), `full` only the block input; the
layer being recomputed holds its full activations once (after the loss's backward has freed its
logits: the larger of the two counts).

In flight on the busiest rank, in micro-batches of its own layers (m micro-batches per step):
gpipe m; 1f1b p (Narayanan et al. 2021); interleaved-1f1b p (1 + (p-1)/(p v)) (Korthikanti et
al. 2022, sec. 4.2.3); zbv p, the 1F1B peak (Qi et al. 2024, ZB-V); dualpipev p + 1 (DeepSeek-V3
report, Table 2: DualPipe's activation column, PP + 1). Never more than m.

MoE: the routed copies of the tokens are counted top-k times, times a routing-imbalance headroom
(the busiest expert rank receives more than the mean; 1.25, GShard's usual capacity factor).
Logits: the cross-entropy as dstrain (and torchtitan) run it, eager over logits upcast to fp32
(`train/loss.py`), on the last stage, one micro-batch's worth (the last stage runs a
micro-batch's backward right after its forward under every schedule). Per logit and head: its
output, which the step holds until backward (2 bytes in 16 bits, 4 in fp32), the fp32
log-softmax output its backward keeps (4) and, for 16-bit logits, a second 16-bit copy (2);
while one head's loss runs backward, the incoming gradient and the log-softmax's input gradient
(4 + 4) and, in 16 bits, that gradient cast back (2). The dry run measures these on dstrain's
own step (`tests/unit/test_dry_run.py`: 16.8 bytes per logit with one head, 24.8 with an MTP
module, where this gives 18 and 26). For the main head and each MTP module, over this rank's
shard of the vocabulary under an engine's loss parallelism (the vocab-parallel cross-entropy of
Megatron-LM and of dstrain's trainer under TP), else over the whole vocabulary
(the logits all-gathered over tp), with the MTP blocks.

Overhead (`overhead.py`, each term from what it measurably is): the CUDA context and NCCL's
buffers for the communicators the layout opens (outside PyTorch's allocator), cuBLAS's
workspaces, and the allocator's fragmentation (9 % of activations, reserved by the caching
allocator but not allocated); ZeRO-3 also holds the largest layer gathered twice (the current
one and the prefetched one). At the floor only the CUDA context. `Memory.counted` gives what
each way of reading the peak sees: the device (nvidia-smi: everything),
`torch.cuda.max_memory_reserved` (no context, no NCCL) or `max_memory_allocated` (no
fragmentation either).
"""

from dataclasses import asdict, dataclass

from dstrain.config.model_args import ModelArgs
from dstrain.hardware import gpu_spec
from dstrain.model.flops import score_head_dims
from dstrain.planner.layout import Cluster, Layout
from dstrain.planner.memo import per_model
from dstrain.planner.overhead import (
    CONTEXT_BYTES,
    FRAGMENTATION,
    outside_allocator,
    workspace_bytes,
)
from dstrain.planner.shape import RankShape, rank_shapes

GiB = 2**30
MASTER_BYTES = 4  # fp32 weights: DDP's parameters, FSDP2's shards
GRAD_BYTES = 4  # fp32 gradients (FSDP2's reduce dtype; DDP's fp32 parameters)
PAPER_BYTES = (2, 2, 12)  # the ZeRO paper's weights, gradients and optimizer states
ROUTING_HEADROOM = 1.25
MEMORY_COUNTS = ("device", "reserved", "allocated")  # how a measured peak was read
SAVED_BYTES_PER_SCORE = 5  # per attention score: softmax output 2, dropout mask 1, its output 2
LOG_SOFTMAX_BYTES = 4  # the fp32 output each head's cross-entropy keeps for backward
LOSS_BACKWARD_BYTES = 8  # the incoming fp32 gradient and the log-softmax's input gradient
# The trainer's selective recompute runs again a matmul whose output is this many times wider
# than its input or more (`parallel/activation_checkpoint.py`): MLA's up-projections
UP_PROJECTION = 8


@dataclass(frozen=True)
class Memory:
    """Bytes per GPU on the busiest pipeline rank, by part."""

    weights: float
    gradients: float
    optimizer: float
    activations: float
    overhead: float
    rank: int  # the pipeline rank it is
    floor: float = 0.0  # the least this rank can hold (`memory_floor`): below it, no kernel helps
    outside_allocator: float = 0.0  # of the overhead: CUDA context, NCCL (no torch counter sees it)
    fragmentation: float = 0.0  # of the overhead: reserved by the caching allocator, not allocated

    @property
    def model_states(self) -> float:
        return self.weights + self.gradients + self.optimizer

    @property
    def peak(self) -> float:
        return self.model_states + self.activations + self.overhead

    def counted(self, counts: str = "device") -> float:
        """The peak as it is read: on the device (nvidia-smi), as PyTorch's caching allocator
        reserved it (`max_memory_reserved`), or as tensors allocated it (`max_memory_allocated`)."""
        if counts == "device":
            return self.peak
        reserved = self.peak - self.outside_allocator
        return reserved if counts == "reserved" else reserved - self.fragmentation

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


def gathered_bytes(precision: str) -> int:
    """Bytes of a weight as FSDP2 gathers it: bf16 under bf16 (and fp8: bf16 master copies),
    fp32 otherwise (fp16 trains fp32 weights under autocast)."""
    return 2 if precision in ("bf16", "fp8") else 4


def moment_bytes(moments: str = "fp32") -> int:
    """Adam's two moments: fp32 (the trainer), or bf16 (DeepSeek-V3, report sec. 3.3.3)."""
    return 4 if moments == "bf16" else 8


def model_state_bytes(
    params: float,
    zero: int,
    shard: int,
    offload: bool,
    precision: str = "bf16",
    moments: str = "fp32",
    pp: int = 1,
) -> tuple[float, float, float]:
    """(weights, gradients, optimizer) bytes on the device of `params` parameters sharded over
    `shard` ranks, as the runtime holds them at the step's peak (module docstring)."""
    k = moment_bytes(moments)
    if zero == 0:
        return MASTER_BYTES * params, GRAD_BYTES * params, k * params
    # Under PP, upstream's pipelining keeps FSDP modules unsharded for the whole step and defers
    # the gradient sync (torchtitan's FSDP + PP): ZeRO-3 then holds what ZeRO-2 does.
    gathered = gathered_bytes(precision) * params if zero <= 2 or pp > 1 else 0.0
    if offload:  # FSDP2's CPUOffloadPolicy: shards, their gradients and the step on the host
        return gathered, 0.0, 0.0
    deferred = zero == 1 or (zero >= 2 and pp > 1)
    grads = GRAD_BYTES * params / (1 if deferred else shard)
    return MASTER_BYTES * params / shard + gathered, grads, k * params / shard


def paper_model_states(params: float, zero: int, shard: int) -> tuple[float, float, float]:
    """The ZeRO paper's mixed-precision Adam accounting (sec. 3.1): 2 + 2 + 12 bytes, ZeRO-1
    sharding the 12, ZeRO-2 the gradients too, ZeRO-3 everything."""
    weight, grad, state = PAPER_BYTES
    weights = weight * params / (shard if zero >= 3 else 1)
    grads = grad * params / (shard if zero >= 2 else 1)
    return weights, grads, state * params / (shard if zero >= 1 else 1)


def memory_per_gpu(args: ModelArgs, layout: Layout, cluster: Cluster | None = None) -> Memory:
    """The busiest pipeline rank's memory (the first, last and second ranks are compared) on
    `cluster`'s GPUs (whose CUDA context, NCCL and cuBLAS overheads count; an H100 cluster of
    the layout's size when None)."""
    cluster = cluster or Cluster(gpu_spec("H100"), layout.world)
    outside = outside_allocator(layout, cluster)
    workspace = workspace_bytes(cluster)
    return max(
        (
            _rank_memory(args, layout, shape, outside, workspace)
            for shape in rank_shapes(args, layout)
        ),
        key=lambda m: m.peak,
    )


def resting_model_states(args: ModelArgs, layout: Layout) -> float:
    """Model states between steps on the rank holding the most, what the trainer's
    memory/model_states_mb counts (max over ranks): each parameter's local shard, a gradient of
    its size, and the optimizer's moments; FSDP2's gathered weights are freed by then."""
    best = 0.0
    k = moment_bytes(layout.adam_moments)
    for shape in rank_shapes(args, layout):
        total = 0.0
        for params, shard, zero in _parts(shape, layout):
            local = params / (shard if zero >= 1 else 1)
            total += (MASTER_BYTES + GRAD_BYTES + k) * local
        best = max(best, total)
    return best


def _parts(shape: RankShape, layout: Layout) -> list[tuple[float, int, int]]:
    """(parameters, ranks sharding them, ZeRO stage they run under) of the dense parameters and
    the routed experts; expert-parallel experts stay out of FSDP2 under offload (DDP-like)."""
    expert_zero = 0 if layout.offload and layout.ep > 1 else layout.zero
    return [
        (shape.dense_params, layout.dp * layout.cp, layout.zero),
        (shape.expert_params, layout.expert_shard, expert_zero),
    ]


def _rank_memory(
    args: ModelArgs,
    layout: Layout,
    shape: RankShape,
    outside: float = CONTEXT_BYTES,
    workspace: float = 0.0,
) -> Memory:
    """`outside`: the CUDA context's and NCCL's bytes; `workspace`: cuBLAS's (`overhead.py`)."""

    def states(pp: int) -> list[tuple[float, float, float]]:
        return [
            model_state_bytes(
                params,
                zero,
                shard,
                layout.offload and zero > 0,
                layout.precision,
                layout.adam_moments,
                pp,
            )
            for params, shard, zero in _parts(shape, layout)
        ]

    parts = states(layout.pp)
    weights, grads, optimizer = (sum(part[i] for part in parts) for i in range(3))
    copies = 0.0  # the engine's FP8 weight copies, kept across micro-batches (not at the floor)
    if layout.precision == "fp8":
        copies = layout.traits.fp8_weight_bytes * _recipe_params(args, layout, shape)
    activations = activation_bytes(args, layout, shape)
    fragmentation = FRAGMENTATION * activations
    overhead = outside + workspace + fragmentation
    gathered = 0.0
    if layout.zero >= 3 and layout.pp == 1:
        gathered = 2 * gathered_bytes(layout.precision) * _largest_layer_params(shape)
    # At the floor gradients accumulate and reduce in 16 bits where the weights train in
    # them (Megatron-LM's grad_reduce_in_fp32 = False; dstrain keeps them in fp32), and ZeRO-2
    # keeps only its shard under PP too: DeepSpeed's ZeRO-2 and Llama 3's FSDP reduce-scatter
    # every micro-batch's gradients, where dstrain's pipelining defers the sync: the
    # gradients without PP's deferral.
    narrow = 2 / GRAD_BYTES if layout.precision in ("bf16", "fp8") else 1
    floor_grads = narrow * sum(part[1] for part in states(pp=1))
    floor = (
        weights
        + floor_grads
        + optimizer
        + activation_bytes(args, layout, shape, floor=True)
        + CONTEXT_BYTES
        + gathered / 2
    )
    return Memory(
        weights + copies,
        grads,
        optimizer,
        activations,
        overhead + gathered,
        shape.rank,
        floor,
        outside,
        fragmentation,
    )


def _recipe_params(args: ModelArgs, layout: Layout, shape: RankShape) -> float:
    """The rank's parameters the FP8 recipe covers: all but the embedding and the head (and the
    last stage's MTP copy of the embedding), whose vocabulary-wide tables stay 16-bit."""
    tables = (shape.has_embedding + 2 * shape.has_head) * args.vocab_size * args.dim / layout.tp
    return max(0.0, shape.dense_params + shape.expert_params - tables)


def activation_bytes(
    args: ModelArgs, layout: Layout, shape: RankShape, *, floor: bool = False
) -> float:
    """What the rank saves for backward at its peak. `floor`: the least of it that today's
    kernels need (`_cached_layer_bytes`), with the loss fused with the head (Liger's and
    Megatron's fused cross-entropy never hold the logits and their gradient over the whole
    micro-batch) and the schedule's fewest micro-batches in flight. Cached on what it depends
    on (not ZeRO, dp or the offload: the search varies those)."""
    key = (
        shape,
        floor,
        in_flight(layout, floor=floor),
        layout.micro_batch,
        layout.seq_len,
        layout.cp,
        layout.tp,
        layout.ep,
        layout.sequence_parallel,
        layout.recompute,
        layout.moe_tp,
        layout.attention,
        layout.precision,
        layout.engine,
    )
    cache_key = (id(args), key)
    if cache_key not in _ACTIVATIONS:
        _MODELS[id(args)] = args  # kept alive: an id is never reused while cached
        _ACTIVATIONS[cache_key] = _activation_bytes(args, layout, shape, floor)
    return _ACTIVATIONS[cache_key]


_ACTIVATIONS: dict[tuple, float] = {}
_MODELS: dict[int, ModelArgs] = {}


def _activation_bytes(args: ModelArgs, layout: Layout, shape: RankShape, floor: bool) -> float:
    tokens = layout.micro_batch * layout.seq_len / layout.cp
    dense_layer, moe_layer = (
        _layer_bytes(args, layout, layout.recompute, moe, floor=floor) for moe in (False, True)
    )
    per_microbatch = tokens * (shape.dense_layers * dense_layer + shape.moe_layers * moe_layer)
    gathered = _gathered_kv_bytes(args, layout)
    if layout.recompute == "none":  # every layer keeps the whole sequence's keys and values
        per_microbatch += (shape.dense_layers + shape.moe_layers) * gathered
    if shape.has_embedding:
        per_microbatch += tokens * 2 * args.dim / _sp(layout)
    resident = per_microbatch * in_flight(layout, floor=floor)
    # Two peaks on top of what is held, one after the other in a micro-batch's backward, so
    # the larger counts: the loss (the last stage runs each micro-batch's backward right after
    # its forward), then each recomputed layer at full size.
    loss = tokens * _head_bytes_per_token(args, layout) if shape.has_head and not floor else 0.0
    recomputed = 0.0
    if layout.recompute != "none":  # at the floor with today's kernels: FlashAttention
        whole = 0 if floor else _scores_per_token(layout)
        moes = (False, shape.moe_layers > 0)
        recomputed = tokens * max(_layer_bytes(args, layout, "none", m, scores=whole) for m in moes)
        recomputed += 2 * gathered  # the recomputed keys and values, then their gradients
    return resident + max(loss, recomputed)


def _gathered_kv_bytes(args: ModelArgs, layout: Layout) -> float:
    """Under dstrain's context parallelism (`cp_gather`), what one layer's attention holds for
    the other cp ranks' tokens: every rank up-projects the whole sequence's keys and values from
    the gathered latent (MLA: the up-projection's output, K, and V padded to K's width for the
    fused kernels; MHA/GQA: the gathered K and V). 0 without cp, or for a ring (other engines
    pass blocks of K/V, counted in their comm, not held)."""
    if layout.cp == 1 or not layout.traits.cp_gather:
        return 0.0
    others = layout.micro_batch * layout.seq_len * (1 - 1 / layout.cp)
    heads = args.num_heads / layout.tp
    if args.attention == "mla":
        qk = args.qk_nope_head_dim + args.qk_rope_head_dim
        per_head = args.qk_nope_head_dim + args.v_head_dim + 2 * qk
    else:
        head_dim, _ = score_head_dims(args)
        per_head = 2 * head_dim * args.kv_heads / args.num_heads
    return others * 2 * heads * per_head


def in_flight(layout: Layout, *, floor: bool = False) -> float:
    """Micro-batches whose activations the busiest (first) rank holds at the peak. `floor`:
    the least of its schedule family, p for interleaving (whose extra warm-up chunks an engine
    can trade for bubble, as Llama 3's pipeline does with its tunable warm-up)."""
    p, m, v = layout.pp, layout.microbatches, layout.virtual_stages
    held = {
        "gpipe": m,
        "1f1b": p,
        "interleaved-1f1b": p if floor else p * (1 + (p - 1) / (p * v)),
        "zbv": p,
        "dualpipev": p + 1,
    }[layout.schedule]
    return min(held, max(m, 1)) if p > 1 else 1


def layer_bytes_per_token(args: ModelArgs, layout: Layout, *, moe: bool) -> float:
    """Bytes one layer saves for backward per token, 16-bit activations."""
    return _layer_bytes(args, layout, layout.recompute, moe)


def _layer_bytes(
    args: ModelArgs,
    layout: Layout,
    recompute: str,
    moe: bool,
    *,
    floor: bool = False,
    scores: int | None = None,
) -> float:
    """`_cached_layer_bytes` for `layout`; `scores`: the unfused attention's per token and head
    (`_scores_per_token` when None)."""
    return _cached_layer_bytes(
        args,
        layout.tp,
        layout.sequence_parallel,
        recompute,
        moe,
        layout.routed_split,
        floor,
        _scores_per_token(layout) if scores is None else scores,
        layout.ep,
        _matmuls_kept(layout),
        layout.traits.selective_matmuls is not None,
        _gemm_input_bytes(layout, floor),
    )


def _gemm_input_bytes(layout: Layout, floor: bool) -> float:
    """Bytes per element of a saved GEMM input: 1 under FP8 where the engine keeps the FP8 cast
    (and at the floor, as DeepSeek-V3 caches its FP8 activations), else 2."""
    if layout.precision != "fp8":
        return 2.0
    return 1.0 if floor else layout.traits.fp8_input_bytes


def _matmuls_kept(layout: Layout) -> float:
    """The share of the matmuls' outputs a selective recompute keeps: all but those
    the engine's `selective_matmuls` drops; under dstrain's trainer all but the FP8 GEMMs'."""
    share = layout.traits.selective_matmuls
    if share is not None:
        return 1.0 - share
    return 0.0 if layout.precision == "fp8" else 1.0


def _scores_per_token(layout: Layout) -> int:
    """Attention scores an unfused kernel saves per token and head: one per key (all seq_len
    of them, whatever cp splits); none under FlashAttention."""
    return layout.seq_len if layout.attention == "unfused" else 0


@per_model
def _cached_layer_bytes(
    args: ModelArgs,
    tp: int,
    sp: bool,
    recompute: str,
    moe: bool,
    routed_split: int,
    floor: bool = False,
    scores: int = 0,
    ep: int = 1,
    kept: float = 1.0,
    other_engine: bool = False,
    gemm_input: float = 2.0,
) -> float:
    """`floor`: with a fused SwiGLU (Megatron's `bias_swiglu`, Liger's: it keeps its input and
    recomputes the activation in backward), FlashAttention and routing in perfect balance; else
    as dstrain's eager modules save them, with `scores` per token and head saved by an unfused
    attention. `gemm_input`: bytes per element of the saved inputs of GEMMs (the norms'
    outputs, the attention output the output projection saves, the FFN product w2 saves): 1
    where FP8 GEMMs keep their FP8 cast (Transformer Engine; DeepSeek-V3 sec. 3.3.2)."""
    hidden = 2 * args.dim / (tp if sp else 1)  # one hidden-size tensor
    if recompute == "full":
        return hidden
    if recompute == "selective":
        # At the floor what full recompute keeps: no selective policy keeps less, and engines'
        # policies differ (DeepSeek-V3 recomputes its up-projections and caches FP8 inputs)
        if floor:
            return hidden
        return _selective_bytes(args, tp, hidden, moe, routed_split, ep, kept, other_engine)
    narrow = (2 - gemm_input) / 2  # the share of a 16-bit GEMM input an FP8 cast saves
    attention = _attention_bytes(args, tp, floor)
    attention -= narrow * 2 * args.num_heads / tp * score_head_dims(args)[1]  # wo's input
    if not floor:
        attention += SAVED_BYTES_PER_SCORE * scores * args.num_heads / tp
    ffn = (
        _moe_bytes(args, tp, routed_split, floor, narrow)
        if moe
        else _dense_ffn_bytes(args, args.inter_dim, tp, floor, narrow)
    )
    # the block input, the norms' inputs and their outputs (GEMM inputs)
    return (4 - 2 * narrow) * hidden + attention + ffn


def _selective_bytes(
    args: ModelArgs,
    tp: int,
    hidden: float,
    moe: bool,
    routed_split: int,
    ep: int,
    kept: float = 1.0,
    other_engine: bool = False,
) -> float:
    """What the trainer's selective recompute keeps per token and layer
    (`parallel/activation_checkpoint.py`): the block's input, and the output of every matmul,
    of the attention kernel and of the reduce-scatters, all-reduces and all-to-alls; not the
    norms', RoPE's, the activations' or any elementwise op's, nor the routed experts' (it runs
    them again whole) nor the up-projections' (MLA's, `UP_PROJECTION`). `kept`: the share of
    the matmuls' outputs kept (the engine's `selective_matmuls`); `other_engine`: another
    engine's policy, which keeps the routed copies' and the up-projections' outputs too.

    The attention and FFN output projections' products are [tokens, dim] on every tp rank
    (partial sums before their reduction), and their reduced copies are kept beside them."""
    full = 2 * args.dim
    heads = args.num_heads / tp
    if args.attention == "mla":
        products = sum(
            width / split for width, split, up in _mla_products(args, tp) if other_engine or not up
        )
    else:
        head_dim, _ = score_head_dims(args)
        products = heads * head_dim * (1 + 2 * args.kv_heads / args.num_heads)  # q, k, v
    kernel = heads * (2 * score_head_dims(args)[1] + 4)  # the attention kernel's output, fp32 lse
    ups = 2 if args.mlp == "swiglu" else 1
    # the block input; the projections' outputs (attention's and the FFN's) and their reduced
    # copies under tp; attention's products and its kernel's output
    kept_bytes = hidden + (2 * hidden if tp > 1 else 0.0) + kernel
    matmuls = 2 * full + 2 * products
    if not moe:
        return kept_bytes + kept * (matmuls + 2 * ups * args.inter_dim / tp)
    copies = args.num_activated_experts * ROUTING_HEADROOM / routed_split
    # another engine's policy keeps each routed copy's gate, up and down products; under expert
    # parallelism also the copy the dispatch all-to-all delivered and the one the combine returned
    if other_engine:
        matmuls += copies * (2 * ups * args.moe_inter_dim + full)
        kept_bytes += (copies * 2 * full) if ep > 1 else 0.0
    width = args.num_shared_experts * args.moe_inter_dim
    matmuls += (2 * ups * width / tp + full) if width else 0.0
    return kept_bytes + 4 * args.num_routed_experts + kept * matmuls


def _mla_products(args: ModelArgs, tp: int) -> list[tuple[float, int, bool]]:
    """MLA's projections' outputs per token: (width, tp split, an up-projection the trainer's
    selective recompute runs again)."""
    heads = args.num_heads
    qk = args.qk_nope_head_dim + args.qk_rope_head_dim
    kv = args.qk_nope_head_dim + args.v_head_dim
    out = [(args.kv_lora_rank + args.qk_rope_head_dim, 1, False)]
    out.append((heads * kv, tp, heads * kv >= UP_PROJECTION * args.kv_lora_rank))
    if args.q_lora_rank:
        out.append((args.q_lora_rank, 1, False))
        out.append((heads * qk, tp, heads * qk >= UP_PROJECTION * args.q_lora_rank))
    else:
        out.append((heads * qk, tp, False))
    return out


def _sp(layout: Layout) -> int:
    return layout.tp if layout.sequence_parallel else 1


def _attention_bytes(args: ModelArgs, tp: int, floor: bool = False) -> float:
    """MLA: the latents (replicated across tp) and the per-head tensors (split): q, k, v as the
    attention kernel keeps them, the up-projections' outputs, the output and its log-sum-exp.
    The output counts twice as dstrain's eager attention keeps it: the kernel's [B, H, S, D]
    output for its backward and the [B, S, H x D] copy the output projection saves; once at the
    `floor`, where a [B, S, H, D] kernel (FlashAttention's own layout) feeds the projection."""
    heads = args.num_heads / tp
    outputs = 1 if floor else 2
    if args.attention == "mla":
        qk = args.qk_nope_head_dim + args.qk_rope_head_dim
        latents = 2 * args.q_lora_rank + 2 * args.kv_lora_rank + args.qk_rope_head_dim
        per_head = 3 * qk + (args.qk_nope_head_dim + args.v_head_dim) + outputs * args.v_head_dim
    else:
        head_dim, _ = score_head_dims(args)
        latents = 0
        kv_share = args.kv_heads / args.num_heads
        per_head = head_dim * (1 + 2 * kv_share) + outputs * head_dim
    return 2 * (latents + heads * per_head) + 4 * heads  # + fp32 log-sum-exp per head


def _dense_ffn_bytes(
    args: ModelArgs, width: float, tp: int, fused: bool = False, narrow: float = 0.0
) -> float:
    """SwiGLU: w1 and w3 outputs, the activation and the product (w2's input), the activation
    not kept when `fused`; GELU: the up projection's output and the activation (w2's input).
    `narrow`: the share of w2's 16-bit input an FP8 cast saves."""
    tensors = (3 if fused else 4) if args.mlp == "swiglu" else 2
    return 2 * (tensors - narrow) * width / tp


def _moe_bytes(
    args: ModelArgs, tp: int, routed_split: int, floor: bool, narrow: float = 0.0
) -> float:
    """Router scores (fp32, gathered over tp for the balance loss), each routed copy's input
    (a GEMM input, `narrow` as in `_cached_layer_bytes`), expert intermediates and output, times
    the routing headroom, for this rank's share of the tokens (1 / routed_split); the shared
    experts like a dense FFN split over tp."""
    k, headroom = args.num_activated_experts, 1.0 if floor else ROUTING_HEADROOM
    expert = _dense_ffn_bytes(args, args.moe_inter_dim, 1, floor, narrow)
    routed = k * headroom * ((2 - narrow) * 2 * args.dim + expert) / routed_split
    width = args.num_shared_experts * args.moe_inter_dim
    shared = _dense_ffn_bytes(args, width, tp, floor, narrow)
    return 4 * args.num_routed_experts + routed + shared


def _head_bytes_per_token(args: ModelArgs, layout: Layout) -> float:
    """The eager cross-entropy's peak over the vocabulary it sees (the whole of it, gathered over
    tp, unless the engine splits it; module docstring): each
    head's logits and its log-softmax output, and one backward's two fp32 gradients; plus each
    MTP module's block. Under TP dstrain's vocab-parallel loss holds less (the logits, then one
    fp32 softmax: ~16 bytes per local logit with two heads, where this gives 26), but its step
    then peaks in the MTP block's backward, which this bound still covers (`test_dry_run.py`)."""
    heads = 1 + args.num_mtp_modules
    traits = layout.traits
    if traits.loss_held is not None and traits.loss_transient is not None:
        per_logit = heads * traits.loss_held + traits.loss_transient
    else:
        narrow = 0 if layout.precision == "fp32" else 2  # the 16-bit copy, the cast-back gradient
        logit = 4 if layout.precision == "fp32" else 2
        per_logit = heads * (logit + LOG_SOFTMAX_BYTES + narrow) + LOSS_BACKWARD_BYTES + narrow
    logits = per_logit * args.vocab_size / layout.loss_vocab_split
    mtp_blocks = args.num_mtp_modules * layer_bytes_per_token(args, layout, moe=True)
    return logits + mtp_blocks


def _largest_layer_params(shape: RankShape) -> float:
    return (shape.dense_params + shape.expert_params) / max(shape.layers, 1)
