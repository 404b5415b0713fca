"""Compute time of one micro-batch on one pipeline rank, from its GEMMs, its attention kernel and
its memory traffic, each at the speed published measurements give its kernel (`kernels.py`).

Each GEMM (M x K by K x N) runs three times a step, each with its own shape: forward
[M, K] x [K, N], input gradient [M, N] x [N, K] and weight gradient [K, M] x [M, N] (Kaplan et al.
2020, sec. 2.1, for the count). Each takes the roofline time (Williams et al. 2009) at its
shape's efficiency, plus the per-kernel floor:

    floor + max(2 M K N / (peak x gemm_efficiency(M, N, K)), bytes moved / (HBM x mem_efficiency))

so small GEMMs (a thin micro-batch, an expert that receives few tokens, a short K) run far below
peak, and thin ones are memory-bound: shape matters. A grouped GEMM (the routed experts) fills
the GPU with all its groups' tiles at once and pays one floor.

Attention's score and value products run in a fused kernel (`layout.attention`: "flash", the
newest for the GPU, or "flash2") at its measured efficiency for the sequence length, head dim
and direction, its backward at 2.5x the forward's FLOPs (it recomputes the scores). Norms, RoPE,
activations, residual adds and the MoE permutation are memory-bound: ELEMENTWISE_PASSES passes
over a hidden-size tensor per token and layer forward (and top-k more for the routed copies),
twice that in backward; so is the cross-entropy over the vocabulary (LOSS_BYTES_PER_LOGIT per
logit each way), and an unfused attention's passes over its scores (UNFUSED_SCORE_TRAFFIC
each). Every layer also pays the launch floor of its other kernels (`layer_overhead_s`).

FP8 (`precision = fp8`) is what the trainer runs (model/fp8.py, DeepSeek-V3's recipe): the
attention projections, dense and shared-expert SwiGLUs, routed experts and MTP projection at the
FP8 peak and FP8's own measured efficiency, their operands read in 1 byte plus the online
quantisation of each input (read 2 bytes, write 1); the router, the output head and attention's
fused kernel in 16 bits.

Recompute: `full` runs the whole forward again in backward; `selective` only what is neither a
matmul nor the fused attention kernel (norms, RoPE, activations, elementwise), as the trainer's
per-op policy saves every matmul's and the attention kernel's output (`parallel/
activation_checkpoint.py`), and an unfused attention's core, whose scores it drops (Korthikanti
et al. 2022, sec. 5: Megatron-LM's selective recompute); plus what the trainer's policy runs
again whole (its routed experts, up-projections and FP8 GEMMs), or, for another engine,
its `selective_matmuls` of all the matmuls (`engines.py`: torchtitan's per-op policy runs every
other one again). A backward that zbv or dualpipev splits into input- and weight-gradient passes
recomputes in each (torch recomputes once per autograd graph task), so the trainer pays the
recompute twice on that share of its chunks (`Layout.split_recompute_share`).
"""

from dataclasses import dataclass, replace

from dstrain.config.model_args import ModelArgs
from dstrain.model.flops import score_head_dims
from dstrain.planner.kernels import (
    GEMM_FLOOR_S,
    GEMMS,
    SUSTAINED_SHARE,
    attention_efficiency,
    gemm_efficiency,
)
from dstrain.planner.layout import Cluster, Layout
from dstrain.planner.memo import per_model
from dstrain.planner.memory import GRAD_BYTES, MASTER_BYTES, UP_PROJECTION, moment_bytes
from dstrain.planner.shape import RankShape

