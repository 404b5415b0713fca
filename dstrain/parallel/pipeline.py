"""Pipeline parallelism: the model cut into stages by layer name, one upstream `PipelineStage` per
chunk, and the schedule from `torch.distributed.pipelining` by name.

Stages. `num_stages = pp x v` chunks of consecutive layers; stage s lives on pp rank s % pp
(looped schedules: rank r holds r, r+pp, ...), except for the V-shaped schedules, where rank r
holds stages r and 2pp-1-r (upstream requires it and does not check it). The first stage keeps the
embedding, the last the final norm, head and MTP modules; `pp_first/last_stage_less_layers` give
those stages fewer blocks to pay for them.

MTP under PP. The MTP modules need the embedding of the next tokens, but the embedding lives on the
first stage. The last stage gets its own copy (`mtp_embed`), initialized from the same weights;
after every backward the two gradients are summed (`TiedEmbedding`), so both copies take the same
optimizer step and stay equal: Megatron's treatment of tied embeddings. The next tokens reach the
last stage as the `next_tokens` keyword of `schedule.step` on that rank (upstream passes keywords
to every stage of the rank that gives them).

Ranks call `schedule.step` with what their stages need: token ids on the rank of stage 0, labels
(`target`) on the rank of the last stage. The loss function runs on the last stage, per micro-batch.
"""

import contextlib
import copy
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
)
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import GraphExecGroup

from dstrain.config.parallel_dims import stage_trim
from dstrain.config.schema import DstrainConfig
from dstrain.errors import UserError
from dstrain.model.hf_load import HFCheckpoint
from dstrain.model.transformer import Transformer
from dstrain.parallel.context_parallel import ContextShard, context_shard
from dstrain.parallel.mesh import Meshes
from dstrain.parallel.parallelize import parallelize_model
from dstrain.parallel.pipeline_overlap import has_overlap_actions, overlap_pairs, register_overlap
from dstrain.planner.stages import V_SHAPED, balanced_split, split_layers, stage_indices

SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved-1f1b": ScheduleInterleaved1F1B,
    "zbv": ScheduleZBVZeroBubble,
    "dualpipev": ScheduleDualPipeV,
}


def carve_stage(model: Transformer, layers: range, *, first: bool, last: bool) -> Transformer:
    """A Transformer holding `model`'s modules for one stage (shared, not copied), except the
    last stage's MTP embedding, which is a copy (see the module docstring; on `meta` it costs
    nothing, and the initialiser gives it the embedding's weights)."""
    with torch.device("meta"):
        chunk = Transformer(model.args)  # a skeleton; every module below is replaced
    chunk.rope = model.rope
    chunk.layers = nn.ModuleDict({str(i): model.layers[str(i)] for i in layers})
    chunk.embed = model.embed if first else None
    chunk.norm = model.norm if last else None
    chunk.head = model.head if last else None
    chunk.mtp = model.mtp if last else None
    if last and model.mtp is not None and not first:
        chunk.mtp_embed = copy.deepcopy(model.embed)
    return chunk


class PipelineModel(nn.Module):
    """This rank's stage chunks seen as one module, with the one-process model's parameter names
    (`layers.3.attention...`), for the optimizer, state dicts, checkpoints and MoE statistics.
    The schedule runs the chunks; this module is never called."""

    def __init__(self, chunks: list[Transformer]) -> None:
        super().__init__()
        self.layers = nn.ModuleDict()
        for chunk in chunks:
            for name, module in ("embed", chunk.embed), ("norm", chunk.norm), ("head", chunk.head):
                if module is not None:
                    self.add_module(name, module)
            if chunk.mtp is not None:
                self.mtp = chunk.mtp
            if chunk.mtp_embed is not None:
                self.mtp_embed = chunk.mtp_embed
            self.layers.update(chunk.layers)

    def forward(self, *args: object) -> None:
        raise RuntimeError("a pipeline model runs through its schedule, not by calling it")


@dataclass
class TiedEmbedding:
    """The embedding of the first stage and its MTP copy on the last stage. `group` joins the two
    ranks holding them (None: one rank holds both)."""

    first: nn.Embedding | None
    copy: nn.Embedding | None
    group: dist.ProcessGroup | None

    def sum_grads(self) -> None:
        """Both copies get the gradient of the one shared embedding: the sum of the two."""
        if self.group is None:
            if self.first is not None and self.copy is not None:
                total = _local(self.first.weight.grad) + _local(self.copy.weight.grad)
                _local(self.first.weight.grad).copy_(total)
                _local(self.copy.weight.grad).copy_(total)
            return
        mine = self.first if self.first is not None else self.copy
        if mine is not None:
            dist.all_reduce(_local(mine.weight.grad), group=self.group)


