"""Communication per training step of a layout: an alpha-beta model of each collective, the group
each mesh axis talks over, and how much of it hides behind compute. Pure arithmetic, no torch.

The collective model (Hockney 1994; ring algorithms as in Thakur, Rabenseifner & Gropp 2005,
"Optimization of Collective Communication Operations in MPICH", and as NCCL runs large messages),
with `nbytes` the nccl-tests "size" S (the full buffer: an all-gather's output, a reduce-scatter's
input), n ranks, link bandwidth B and per-step latency alpha:

    all_reduce       2(n-1)/n * S/B + 2(n-1) alpha
    all_gather       (n-1)/n * S/B + (n-1) alpha
    reduce_scatter   (n-1)/n * S/B + (n-1) alpha
    all_to_all       (n-1)/n * S/B + (n-1) alpha
    p2p              S/B + alpha

plus NCCL's per-call latency. The bandwidth factors are nccl-tests' bus-bandwidth factors
(doc/PERFORMANCE.md: busbw = algbw * factor), so B is what nccl-tests reports as busbw and
`--calibrate` can fit it from `dstrain bench`. n == 1 costs nothing. An all-reduce takes the
faster of the ring, NCCL's tree across nodes and NVLink SHARP inside a Hopper node, as NCCL's
tuner does (`collective`).

Rank order (the trainer's, `dstrain/parallel/mesh.py`): row-major over (pp, dp, cp, tp), tp
innermost; ep takes the innermost ep ranks of the dp x cp x tp block, and the ranks holding the
same experts (edp) are strided by ep. A group of n ranks with stride s spans n*s consecutive
ranks: within a node it uses the node's fabric, else the network (one NIC per GPU, a ring's
members on a node crossing over theirs at once).
"""

import math
from dataclasses import dataclass

from dstrain.config.model_args import ModelArgs
from dstrain.model.flops import score_head_dims
from dstrain.planner.bubble import stages_per_rank
from dstrain.planner.layout import Cluster, Layout

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")
AXES = ("tp", "cp", "dp", "ep", "edp", "pp")

# Activations and their gradients travel in 2 bytes (bf16/fp16) in every precision: fp8 runs
# quantize inside the matmuls only (DeepSeek-V3's fp8 dispatch is not modeled).
ACTIVATION_BYTES = 2
# Gradients are reduced in fp32: FSDP2's MixedPrecisionPolicy(reduce_dtype=float32) in
# `dstrain/parallel/data_parallel.py`, and DDP holds fp32 parameters (so fp32 gradients) under
# autocast; Megatron also reduces in fp32 by default.
GRAD_BYTES = 4
# DDP's default bucket_cap_mb=25 (MiB), which the trainer keeps.
BUCKET_BYTES = 25 * 2**20

# Latencies from NCCL's own tuning model (src/graph/tuning.cc, the Simple protocol NCCL uses for
# MB-sized messages): per ring step (`hwLat`) 3.4 us over NVLink and 14 us over the network (9.6
# us in older releases); per call (`baseLat`) 8.4 us for Ring and Tree, 25 us for NVLS.
ALPHA_INTRA_S = 3.4e-6
ALPHA_INTER_S = 14e-6
BASE_LATENCY_S = 8.4e-6
NVLS_LATENCY_S = 25e-6
# NVLink SHARP (NVLS, NCCL >= 2.17 on Hopper and newer GPUs behind an NVSwitch) reduces inside
# the switch: 8 x H100 reach about 480 GB/s all-reduce bus bandwidth with it against about 370
# with rings, on a 450 GB/s link (nccl-tests #212, #272, #290; nccl #1455). Its share of the
# link, and the tree's of the ring's bandwidth (tuning.cc: `treeBw * 0.92`).
NVLS_BUS_SHARE = 480 / 450
TREE_BANDWIDTH_SHARE = 0.92
NVLS_ARCHS = ("hopper", "blackwell")
# Achievable share of the nominal per-GPU, per-direction bandwidth, as nccl-tests busbw:
# NVLink: NCCL's tuning model capped A100 NVLink3 ring bus bandwidth at 235 of 300 GB/s (0.78);
# 8xA100 all_reduce_perf reports 230-250 GB/s. The same share is assumed for other fabrics
# (NVLink SHARP all-reduce on H100/H200 goes higher and is not modeled).
# Network: NCCL maintainers quote 192 GB/s all-reduce busbw on a DGX-A100 with 8x200 Gb/s IB
# (NVIDIA/nccl#812, 0.96) and 12.2 GB/s on one 100 Gb/s NIC (NVIDIA/nccl-tests#29, 0.98); 0.9
# leaves room for the congestion of a many-node fabric.
BW_EFFICIENCY_INTRA = 0.80
BW_EFFICIENCY_INTER = 0.90