ELEMENTWISE_PASSES = 16  # reads and writes of a hidden-size tensor per layer, per token, forward
BACKWARD_PASSES = 2  # backward's elementwise traffic against forward's: the gradient and the input
# The eager cross-entropy over logits upcast to fp32 (`train/loss.py`; torchtitan's and
# Megatron-LM's vocab-parallel one are alike), bytes moved per logit. Forward: read the 16-bit
# logits and write them in fp32 (2 + 4), the log-softmax's max and sum passes and its output
# (4 + 4 + 4 + 4). Backward: the loss's dense gradient (4), the log-softmax's backward (read 4 + 4,
# write 4) and the cast back to 16 bits (4 + 2). About 20 each way.
LOSS_BYTES_PER_LOGIT = 20
# An unfused attention (`layout.attention = "unfused"`: Megatron-LM's fused scale-mask-softmax
# between two batched GEMMs, no FlashAttention) writes the full s x s scores in 16 bits and passes
# over them, bytes per score in the forward: QK^T's output (2), the softmax (read 2, write 2),
# dropout (read 2, write 2, its mask 1) and PV's read (2). Its two GEMMs run over the whole
# square (no causal skipping); the softmax and dropout's backward moves as much again.
UNFUSED_SCORE_TRAFFIC = 13


@dataclass(frozen=True)
class ComputeConstants:
    """What `dstrain plan --calibrate` fits: scales on the measured kernel efficiencies of
    `kernels.py` (1: as published), the share of HBM bandwidth streaming kernels reach, and
    the launch floor of a layer's non-GEMM kernels per pass (about 20 of them at 4 us)."""

    gemm_scale: float = 1.0
    attention_scale: float = 1.0
    memory_efficiency: float = 0.8
    layer_overhead_s: float = 20 * 4e-6
    # the share of their measured speed GPU kernels keep inside a training step (`kernels.py`)
    sustained: float = SUSTAINED_SHARE


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


@dataclass(frozen=True)
class _Pass:
    """Seconds of some kernels in each pass: forward, input gradient (B), weight gradient (W),
    `cheap`: the part of the forward a selective recompute runs again (what is not a matmul or
    the fused attention kernel), `matmul`: the forward's matmuls, and `heavy`: the costly
    forward dstrain's selective policy runs again all the same (its FP8 GEMMs, which are not
    single ops, and its routed experts, whose top-k copies it does not keep)."""

    forward: float = 0.0
    backward: float = 0.0
    weight: float = 0.0
    cheap: float = 0.0
    matmul: float = 0.0
    heavy: float = 0.0

    def _parts(self) -> tuple[float, ...]:
        return (self.forward, self.backward, self.weight, self.cheap, self.matmul, self.heavy)

    def __add__(self, other: "_Pass") -> "_Pass":
        return _Pass(*(a + b for a, b in zip(self._parts(), other._parts(), strict=True)))

    def __mul__(self, factor: float) -> "_Pass":
        return _Pass(*(factor * x for x in self._parts()))

    __rmul__ = __mul__


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
        layout.engine,
        layout.split_recompute_share,
    )
    return _stage_times(args, key, cluster, shape, consts or ComputeConstants())


@per_model
def _stage_times(
    args: ModelArgs, key: tuple, cluster: Cluster, shape: RankShape, consts: ComputeConstants
) -> StageTimes:
    tp, ep, cp, mb, seq, recompute, precision, sp, moe_tp, attention, engine, twice = key
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
        engine=engine,
    )
    chip = _Chip(cluster, layout.precision, consts)
    tokens = layout.micro_batch * layout.seq_len / layout.cp
    total = _Pass()
    if shape.dense_layers:
        total += shape.dense_layers * _layer(args, layout, chip, tokens, moe=False)
    if shape.moe_layers:
        total += shape.moe_layers * _layer(args, layout, chip, tokens, moe=True)
    if shape.has_head:
        total += _head(args, layout, chip, tokens)
    width = args.num_shared_experts * args.moe_inter_dim
    shared = shape.moe_layers * _swiglu(args, chip, tokens, width, layout.tp) if width else _Pass()
    share = layout.traits.selective_matmuls
    selective = total.cheap + (total.heavy if share is None else share * total.matmul)
    recomputed = {"none": 0.0, "selective": selective, "full": total.forward}
    # split backwards recompute in both passes (`Layout.split_recompute_share`)
    backward = total.backward + (1 + twice) * recomputed[layout.recompute]
    return StageTimes(total.forward, backward, total.weight, shared.forward)