def _local(grad: torch.Tensor) -> torch.Tensor:
    return grad._local_tensor if isinstance(grad, DTensor) else grad


@dataclass
class Pipeline:
    """What the training step needs from the pipeline on this rank."""

    schedule: object  # an upstream _PipelineSchedule
    stages: list[PipelineStage]
    model: PipelineModel
    group: dist.ProcessGroup
    loss: "PipelineLoss"
    tied: TiedEmbedding | None
    router_names: list[str] = field(default_factory=list)
    layers: list[range] = field(default_factory=list)  # of every stage, for the start-up log
    holders: list[int] = field(default_factory=list)  # stage index -> the pp rank holding it
    tp_mesh: object = None  # the DeviceMesh of the DTensor activations stages hand on (TP + SP)
    context: ContextShard | None = None  # this rank's part of each sequence (cp)

    @property
    def has_first(self) -> bool:
        return any(stage.is_first for stage in self.stages)

    @property
    def has_last(self) -> bool:
        return any(stage.is_last for stage in self.stages)


class PipelineLoss:
    """The schedule's loss function, called on the last stage once per micro-batch. The step sets
    `fn` (outputs, labels) -> (loss to back-propagate, detached parts) before each
    `schedule.step`; the parts of the real micro-batches add up in `parts`."""

    def __init__(self) -> None:
        self.fn: Callable[[object, torch.Tensor], tuple[torch.Tensor, dict]] | None = None
        self.parts: dict[str, torch.Tensor] = {}
        self.inferring = False

    def __call__(self, outputs: object, labels: torch.Tensor) -> torch.Tensor:
        assert self.fn is not None, "PipelineLoss.fn is set by the step before schedule.step"
        total, parts = self.fn(outputs, labels)
        if not self.inferring:
            for key, value in parts.items():
                self.parts[key] = self.parts[key] + value if key in self.parts else value
        return total


def _quiet_metadata_inference(
    schedule: object, loss: PipelineLoss, model: nn.Module, stages: list[PipelineStage]
) -> None:
    """Upstream infers the stages' shapes on the first `step` by running each stage's forward
    (real tokens on stage 0, uninitialized tensors elsewhere) and the loss function once more.
    Those calls must not count: the loss ignores them, the routers forget the tokens they
    counted, and DDP must not arm its gradient hooks for them (it would then record every
    parameter twice and fail its bucket rebuild on the second step). Hooked on
    `_initialize_pp_stages`, which Single and Multi schedules both call."""
    original = schedule._initialize_pp_stages  # type: ignore[attr-defined]
    routers = [m for m in model.modules() if type(m).__name__ == "Router"]
    ddp = [s.submod for s in stages if isinstance(s.submod, DistributedDataParallel)]

    def initialize(*args: object, **kwargs: object) -> object:
        loss.inferring = True
        try:
            with contextlib.ExitStack() as no_sync:
                for module in ddp:
                    no_sync.enter_context(module.no_sync())
                return original(*args, **kwargs)
        finally:
            loss.inferring = False
            for router in routers:
                router.tokens_per_expert.zero_()

    schedule._initialize_pp_stages = initialize  # type: ignore[attr-defined]


