"""Where a model's layers and parameters sit under a layout: the pipeline stages each rank holds
and the parameters per GPU by kind (before ZeRO sharding). Shared by the memory, compute and
communication models.

Stage split: the trainer's default (`planner/stages.py`: of every legal trimming, the one whose
busiest rank has the fewest forward FLOPs, head and MTP included), or `check`'s trimming rule
where no split gives every stage a block. Stage placement: rank r
holds stage r (gpipe, 1f1b), stages r, r+p, ... (interleaved-1f1b), or stages r and 2p-1-r (zbv,
dualpipev), as `torch.distributed.pipelining` places them.

Parameter placement (the trainer's): attention projections, dense FFNs and shared experts are
split tp ways (Megatron-LM); MLA's down-projections (wq_a, wkv_a), norms and routers are
replicated across tp and counted whole; routed experts are split ep ways (whole experts per
rank, no expert TP); the embedding and the head are vocabulary-parallel over tp. Under PP the
last stage holds a copy of the embedding for the MTP modules (`parallel/pipeline.py`).
"""

from dataclasses import dataclass

from dstrain.config.model_args import ModelArgs
from dstrain.config.parallel_dims import stage_trim
from dstrain.model.flops import block_params, mtp_module_params
from dstrain.planner.bubble import stages_per_rank
from dstrain.planner.layout import Layout
from dstrain.planner.memo import per_model
from dstrain.planner.stages import balanced_split, stage_indices


@dataclass(frozen=True)
class RankShape:
    """One pipeline rank's share of the model."""

    rank: int
    dense_layers: int
    moe_layers: int
    has_embedding: bool
    has_head: bool  # the head, final norm and MTP modules
    dense_params: float  # per GPU, before ZeRO: everything but the routed experts
    expert_params: float  # per GPU: this rank's routed experts

    @property
    def layers(self) -> int:
        return self.dense_layers + self.moe_layers


@per_model
def stage_layers(args: ModelArgs, seq_len: int, schedule: str, pp: int, v: int) -> list[range]:
    """The layers of each stage (stage 0 first), split as the trainer splits by default: the
    FLOP-balanced split, or where no split gives every stage a block, `check`'s trimming rule."""
    balanced = balanced_split(args, seq_len, schedule, pp, v)
    if balanced:
        return balanced
    first, last = stage_trim(args.num_layers, pp * v, None, None)
    per = (args.num_layers + first + last) // (pp * v)
    sizes = [per] * (pp * v)
    sizes[0] -= first
    sizes[-1] = max(sizes[-1] - last, 0)
    starts = [sum(sizes[:i]) for i in range(pp * v)]
    return [range(start, start + size) for start, size in zip(starts, sizes, strict=True)]


def rank_shapes(args: ModelArgs, layout: Layout) -> list[RankShape]:
    """The ranks that can hold the most: the first, the last and (pp > 2) the second."""
    return list(
        _rank_shapes(
            args,
            layout.pp,
            layout.schedule,
            layout.virtual_stages,
            layout.tp,
            layout.ep,
            layout.seq_len,
        )
    )


@per_model
def _rank_shapes(
    args: ModelArgs, pp: int, schedule: str, virtual: int, tp: int, ep: int, seq_len: int
) -> tuple[RankShape, ...]:
    v = stages_per_rank(schedule, virtual)
    split = stage_layers(args, seq_len, schedule, pp, v)
    last_stage = pp * v - 1
    ranks = sorted({0, pp - 1, min(1, pp - 1)})
    shapes = []
    for rank in ranks:
        stages = stage_indices(schedule, pp, v, rank)
        layers = [i for s in stages for i in split[s]]
        moe = sum(1 for i in layers if _is_moe(args, i))
        shapes.append(
            _shape(
                args, rank, len(layers) - moe, moe, 0 in stages, last_stage in stages, tp, ep, pp
            )
        )
    return tuple(shapes)


def _is_moe(args: ModelArgs, layer: int) -> bool:
    return args.num_routed_experts > 0 and layer >= args.first_k_dense


def _shape(
    args: ModelArgs,
    rank: int,
    dense_layers: int,
    moe_layers: int,
    embedding: bool,
    head: bool,
    tp: int,
    ep: int,
    pp: int,
) -> RankShape:
    dense_block, moe_block = block_params(args, moe=False), block_params(args, moe=True)
    dense = dense_layers * _dense_part(dense_block, args, tp) + moe_layers * _dense_part(
        moe_block, args, tp
    )
    experts = moe_layers * moe_block.routed_experts / ep
    if embedding:
        dense += args.vocab_size * args.dim / tp
    if head:
        dense += args.vocab_size * args.dim / tp + args.dim
        mtp = mtp_module_params(args)
        dense += args.num_mtp_modules * (_dense_part(mtp.block, args, tp) + mtp.own)
        experts += args.num_mtp_modules * mtp.block.routed_experts / ep
        if args.num_mtp_modules and pp > 1:  # the last stage's copy of the embedding for MTP
            dense += args.vocab_size * args.dim / tp
    return RankShape(rank, dense_layers, moe_layers, embedding, head, dense, experts)


def _dense_part(block, args: ModelArgs, tp: int) -> float:
    """A block's parameters besides the routed experts, per GPU under tp."""
    replicated = block.norms + block.router + _down_projections(args)
    split = block.attention - _down_projections(args) + block.dense_ffn + block.shared_experts
    return replicated + split / tp


def _down_projections(args: ModelArgs) -> int:
    """MLA's wq_a and wkv_a, replicated across tp (their outputs are small latents)."""
    if args.attention != "mla":
        return 0
    return args.q_lora_rank * args.dim + (args.kv_lora_rank + args.qk_rope_head_dim) * args.dim