class _Chip:
    def __init__(self, cluster: Cluster, precision: str, consts: ComputeConstants) -> None:
        gpu = cluster.gpu
        self.arch = gpu.arch
        self.fp8 = precision == "fp8"
        self.peak = gpu.peak_tflops(precision) * 1e12  # the recipe's GEMMs (all, unless fp8)
        self.peak16 = gpu.peak_tflops("bf16") * 1e12 if self.fp8 else self.peak
        self.hbm = gpu.hbm_tbps * 1e12 * consts.memory_efficiency
        self.consts = consts
        # a GPU's measured kernels slow down inside a step; a run's own CPU was measured there
        inside = gpu.power_share * (consts.sustained if gpu.arch in GEMMS else 1.0)
        self.gemm_scale = consts.gemm_scale * inside
        self.attention_scale = consts.attention_scale * inside

    def gemm(
        self,
        m: float,
        k: float,
        n: float,
        count: float = 1.0,
        *,
        recipe: bool = True,
        grouped: bool = False,
    ) -> _Pass:
        """`count` GEMMs of [m, k] x [k, n] (a layer's weight [k, n] on m tokens) in all three
        passes. `recipe`: one the FP8 recipe covers (False: the router and the head, 16-bit).
        `grouped`: the count run as one grouped GEMM (the routed experts), which fills the GPU
        with all its groups' tiles and pays one kernel floor."""
        group = count if grouped else 1.0
        floors = (1.0 if grouped else count) * GEMM_FLOOR_S
        forward = count * self._one(m, k, n, recipe, group) + floors
        return _Pass(
            forward,
            count * self._one(m, n, k, recipe, group) + floors,
            count * self._one(k, m, n, recipe, group) + floors,
            0.0,
            forward,
            forward if self.fp8 and recipe else 0.0,
        )

    def _one(self, m: float, k: float, n: float, recipe: bool, group: float) -> float:
        """Roofline seconds of one [m, k] x [k, n] product (no floor)."""
        flops = 2 * m * k * n
        if self.fp8 and recipe:
            # E4M3 operands (1 byte), bf16 output, and quantising both inputs (2 in, 1 out).
            peak, traffic, dtype = self.peak, (m * k + k * n) * (1 + 3) + 2 * m * n, "fp8"
        else:
            peak, traffic, dtype = self.peak16, 2 * (m * k + k * n + m * n), "bf16"
        efficiency = gemm_efficiency(self.arch, dtype, group * m, n, k) * self.gemm_scale
        return max(flops / (peak * min(efficiency, 1.0)), traffic / self.hbm)

    def attention(self, flops: float, seq_len: float, head_dim: float, kernel: str) -> _Pass:
        """A fused attention kernel of `flops` forward FLOPs (causal, as FlashAttention counts
        them), its backward at 2.5x as many."""
        scale = self.attention_scale
        forward, backward = (
            min(1.0, scale * attention_efficiency(self.arch, kernel, seq_len, head_dim, backward=b))
            for b in (False, True)
        )
        return _Pass(flops / (self.peak16 * forward), 2.5 * flops / (self.peak16 * backward))

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


def _layer(args: ModelArgs, layout: Layout, chip: _Chip, tokens: float, *, moe: bool) -> _Pass:
    """One layer's kernels in the three passes."""
    tp, d = layout.tp, args.dim
    total = _Pass()
    for k, n, split in _attention_matmuls(args, tp):
        gemm = chip.gemm(tokens, k, n / split)
        # the trainer's selective recompute runs an up-projection again (MLA's)
        total += replace(gemm, heavy=gemm.forward) if n >= UP_PROJECTION * k else gemm
    total += _scores(args, layout, chip, tokens)
    if moe:
        total += _moe(args, layout, chip, tokens)
    else:
        total += _swiglu(args, chip, tokens, args.inter_dim, tp)
    passes = ELEMENTWISE_PASSES + (4 * args.num_activated_experts if moe else 0)
    stream = chip.stream(passes * tokens * 2 * d / (tp if layout.sequence_parallel else 1))
    cheap = stream + chip.consts.layer_overhead_s
    return total + _Pass(cheap, BACKWARD_PASSES * cheap, 0.0, cheap)


