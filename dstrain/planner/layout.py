"""What the planner evaluates: a parallel layout on a cluster. Plain data, no torch.

Degrees follow the trainer's (`ParallelDims`): world = pp x dp x cp x tp, and ep folds over
dp x cp x tp (expert-parallel ranks are borrowed from the data/tensor ranks, not added), so the
experts' own data-parallel degree is dp x cp x tp / ep.
"""

from dataclasses import dataclass
from typing import Any

from dstrain.config.batch import run_batch
from dstrain.errors import UserError
from dstrain.hardware import GPUSpec
from dstrain.planner.engines import ENGINES, Engine

RECOMPUTE = ("none", "selective", "full")
PRECISIONS = ("bf16", "fp16", "fp8", "fp32")
# "flash": the newest fused kernel for the GPU (FlashAttention-3 / cuDNN on Hopper, which torch's
# SDPA prefers there from 2.9, as Transformer Engine does); "flash2": FlashAttention-2 (torch's
# SDPA on Hopper up to 2.8); "unfused": softmax(QK^T)V in separate kernels (engines before
# FlashAttention), which save the s x s scores.
ATTENTION_KERNELS = ("flash", "flash2", "unfused")


@dataclass(frozen=True)
class Layout:
    dp: int
    tp: int = 1
    pp: int = 1
    ep: int = 1
    cp: int = 1
    zero: int = 1  # 0 plain DP, 1 optimizer states, 2 + gradients, 3 + parameters
    micro_batch: int = 1  # sequences per micro-batch per data-parallel rank
    global_batch: int = 1024  # sequences per optimizer step
    seq_len: int = 4096
    schedule: str = "1f1b"
    virtual_stages: int = 1  # interleaved-1f1b only; V schedules always hold 2 stages
    recompute: str = "none"
    precision: str = "bf16"
    sequence_parallel: bool = False
    offload: bool = False  # optimizer states (and fp32 master weights) in host memory
    adam_moments: str = "fp32"  # or "bf16": Adam's two moments in 16 bits
    moe_tp: str = "split_tokens"  # or "repeat": every tp rank routes every token (the trainer's)
    ep_overlap: bool = True  # shared experts run while the dispatch is in flight (parallel.*)
    pp_overlap: bool | None = None  # DualPipeV's OVERLAP_F_B pairs overlapped (None: auto, on GPUs)
    attention: str = "flash"  # one of ATTENTION_KERNELS: "flash" is what dstrain runs
    # the engine that runs it (`planner/engines.py`): dstrain's trainer, or the engine a
    # published run was made with
    engine: str = "dstrain"

    @property
    def split_recompute_share(self) -> float:
        """Share of this rank's backward chunks whose checkpointed regions dstrain's trainer
        recomputes twice: the schedules that split a backward into input- and weight-gradient
        passes run two autograd graph tasks, and torch recomputes a region once per graph task
        (`parallel/activation_checkpoint.py`; the per-op policy is kept in both). Every chunk
        under zbv; under dualpipev, 2pp - 1 - r of pipeline rank r's 2m (upstream's order, the
        rest run one full backward), the first rank's taken. Other engines recompute once."""
        if self.recompute == "none" or self.engine != "dstrain" or self.pp == 1:
            return 0.0
        if self.schedule == "zbv":
            return 1.0
        if self.schedule == "dualpipev":
            return min(1.0, (2 * self.pp - 1) / (2 * self.microbatches))
        return 0.0

    @property
    def traits(self) -> Engine:
        return ENGINES[self.engine]

    @property
    def loss_vocab_split(self) -> int:
        """Ranks the loss's logits are split over: tp under the engine's loss parallelism."""
        return self.tp if self.traits.loss_parallel else 1

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    @property
    def expert_dp(self) -> int:
        """Ranks holding the same experts (their data-parallel degree)."""
        return self.dp * self.cp * self.tp // self.ep

    @property
    def expert_shard(self) -> int:
        """Ranks ZeRO shards the routed experts' states over: their data-parallel ranks under
        expert parallelism; without it they are ordinary parameters, replicated over tp and
        sharded over dp x cp like the rest."""
        return self.expert_dp if self.ep > 1 else self.dp * self.cp

    @property
    def routed_split(self) -> int:
        """Ranks the routed work of one micro-batch's tokens is split over within a tp group:
        tp under `moe_tp = split_tokens` (each routes its share), 1 under `repeat`."""
        return self.tp if self.moe_tp == "split_tokens" else 1

    @property
    def paired_share(self) -> float:
        """Share of this rank's chunks that run in DualPipeV's overlapped forward/backward pairs
        (`parallel/pipeline_overlap.py`): 0 unless dualpipev with pp_overlap on. Upstream's order
        gives pipeline rank r 2m - (3pp - 1 - min(r, pp - 2)) pairs among its 2m forward chunks
        (checked against torch's order in tests); the first rank, with the fewest, is taken."""
        if self.schedule != "dualpipev" or self.pp == 1 or self.pp_overlap is False:
            return 0.0
        chunks = 2 * self.microbatches
        return max(0, chunks - (3 * self.pp - 1)) / chunks

    @property
    def microbatches(self) -> int:
        """Micro-batches per step per data-parallel rank (gradient accumulation steps)."""
        return self.global_batch // (self.dp * self.micro_batch)

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len

    def with_(self, **changes: object) -> "Layout":
        # Not dataclasses.replace: the search makes ~10^5 of these, and replace is 3x slower.
        return Layout(**{**self.__dict__, **changes})

    def describe(self) -> str:
        """Short: `dp128 pp16 ep64 z1 mb1 dualpipev ac:sel` (degrees of 1 left out)."""
        axes = [f"dp{self.dp}"] + [
            f"{a}{getattr(self, a)}" for a in ("tp", "pp", "ep", "cp") if getattr(self, a) > 1
        ]
        extra = [f"z{self.zero}", f"mb{self.micro_batch}"]
        if self.pp > 1:
            extra.append(self.schedule)
        if self.schedule == "interleaved-1f1b" and self.pp > 1:
            extra.append(f"v{self.virtual_stages}")
        if self.recompute != "none":
            extra.append(f"ac:{self.recompute[:3]}")
        if self.sequence_parallel and self.tp > 1:
            extra.append("sp")
        if self.offload:
            extra.append("offload")
        if self.attention != "flash":
            extra.append(f"attn:{self.attention}")
        return " ".join(axes + extra)