@dataclass(frozen=True)
class CommConstants:
    """Everything `dstrain plan --calibrate` fits; the defaults are the constants above.

    alpha_*: seconds per latency step inside a node / across nodes; bw_efficiency_*: the share
    of the nominal link bandwidth (GPUSpec.intra_node_gbps, Cluster.inter_node_gbps) that a
    collective reaches as nccl-tests busbw; overlap: the share of the compute that can hide
    communication which really does (1 on GPUs, where collectives run on their own streams;
    lower where they compete with compute for the same cores, as gloo on a CPU does)."""

    alpha_intra_s: float = ALPHA_INTRA_S
    alpha_inter_s: float = ALPHA_INTER_S
    base_latency_s: float = BASE_LATENCY_S
    bw_efficiency_intra: float = BW_EFFICIENCY_INTRA
    overlap: float = 1.0
    # Per kind of collective, a factor on both links' efficiency (1: the kind reaches what the
    # link does). NCCL's kinds do differ (all-to-all reaches less bus bandwidth than a ring
    # all-reduce); calibration finds how much on the runs it is given.
    all_reduce_factor: float = 1.0
    gather_factor: float = 1.0  # all-gather and reduce-scatter
    all_to_all_factor: float = 1.0
    p2p_factor: float = 1.0
    bw_efficiency_inter: float = BW_EFFICIENCY_INTER


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' busbw / algbw for `op` on n ranks: the share of S each rank's link carries."""
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    if op == "p2p":
        return 1.0
    raise ValueError(f"unknown collective {op!r}; choose one of {', '.join(OPS)}")


def latency_steps(op: str, n: int) -> int:
    """Latency terms of one call: ring steps (2(n-1) for all-reduce, n-1 for all-gather and
    reduce-scatter), n-1 peer messages for all-to-all, 1 for p2p."""
    if op == "all_reduce":
        return 2 * (n - 1)
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return n - 1
    if op == "p2p":
        return 1
    raise ValueError(f"unknown collective {op!r}; choose one of {', '.join(OPS)}")


def collective_time(op: str, nbytes: float, n: int, link_gbps: float, alpha_s: float) -> float:
    """Seconds of one `op` of nccl-tests size `nbytes` on n ranks over a link of `link_gbps`
    GB/s (per GPU, one direction) with `alpha_s` per latency step (module docstring)."""
    if n <= 1:
        return 0.0
    return bus_factor(op, n) * nbytes / (link_gbps * 1e9) + latency_steps(op, n) * alpha_s


def group_span(axis: str, layout: Layout) -> tuple[int, int]:
    """(n, stride) of the group one rank talks to over `axis`, in the trainer's rank order.

    `dp` is the group the dense gradients are reduced over: dp x cp ranks (cp ranks hold the same
    weights; FSDP's `dp_shard_cp`), stride tp. `edp` holds the same experts: dp*cp*tp/ep ranks,
    stride ep. `pp` neighbours are a whole dp x cp x tp block apart."""
    spans = _spans(layout)
    if axis not in spans:
        raise ValueError(f"unknown axis {axis!r}; choose one of {', '.join(AXES)}")
    return spans[axis]


def _spans(layout: Layout) -> dict[str, tuple[int, int]]:
    block = layout.dp * layout.cp * layout.tp
    return {
        "tp": (layout.tp, 1),
        "cp": (layout.cp, layout.tp),
        "dp": (layout.dp * layout.cp, layout.tp),
        "ep": (layout.ep, 1),
        "edp": (block // layout.ep, layout.ep),
        "pp": (layout.pp, block),
    }


def ranks_per_node(n: int, stride: int, gpus_per_node: int) -> int:
    """Members of a group of n ranks with `stride` that share one node."""
    if n * stride <= gpus_per_node:
        return n
    return max(1, min(n, gpus_per_node // stride))


def link_kind(n: int, stride: int, cluster: Cluster) -> str:
    """`intra` when the group fits in a node, `inter` when it crosses nodes, `none` for n == 1."""
    if n <= 1:
        return "none"
    return "intra" if n * stride <= cluster.gpus_per_node else "inter"


def _kind_factor(op: str, consts: CommConstants) -> float:
    if op == "all_reduce":
        return consts.all_reduce_factor
    if op in ("all_gather", "reduce_scatter"):
        return consts.gather_factor
    return consts.all_to_all_factor if op == "all_to_all" else consts.p2p_factor


def group_time(
    op: str,
    nbytes: float,
    n: int,
    stride: int,
    cluster: Cluster,
    consts: CommConstants,
    calls: float = 1,
) -> float:
    """Seconds of `calls` calls of `op` moving `nbytes` in all (nccl-tests size, summed) over a
    group of n ranks with `stride`, by the algorithm NCCL would pick (`collective`)."""
    return collective(op, nbytes, n, stride, cluster, consts, calls)[0]


def collective(
    op: str,
    nbytes: float,
    n: int,
    stride: int,
    cluster: Cluster,
    consts: CommConstants,
    calls: float = 1,
) -> tuple[float, str]:
    """(seconds, algorithm) of `calls` calls of `op` over the group, as NCCL's tuner chooses:
    the fastest of the algorithms it has for the op and the hardware (tuning.cc,
    `ncclTopoGetAlgoTime`: latency per call plus bytes over the algorithm's bandwidth).

    - Ring: within a node at the NVLink bandwidth times `bw_efficiency_intra`. Across nodes a
      ring's k members on a node leave it over their own k NICs at once (NCCL runs one ring
      channel per NIC: 8 x 200 Gb/s DGX A100 nodes reach 192 GB/s all-reduce bus bandwidth,
      NVIDIA/nccl#812), so its bus bandwidth is k NICs', up to the node's fabric; only the
      node-crossing steps, `latency_steps` over the nodes, pay alpha_inter, the rest
      alpha_intra.
    - Tree (all-reduce across nodes): 0.92 of the ring's bandwidth, latency
      2((k-1) alpha_intra + log2(nodes) alpha_inter), which wins when many nodes make the
      ring's latency long.
    - NVLS (all-reduce within a Hopper or newer node on NVSwitch): the switch reduces, at
      `NVLS_BUS_SHARE` of the link, 25 us a call.
    - An all-to-all sends (k-1)/n of its bytes over NVLink and (n-k)/n over the network at once
      (NCCL's grouped sends cannot aggregate NICs: each rank's share goes through its own);
      its time is the larger of the two parts.
    """
    if n <= 1 or calls <= 0:
        return 0.0, "none"
    k = ranks_per_node(n, stride, cluster.gpus_per_node)
    factor = _kind_factor(op, consts)
    bw_intra = cluster.gpu.intra_node_gbps * 1e9 * consts.bw_efficiency_intra * factor
    a_intra, a_inter, base = consts.alpha_intra_s, consts.alpha_inter_s, consts.base_latency_s
    per_call = calls * base
    if k == n:
        ring = bus_factor(op, n) * nbytes / bw_intra + per_call
        ring += calls * latency_steps(op, n) * a_intra
        if op == "all_reduce" and _has_nvls(cluster):
            link = cluster.gpu.intra_node_gbps * 1e9 * NVLS_BUS_SHARE * factor
            nvls = bus_factor(op, n) * nbytes / link + calls * NVLS_LATENCY_S
            return min((ring, "ring"), (nvls, "nvls"))
        return ring, "ring" if op not in ("all_to_all", "p2p") else op
    nic = cluster.inter_node_gbps * 1e9 * consts.bw_efficiency_inter * factor
    if op == "all_to_all":
        intra = (k - 1) / n * nbytes / bw_intra + calls * (k - 1) * a_intra
        inter = (n - k) / n * nbytes / nic + calls * (n - k) * a_inter
        return max(intra, inter) + per_call, op
    if op == "p2p":
        return nbytes / nic + calls * a_inter + per_call, op
    bw_inter = min(k * nic, bw_intra)
    nodes = -(-n // k)
    steps, cross = latency_steps(op, n), latency_steps(op, nodes)
    ring = bus_factor(op, n) * nbytes / bw_inter + per_call
    ring += calls * ((steps - cross) * a_intra + cross * a_inter)
    if op != "all_reduce":
        return ring, "ring"
    hops = (k - 1) * a_intra + math.ceil(math.log2(nodes)) * a_inter
    tree = bus_factor(op, n) * nbytes / (TREE_BANDWIDTH_SHARE * bw_inter)
    tree += per_call + calls * 2 * hops
    return min((ring, "ring"), (tree, "tree"))


def _has_nvls(cluster: Cluster) -> bool:
    return cluster.gpu.arch in NVLS_ARCHS and cluster.gpu.intra_node_link.startswith("NVLink")


@dataclass(slots=True)
class AxisComm:
    """One axis's traffic per step on one GPU: `bytes` is the nccl-tests size summed over its
    calls, `seconds` their modeled time, `exposed_seconds` the part not hidden by compute."""

    bytes: float = 0.0
    seconds: float = 0.0
    exposed_seconds: float = 0.0
    link: str = "none"
    group_size: int = 1
    algorithm: str = "none"  # NCCL's: ring, tree or nvls (all_to_all, p2p: their own)

    def to_json(self) -> dict:
        return {
            "bytes": self.bytes,
            "seconds": self.seconds,
            "exposed_seconds": self.exposed_seconds,
            "link": self.link,
            "group_size": self.group_size,
            "algorithm": self.algorithm,
        }


@dataclass(slots=True)
class CommTimes:
    """Per-axis communication of one step on one GPU (see `comm_per_step`)."""

    tp: AxisComm
    cp: AxisComm
    dp: AxisComm
    ep: AxisComm
    edp: AxisComm
    pp: AxisComm

    def axes(self) -> tuple[AxisComm, ...]:
        return (self.tp, self.cp, self.dp, self.ep, self.edp, self.pp)

    @property
    def seconds(self) -> float:
        return sum(a.seconds for a in self.axes())

    @property
    def exposed_seconds(self) -> float:
        """Communication on the critical path: what the step time adds to compute."""
        return sum(a.exposed_seconds for a in self.axes())

    @property
    def bytes(self) -> float:
        return sum(a.bytes for a in self.axes())

    def to_json(self) -> dict:
        return {name: axis.to_json() for name, axis in zip(AXES, self.axes(), strict=True)}


@dataclass(slots=True)
class _Ctx:
    """What every axis needs, computed once per call."""

    layout: Layout
    cluster: Cluster
    consts: CommConstants
    microbatches: int
    tokens: float  # tokens of one micro-batch on one rank: micro_batch * seq_len / cp
    recompute_full: bool
    spans: dict[str, tuple[int, int]]

    def axis(self, name: str, op: str, nbytes: float, calls: float) -> AxisComm:
        """An AxisComm with `calls` calls of `op` over `name`'s group, all of it exposed."""
        n, stride = self.spans[name]
        seconds, algorithm = collective(op, nbytes, n, stride, self.cluster, self.consts, calls)
        return AxisComm(nbytes, seconds, seconds, link_kind(n, stride, self.cluster), n, algorithm)

    def time(self, name: str, op: str, nbytes: float, calls: float = 1) -> float:
        n, stride = self.spans[name]
        return group_time(op, nbytes, n, stride, self.cluster, self.consts, calls)


def comm_per_step(
    args: ModelArgs,
    layout: Layout,
    cluster: Cluster,
    consts: CommConstants,
    *,
    layers_per_rank: int,
    moe_layers_per_rank: int,
    dense_params_per_rank: float,
    expert_params_per_rank: float,
    forward_compute_s: float = 0.0,
    backward_compute_s: float = 0.0,
    attention_compute_s: float = 0.0,
    overlap_compute_s: float = 0.0,
    shared_forward_s: float = 0.0,
    holds_head: bool = True,
) -> CommTimes:
    """Bytes, seconds and exposed seconds per step on one GPU, per axis.

    Counts are per rank: `layers_per_rank` transformer blocks (of which `moe_layers_per_rank`
    are MoE) and its parameters after tp/ep/pp division, before ZeRO sharding (with ep == 1 the
    routed experts count as dense parameters, as the trainer treats them). The compute times
    (seconds per step on this GPU, 0 = nothing to hide behind) bound the overlaps:
    `forward_compute_s` / `backward_compute_s` hide the data-parallel traffic,
    `attention_compute_s` the ring-attention exchange, `overlap_compute_s` (the compute of the
    chunks that run in DualPipeV's overlapped pairs, `Layout.paired_share`) those chunks' expert
    traffic, `shared_forward_s` (the shared experts' forward, under `ep_overlap`) the other
    chunks' forward dispatch. `holds_head`: this rank holds the output head (the last
    pipeline stage), whose logits are all-gathered over tp unless the engine's loss is
    vocab-parallel. Each axis's model, with its source, is in its function below and in
    docs/planner.md.
    """
    m = layout.microbatches
    if m < 1:
        raise ValueError(
            f"global_batch={layout.global_batch} gives no micro-batch to dp={layout.dp} x "
            f"micro_batch={layout.micro_batch}; make global_batch a multiple of their product"
        )
    hide = consts.overlap  # the compute that really hides communication
    forward_compute_s, backward_compute_s = hide * forward_compute_s, hide * backward_compute_s
    attention_compute_s, overlap_compute_s = hide * attention_compute_s, hide * overlap_compute_s
    shared_forward_s *= hide
    ctx = _Ctx(
        layout,
        cluster,
        consts,
        m,
        layout.micro_batch * layout.seq_len / layout.cp,
        layout.recompute == "full",
        _spans(layout),
    )
    if layout.ep == 1:
        # Without expert parallelism the experts are ordinary parameters of DDP/FSDP over dp.
        dense_params_per_rank += expert_params_per_rank
        expert_params_per_rank = 0.0
    ep = _expert_parallel(ctx, args, moe_layers_per_rank, overlap_compute_s, shared_forward_s)
    pp = _pipeline(ctx, args, forward_compute_s / hide if hide else 0.0)
    dp, fwd_left, bwd_left = _data_parallel(
        ctx, "dp", dense_params_per_rank, layers_per_rank, forward_compute_s, backward_compute_s
    )
    # Expert gradients share the backward with the dense ones: they hide in what is left.
    edp, _, _ = _data_parallel(
        ctx, "edp", expert_params_per_rank, moe_layers_per_rank, fwd_left, bwd_left
    )
    return CommTimes(
        tp=_tensor_parallel(ctx, args, layers_per_rank, holds_head),
        cp=_context_parallel(ctx, args, layers_per_rank, attention_compute_s),
        dp=dp,
        ep=ep,
        edp=edp,
        pp=pp,
    )


def _tensor_parallel(ctx: _Ctx, args: ModelArgs, layers: int, holds_head: bool) -> AxisComm:
    """Megatron-LM (Shoeybi et al. 2019, Sec. 3): per block per micro-batch two all-reduces of
    the [tokens, dim] activations in forward (after attention and after the FFN/MoE) and two of
    their gradients in backward; full recompute runs the forward's two again (6 instead of 4).
    Sequence parallelism (Korthikanti et al. 2022, Sec. 4.2.2) replaces each all-reduce by a
    reduce-scatter and an all-gather of the same size: twice the bytes by nccl-tests' count,
    the same ring time. Without loss parallelism the head all-gathers the [tokens, vocab]
    logits once per micro-batch and per MTP module; under it (Megatron-LM's vocab-parallel
    cross-entropy, and dstrain's trainer's, `train/loss.py`) only the loss's [tokens]
    statistics are all-reduced, which is left out. All of it is exposed: every collective sits
    between two matmuls that need its result."""
    tp = ctx.layout.tp
    if tp == 1:
        return AxisComm(group_size=1)
    size = ctx.tokens * args.dim * ACTIVATION_BYTES
    calls = (6 if ctx.recompute_full else 4) * layers * ctx.microbatches
    if ctx.layout.sequence_parallel:
        # The all-gathers cost what the reduce-scatters cost: same factor, same steps.
        out = ctx.axis("tp", "reduce_scatter", calls * size, calls)
        out.seconds *= 2
        out.bytes *= 2
    else:
        out = ctx.axis("tp", "all_reduce", calls * size, calls)
    if holds_head and not ctx.layout.traits.loss_parallel:
        gathers = ctx.microbatches * (1 + args.num_mtp_modules)
        logits = gathers * ctx.tokens * args.vocab_size * ACTIVATION_BYTES
        out.seconds += ctx.time("tp", "all_gather", logits, gathers)
        out.bytes += logits
    out.exposed_seconds = out.seconds
    return out


def _expert_parallel(
    ctx: _Ctx,
    args: ModelArgs,
    moe_layers: int,
    overlap_compute_s: float,
    shared_forward_s: float,
) -> AxisComm:
    """GShard (Lepikhin et al. 2020) / Switch routing as in the DeepSeek-V3 report (Sec. 3.2):
    per MoE layer per micro-batch a dispatch and a combine all-to-all in forward and the same
    two in backward (two more under full recompute, and under the trainer's selective one, which
    runs the routed experts again whole), each of the token copies this rank routes:
    tokens * top_k * dim * 2 bytes, over tp under moe_tp = split_tokens (each tp rank routes
    its share; under repeat every tp rank routes the full set).

    Exposed: what the trainer overlaps, no more (`parallel.pp_overlap`, `parallel.ep_overlap`).
    The chunks in DualPipeV's overlapped pairs (`Layout.paired_share`) hide their all-to-alls
    behind the other chunk's compute, up to `overlap_compute_s`; of the other chunks, the
    forward dispatch (a quarter of the calls, a sixth under full recompute) hides behind the
    shared experts' forward (`shared_forward_s`) with ep_overlap; the rest is exposed."""
    if ctx.layout.ep == 1 or moe_layers == 0:
        return AxisComm(group_size=ctx.layout.ep)
    size = ctx.tokens / ctx.layout.routed_split * args.num_activated_experts * args.dim
    size *= ACTIVATION_BYTES
    # dstrain's selective recompute runs its routed experts again whole, all-to-alls included
    again = ctx.recompute_full or (
        ctx.layout.recompute == "selective" and ctx.layout.traits.selective_matmuls is None
    )
    calls = (6 if again else 4) * moe_layers * ctx.microbatches
    out = ctx.axis("ep", "all_to_all", calls * size, calls)
    paired = ctx.layout.paired_share
    hidden = min(paired * out.seconds, overlap_compute_s)
    if ctx.layout.ep_overlap:
        dispatch = (1 - paired) * out.seconds * moe_layers * ctx.microbatches / calls
        hidden += min(dispatch, (1 - paired) * shared_forward_s)
    out.exposed_seconds = max(0.0, out.seconds - hidden)
    return out


def _pipeline(ctx: _Ctx, args: ModelArgs, forward_compute_s: float) -> AxisComm:
    """Narayanan et al. 2021 (Sec. 2.2): per micro-batch and stage chunk this rank holds, one
    p2p send of the [tokens, dim] activations forward and one of their gradients backward
    (v chunks per rank: `stages_per_rank`).

    Exposed, by how the runtime posts them:
    - gpipe and 1f1b (torch's single-stage schedules, like Megatron-LM's non-interleaved
      1F1B): each step sends and receives in one batch and waits for it before the next
      compute, so every hop is on the critical path;
    - interleaved-1f1b, zbv and dualpipev (torch's multi-stage runtime, `_add_send_recv`,
      places each receive as early as the sender's compute allows, as Megatron-LM's
      `--overlap-p2p-communication` does): a hop hides behind the chunks computed while it
      travels. What stays exposed is the fill and the drain, where a rank has nothing to do
      but wait (p - 1 hops each way), and any hop slower than the forward chunk it hides
      behind (`forward_compute_s` is the step's forward compute on this rank)."""
    layout = ctx.layout
    if layout.pp == 1:
        return AxisComm(group_size=1)
    v = stages_per_rank(layout.schedule, layout.virtual_stages)
    hops = 2 * v * ctx.microbatches
    out = ctx.axis("pp", "p2p", hops * ctx.tokens * args.dim * ACTIVATION_BYTES, hops)
    if layout.schedule not in ("gpipe", "1f1b"):
        hop = out.seconds / hops
        chunk = forward_compute_s / (v * ctx.microbatches)
        fill_and_drain = 2 * (layout.pp - 1) * hop
        out.exposed_seconds = min(out.seconds, fill_and_drain + hops * max(0.0, hop - chunk))
    return out


def _kv_width(args: ModelArgs, tp: int) -> int:
    """Key and value elements per token on one tp rank, as ring attention exchanges them: MLA's
    up-projected keys (nope + rope) and values per local head; MHA's kv heads."""
    if args.attention == "mla":
        heads = -(-args.num_heads // tp)
        return heads * (args.qk_nope_head_dim + args.qk_rope_head_dim + args.v_head_dim)
    head_dim, _ = score_head_dims(args)
    return 2 * -(-args.kv_heads // tp) * head_dim


def _context_parallel(
    ctx: _Ctx, args: ModelArgs, layers: int, attention_compute_s: float
) -> AxisComm:
    """dstrain's trainer (`cp_gather`, `parallel/context_parallel.py`): per block per
    micro-batch one all-gather of what each token contributes to the keys and values (MLA's
    latent and rotated RoPE key; MHA's keys and values) over the whole sequence, and one
    reduce-scatter of its gradient in backward; full recompute gathers again. nccl-tests' size
    is the gathered sequence's. All exposed: the gather sits between two matmuls of the block.
    Other engines: ring attention (Liu et al. 2023, `_ring`)."""
    cp = ctx.layout.cp
    if cp == 1:
        return AxisComm(group_size=1)
    if not ctx.layout.traits.cp_gather:
        return _ring(ctx, args, layers, attention_compute_s)
    size = ctx.tokens * cp * _gathered_width(args, ctx.layout.tp) * ACTIVATION_BYTES
    calls = (3 if ctx.recompute_full else 2) * layers * ctx.microbatches
    out = ctx.axis("cp", "all_gather", calls * size, calls)  # reduce-scatters cost the same
    out.exposed_seconds = out.seconds
    return out


def _gathered_width(args: ModelArgs, tp: int) -> int:
    """Elements per token the trainer's context parallelism gathers on one tp rank: MLA's
    latent and RoPE key (replicated over tp), MHA's keys and values of its kv heads."""
    if args.attention == "mla":
        return args.kv_lora_rank + args.qk_rope_head_dim
    head_dim, _ = score_head_dims(args)
    return 2 * -(-args.kv_heads // tp) * head_dim


def _ring(ctx: _Ctx, args: ModelArgs, layers: int, attention_compute_s: float) -> AxisComm:
    """Ring attention (Liu et al. 2023), as other engines run context parallelism: per block
    per micro-batch each rank passes its KV block (tokens * kv width * 2 bytes) cp-1 times
    around the ring in forward ((cp-1)/cp of the sequence's KV), and twice as much in backward
    (keys/values again and their gradients); full recompute adds a forward. The hops overlap
    the attention blocks they feed: exposed = max(0, time - attention_compute_s)."""
    cp = ctx.layout.cp
    size = ctx.tokens * _kv_width(args, ctx.layout.tp) * ACTIVATION_BYTES
    hops = (cp - 1) * (4 if ctx.recompute_full else 3) * layers * ctx.microbatches
    out = ctx.axis("cp", "p2p", hops * size, hops)
    out.exposed_seconds = max(0.0, out.seconds - attention_compute_s)
    return out


def _data_parallel(
    ctx: _Ctx,
    axis: str,
    params: float,
    units: int,
    forward_s: float,
    backward_s: float,
) -> tuple[AxisComm, float, float]:
    """Gradient (and ZeRO parameter) traffic over `axis` ("dp": dense, "edp": experts), with
    `units` blocks FSDP wraps; returns it and the forward and backward compute left to hide more.

    ZeRO (Rajbhandari et al. 2020, Sec. 7) as the trainer runs it:
    - 0 (DDP): one all-reduce of the fp32 gradients per step, in 25 MiB buckets, during the
      last micro-batch's backward (`no_sync` before): exposed = max(0, reduce - backward/m) plus
      the last bucket. Expert gradients (and, under offload, at any stage) are all-reduced after
      backward (`reduce_expert_grads`), all exposed.
    - 1 (FSDP2, gradient sync deferred to the last micro-batch): one all-gather of the
      parameters per step (param dtype: bf16, or fp32 when the trainer sets no param_dtype),
      in the first micro-batch's forward, and one reduce-scatter of the fp32 gradients, in the
      last micro-batch's backward. ZeRO-2 and 3 under PP run the same way (upstream's stages defer
      the sync).
    - 2 (FSDP2, reshard_after_forward=False): per micro-batch, an all-gather in forward and a
      reduce-scatter in backward; FSDP2 reshards after every backward.
    - 3 (FSDP2, reshard_after_forward=True): the same plus an all-gather in backward: the
      paper's 3 Psi against 2 Psi per micro-batch (in elements; bytes differ by dtype).
    FSDP2 prefetches gathers and reduces block by block: forward gathers hide in the forward
    compute of the micro-batches that gather, backward ones likewise, except the last block's
    reduce-scatter: exposed = max(0, fwd comm - forward) + max(0, bwd comm - backward) + last.
    """
    n, stride = ctx.spans[axis]
    if n == 1 or params <= 0:
        return AxisComm(group_size=n), forward_s, backward_s
    zero, m = ctx.layout.zero, ctx.microbatches
    grads = params * GRAD_BYTES
    # The trainer keeps experts out of FSDP under offload (FSDP2 offloads per module).
    if zero == 0 or (axis == "edp" and ctx.layout.offload):
        return _ddp(ctx, axis, grads, units, backward_s / m), forward_s, backward_s
    units = max(units, 1)
    # Under PP the modules stay unsharded for the whole step (ZeRO-2 and 3 alike) and the
    # gradient sync waits for the last micro-batch.
    pipelined = ctx.layout.pp > 1
    rounds = 1 if zero == 1 or pipelined else m
    gather = rounds * params * (2 if ctx.layout.precision == "bf16" else 4)
    fwd = ctx.time(axis, "all_gather", gather, rounds * units)
    bwd_gather = fwd if zero == 3 and not pipelined else 0.0
    reduce = ctx.time(axis, "reduce_scatter", rounds * grads, rounds * units)
    last = reduce / (rounds * units)  # one block's: the model is linear in bytes and calls
    bwd = bwd_gather + reduce
    fwd_window, bwd_window = forward_s * rounds / m, backward_s * rounds / m
    exposed = max(0.0, fwd - fwd_window) + min(bwd, max(0.0, bwd - bwd_window) + last)
    nbytes = gather * (2 if bwd_gather else 1) + rounds * grads
    algorithm = collective("reduce_scatter", grads, n, stride, ctx.cluster, ctx.consts)[1]
    out = AxisComm(nbytes, fwd + bwd, exposed, link_kind(n, stride, ctx.cluster), n, algorithm)
    return out, max(0.0, forward_s - fwd), max(0.0, backward_s - bwd)


def _ddp(ctx: _Ctx, axis: str, grads: float, units: int, last_backward_s: float) -> AxisComm:
    """ZeRO-0 of `_data_parallel`. DDP's dense buckets reduce during the last micro-batch's
    backward (`last_backward_s`); the experts' w1, w2, w3 of each MoE layer are all-reduced one
    by one after it."""
    buckets = -(-grads // BUCKET_BYTES)
    out = ctx.axis(axis, "all_reduce", grads, buckets if axis == "dp" else 3 * max(units, 1))
    if axis == "dp":
        last = out.seconds / buckets  # one bucket's: the model is linear in bytes and calls
        out.exposed_seconds = min(out.seconds, max(0.0, out.seconds - last_backward_s) + last)
    return out