def build_pipeline(
    model: Transformer,
    config: DstrainConfig,
    meshes: Meshes,
    microbatches: int,
    *,
    device: torch.device | None,
    weights: HFCheckpoint | None = None,
) -> Pipeline:
    """Carve this rank's stages out of the full model (on `meta`: it costs no memory),
    parallelize each chunk on the non-pp axes and materialise it on `device` (None: stay on
    meta, a dry run), wrap each in a `PipelineStage` and build the schedule. The layers of other
    stages are never materialised here."""
    p = config.parallel
    pp_mesh = meshes["pp"]
    pp, rank = pp_mesh.size(), pp_mesh.get_local_rank()
    v = 2 if p.pp_schedule in V_SHAPED else p.num_virtual_stages
    num_stages = pp * v
    if p.pp_first_stage_less_layers is None and p.pp_last_stage_less_layers is None:
        layers = balanced_split(model.args, config.train.seq_len, p.pp_schedule, pp, v)
    else:
        first, last = stage_trim(
            model.args.num_layers,
            num_stages,
            p.pp_first_stage_less_layers,
            p.pp_last_stage_less_layers,
        )
        layers = split_layers(model.args.num_layers, num_stages, first, last)
    router_names = [n for n, m in model.named_modules() if type(m).__name__ == "Router"]
    mine = stage_indices(p.pp_schedule, pp, v, rank)
    chunks = [carve_stage(model, layers[s], first=s == 0, last=s == num_stages - 1) for s in mine]
    union = PipelineModel(chunks)  # before DDP wrapping: the names stay the model's own
    tied = _tie_embeddings(union, meshes, p.pp_schedule) if model.mtp is not None else None
    stages = [
        PipelineStage(
            parallelize_model(chunk, config, meshes, device=device, weights=weights),
            s,
            num_stages,
            device or torch.device("meta"),
            group=pp_mesh.get_group(),
            get_mesh=_mesh_by_names(meshes),
        )
        for s, chunk in zip(mine, chunks, strict=True)
    ]
    loss = PipelineLoss()
    try:
        schedule = SCHEDULES[p.pp_schedule](
            stages if v > 1 else stages[0],
            n_microbatches=microbatches,
            loss_fn=loss,
            scale_grads=False,  # the loss is already normalized by global token counts
        )
    except (ValueError, AssertionError, RuntimeError) as exc:  # upstream's own shape checks
        raise UserError(
            f"torch.distributed.pipelining cannot run {p.pp_schedule} on {pp} ranks x {v} "
            f"stages with {microbatches} micro-batches: {exc}",
            "`dstrain check` on the config names the micro-batch and stage counts that work",
            exit_code=1,
        ) from exc
    _quiet_metadata_inference(schedule, loss, union, stages)
    for stage in stages:
        _one_recompute_per_weight_pass(stage)
    if overlap_pairs(p.pp_overlap, device) and has_overlap_actions(schedule):
        register_overlap(schedule, device or torch.device("meta"))
    holders = [0] * num_stages
    for r in range(pp):
        for s in stage_indices(p.pp_schedule, pp, v, r):
            holders[s] = r
    group = pp_mesh.get_group()
    tp_mesh = meshes["tp"] if meshes["tp"].size() > 1 else None
    return Pipeline(
        schedule,
        stages,
        union,
        group,
        loss,
        tied,
        router_names,
        layers,
        holders,
        tp_mesh,
        context_shard(meshes),
    )


def _one_recompute_per_weight_pass(stage: PipelineStage) -> None:
    """Upstream's weight-gradient pass (zbv, dualpipev) calls `autograd.grad` once per group of
    parameters, and non-reentrant checkpointing recomputes a region once per call (per graph
    task): a block with ten linear layers would run its forward ten times more. Under one
    `GraphExecGroup` (torch's API for disjoint backwards, pytorch#166536, made for zero-bubble
    schedules) the calls share one recompute; they may, because the groups are disjoint
    sub-graphs that never unpack one saved tensor twice."""
    original = stage.backward_weight_one_chunk

    def backward_weight_one_chunk(*args: object, **kwargs: object) -> object:
        with GraphExecGroup():
            return original(*args, **kwargs)

    stage.backward_weight_one_chunk = backward_weight_one_chunk  # type: ignore[method-assign]


def _mesh_by_names(meshes: Meshes) -> Callable[..., object]:
    """Upstream's lookup for the mesh of a DTensor crossing a stage boundary (sequence-parallel
    activations are sharded over `tp`)."""

    def get_mesh(names: tuple[str, ...], layout: object) -> object:
        return meshes[names[0]] if len(names) == 1 else meshes.dense[names]

    return get_mesh


def _tie_embeddings(union: PipelineModel, meshes: Meshes, schedule: str) -> TiedEmbedding:
    """Pair the first stage's embedding with the last stage's MTP copy. V-shaped schedules keep
    both on pp rank 0; otherwise they are on pp ranks 0 and pp-1, and each such pair of ranks
    (one per coordinate of the other axes) gets a 2-rank group. Every rank must create every
    group, in the same order (`new_group` is collective)."""
    first = getattr(union, "embed", None)
    mtp_copy = getattr(union, "mtp_embed", None)
    pp = meshes.dims.pp
    if schedule in V_SHAPED or pp == 1:
        return TiedEmbedding(first, mtp_copy, None)
    lines = meshes.dense.mesh.reshape(pp, -1)
    me, group = dist.get_rank(), None
    for column in lines.T.tolist():
        pair = [column[0], column[-1]]
        created = dist.new_group(pair, timeout=meshes.timeout)
        if me in pair:
            group = created
    return TiedEmbedding(first, mtp_copy, group)