@dataclass(frozen=True)
class Cluster:
    gpu: GPUSpec
    num_gpus: int
    gpus_per_node: int = 8
    inter_node_gbps: float = 50.0  # per GPU, one direction (NDR: one 400 Gb/s NIC per GPU)

    @property
    def nodes(self) -> int:
        return -(-self.num_gpus // self.gpus_per_node)

    def link_gbps(self, group_span: int) -> float:
        """Per-GPU bandwidth of a group of `group_span` consecutive ranks: the node's fabric
        while it fits in a node, else the network."""
        if group_span <= self.gpus_per_node:
            return self.gpu.intra_node_gbps
        return self.inter_node_gbps


def layout_from_config(config: Any, world: int) -> Layout:
    """The planner's layout of a run's config (a `DstrainConfig`) on `world` ranks."""
    p, t = config.parallel, config.train
    others = p.dp_replicate * p.cp * p.tp * p.pp
    dp = p.dp_replicate * (p.dp_shard if p.dp_shard > 0 else world // others)
    plan, _ = run_batch(config, dp)
    if plan is None:
        raise UserError("the run's batch sizes do not resolve", "`dstrain check` the config")
    return Layout(
        dp=dp,
        tp=p.tp,
        pp=p.pp,
        ep=p.ep,
        cp=p.cp,
        zero=p.zero_stage,
        micro_batch=plan.micro_batch_size,
        global_batch=plan.global_batch_size,
        seq_len=t.seq_len,
        schedule=p.pp_schedule,
        virtual_stages=p.num_virtual_stages,
        recompute=t.activation_checkpoint,
        precision=t.precision,
        sequence_parallel=p.sequence_parallel,
        offload=p.offload_optimizer,
        moe_tp=p.moe_tp,
        adam_moments=config.optim.moments_dtype(t.precision),
        ep_overlap=p.ep_overlap,
        pp_overlap=p.pp_overlap,
    )