def _scores(args: ModelArgs, layout: Layout, chip: _Chip, tokens: float) -> _Pass:
    """The score and value products: a fused kernel, or an unfused one's two batched GEMMs over
    the whole square (backward: both of each product's gradients are input gradients) and its
    passes over the scores."""
    qk, v = score_head_dims(args)
    heads = args.num_heads / layout.tp
    seq = layout.seq_len
    if layout.attention != "unfused":
        flops = 2 * tokens * heads * (qk + v) * seq / 2  # causal: half the scores on average
        return chip.attention(flops, seq, qk, layout.attention)
    sequences = tokens / seq * heads
    score = chip.gemm(seq, qk, seq, sequences, recipe=False, grouped=True)  # Q K^T
    value = chip.gemm(seq, seq, v, sequences, recipe=False, grouped=True)  # P V
    products = score + value
    stream = chip.stream(UNFUSED_SCORE_TRAFFIC * tokens * heads * seq)
    forward = products.forward + stream
    # Selective recompute drops the scores and runs this core again (Korthikanti et al. 2022)
    return _Pass(forward, products.backward + products.weight + stream, 0.0, forward)


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


def _swiglu(args: ModelArgs, chip: _Chip, tokens: float, width: float, tp: int) -> _Pass:
    ups = 2 if args.mlp == "swiglu" else 1
    return chip.gemm(tokens, args.dim, width / tp, ups) + chip.gemm(tokens, width / tp, args.dim)


def _moe(args: ModelArgs, layout: Layout, chip: _Chip, tokens: float) -> _Pass:
    """Router, shared experts (tp-split) and this rank's routed experts: the rank routes its
    share of the tokens (1 / tp of them under moe_tp = split_tokens, all under repeat) and
    receives about as many x top-k routed copies (balanced), spread over its E / ep experts,
    which run as grouped GEMMs; dstrain's FP8 experts as one blockwise GEMM each
    (`model/fp8_grouped.py`: torch has no grouped blockwise kernel), each with its own fill
    and kernel floor."""
    routed_tokens = tokens / layout.routed_split
    router = chip.gemm(routed_tokens, args.dim, args.num_routed_experts, recipe=False)
    width = args.num_shared_experts * args.moe_inter_dim
    shared = _swiglu(args, chip, tokens, width, layout.tp) if width else _Pass()
    local = args.num_routed_experts / layout.ep
    per_expert = routed_tokens * args.num_activated_experts / local
    inter = args.moe_inter_dim
    grouped = not (chip.fp8 and layout.engine == "dstrain")
    ups = chip.gemm(per_expert, args.dim, inter, 2 * local, grouped=grouped)
    down = chip.gemm(per_expert, inter, args.dim, local, grouped=grouped)
    routed = ups + down
    return router + shared + replace(routed, heavy=routed.forward)


def _head(args: ModelArgs, layout: Layout, chip: _Chip, tokens: float) -> _Pass:
    """The output head over this rank's vocabulary shard and its loss, and each MTP module (its
    projection, block and another head application)."""
    head = chip.gemm(tokens, args.dim, args.vocab_size / layout.tp, recipe=False)
    loss = chip.stream(LOSS_BYTES_PER_LOGIT * tokens * args.vocab_size / layout.loss_vocab_split)
    head += _Pass(loss, loss)  # no recompute: the loss runs its backward right after
    if not args.num_mtp_modules:
        return head
    block = _layer(args, layout, chip, tokens, moe=args.num_routed_experts > 0)
    proj = chip.gemm(tokens, 2 * args.dim, args.dim)
    return head + args.num_mtp_modules * (block + proj + head)
