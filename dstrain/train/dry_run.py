"""A dry run: rank R's real runtime at any world size, built in one CPU process on torch's fake
process-group backend, with the model left on `meta`.

The same code path as training (`runtime.build_runtime`: the check's rules, meshes,
`parallelize_model` or the pipeline stages, the optimizer), then, where it can, one step under
fake tensors (no data, no compute) with torch's memory tracker. It needs no GPU and no network.

What it reports per rank (`RankReport`): the mesh coordinates and the size of every axis's group;
the stages and layers held; parameters, gradients and optimizer state in bytes, dense and expert
(`dstrain/parallel/state_bytes.py`); the peak while building (the local shards, buffers and the
initialiser's largest draw: the old path held the whole fp32 model, `full_model_bytes`); and the
activation peak of the step where one ran, and within it the loss's own peak (`loss_peak_bytes`:
the logits this rank holds and what the cross-entropy of every head allocates on them, forward
and backward; under TP a vocabulary shard, `train/loss.py`). Under PP the step runs each of the
rank's stages on one micro-batch (the saved activations it holds until that micro-batch's
backward, and the transient of the backward itself), and the schedule's order on this rank
(upstream's, via the simulator) says how many of each it holds at once.
`recompute_flops_per_step`: the FLOPs this rank runs again in backward per step under
activation checkpointing (`_RecomputeFlops`), each micro-batch's backward counted once per pass
that recomputes it (two where zbv or dualpipev split it into input- and weight-gradient passes).
`init_from` (with `model.init_from`): what this rank reads of the checkpoint (`InitFromReads`):
the loader itself runs on the rank's meta model, reading each slice it would fill (`read=True`:
the bytes are read and discarded; `False`: only counted, the pre-launch check), against the
rank's share, the bytes of the shards it holds in the checkpoint's dtypes.
"""

import contextlib
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import _clear_sharding_prop_cache
from torch.utils.flop_counter import FlopCounterMode

from dstrain.config.schema import DstrainConfig
from dstrain.model.attention import MHA, MLA
from dstrain.model.hf_adapter import to_hf
from dstrain.model.hf_files import Headers
from dstrain.model.hf_load import HFCheckpoint, expert_biases, load_parameters
from dstrain.model.init import BLOCK_ELEMENTS, canonical_name
from dstrain.model.transformer import Transformer
from dstrain.parallel.context_parallel import context_shard
from dstrain.parallel.distributed import World
from dstrain.parallel.expert_parallel import ExpertParallelExperts
from dstrain.parallel.materialize import local_box
from dstrain.parallel.mesh import Meshes
from dstrain.parallel.pipeline_sim import schedule_actions
from dstrain.parallel.state_bytes import FP32, state_bytes
from dstrain.planner.stages import V_SHAPED
from dstrain.train.loss import TokenCounts, labels_of, loss_terms, split_targets
from dstrain.train.runtime import Runtime, build_runtime
from dstrain.train.step import autocast, model_inputs

AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep", "efsdp")


@dataclass
class RankReport:
    rank: int
    world_size: int
    coords: dict[str, int]  # this rank's index on each mesh axis
    groups: dict[str, int]  # the size of each mesh axis's group
    stages: list[dict[str, Any]]  # per stage held: index, layers, embed/head/mtp
    params_bytes: dict[str, float]
    grads_bytes: dict[str, float]
    optimizer_bytes: dict[str, float]
    host_bytes: float  # offloaded to the CPU
    model_states_bytes: float
    build_peak_bytes: float
    full_model_bytes: float  # the old path: every rank built the whole fp32 model
    activation_peak_bytes: float | None = None
    loss_peak_bytes: float | None = None  # the logits held and the loss's peak over them (rank)
    recompute_flops_per_step: float | None = None  # run again in backward (module docstring)
    step: str = "not run"
    init_from: "InitFromReads | None" = None
    seconds: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class InitFromReads:
    """What a rank reads of `model.init_from` (module docstring)."""

    bytes: int  # read: its slices, their FP8 block scales, the MTP copies compared
    share_bytes: int  # its shards' elements at the checkpoint's bytes per element
    checkpoint_bytes: int
    files: int  # files it opens
    tensors: int  # slices read
    read: bool  # False: counted, not read


def dry_run_rank(
    config: DstrainConfig,
    world_size: int,
    rank: int,
    step: bool,
    read_init_from: bool = True,
    init_from_headers: Headers | None = None,
) -> RankReport:
    """Build `rank`'s runtime on the fake backend and report it; the group is torn down after.
    With `model.init_from`, run the loader on the rank's model (reading its slices, or with
    `read_init_from=False` only counting them; `init_from_headers`: the folder's, read once for
    all the ranks a caller plans)."""
    began = time.perf_counter()
    dist.init_process_group("fake", rank=rank, world_size=world_size)
    try:
        world = World(rank, world_size, rank % max(1, world_size), torch.device("meta"), "fake")
        runtime = build_runtime(config, world, materialize=False)
        built = time.perf_counter()
        report = _report(config, runtime, rank, world_size)
        report.seconds["build"] = built - began
        if config.model.init_from is not None:
            report.init_from = init_from_reads(config, runtime, read_init_from, init_from_headers)
            report.seconds["init_from"] = time.perf_counter() - built
            built = time.perf_counter()
        if step:
            (
                report.activation_peak_bytes,
                report.step,
                report.loss_peak_bytes,
                report.recompute_flops_per_step,
            ) = _step(config, runtime)
            report.seconds["step"] = time.perf_counter() - built
    finally:
        dist.destroy_process_group()
        # DTensor caches sharding propagation by spec, and a DeviceMesh compares equal to the
        # same-shaped mesh of the previous rank's (now destroyed) group: a cached output spec
        # would carry that mesh's group names into this rank's collectives ("Could not resolve
        # the process group"). Upstream's own tests clear it between meshes the same way.
        _clear_sharding_prop_cache()
    report.seconds["total"] = time.perf_counter() - began
    return report


def init_from_reads(
    config: DstrainConfig, runtime: Runtime, read: bool, headers: Headers | None = None
) -> InitFromReads:
    """The loader on each of the rank's model chunks, on `meta` (module docstring)."""
    assert config.model.init_from is not None
    checkpoint = HFCheckpoint(config.model.init_from, read_data=read, headers=headers)
    chunks = [_chunk(s.submod) for s in runtime.pipeline.stages] if runtime.pipeline else []
    loaded = 0
    try:
        for chunk in chunks or [_chunk(runtime.model)]:
            loaded += load_parameters(chunk, checkpoint, local_box).tensors
    finally:
        checkpoint.close()
    return InitFromReads(
        bytes=checkpoint.bytes_read,
        share_bytes=_share_bytes(runtime, checkpoint),
        checkpoint_bytes=checkpoint.total_bytes,
        files=len(checkpoint.files_read),
        tensors=loaded,
        read=read,
    )


def _share_bytes(runtime: Runtime, checkpoint: HFCheckpoint) -> int:
    """The elements of the rank's shards, each at its checkpoint tensor's bytes per element."""
    args = runtime.model_args
    total = 0
    for name, param in [*runtime.model.named_parameters(), *expert_biases(runtime.model)]:
        key = canonical_name(name)
        hf = next(iter(to_hf({key: torch.empty(param.shape, device="meta")}, args)), None)
        entry = checkpoint.tensors.get(hf) if hf else None
        if entry is None:
            continue
        local = param._local_tensor if isinstance(param, DTensor) else param
        total += local.numel() * entry.nbytes // max(1, math.prod(entry.shape))
    return total


def _report(config: DstrainConfig, runtime: Runtime, rank: int, world_size: int) -> RankReport:
    states = state_bytes(runtime.model, config, runtime.dims.pp)
    full = _full_model_bytes(runtime)
    return RankReport(
        rank=rank,
        world_size=world_size,
        coords=_coords(runtime.meshes),
        groups=_groups(runtime.meshes),
        stages=_stages(runtime),
        params_bytes=states.params,
        grads_bytes=states.grads,
        optimizer_bytes=states.optimizer,
        host_bytes=states.host,
        model_states_bytes=states.total,
        build_peak_bytes=_build_peak(runtime.model),
        full_model_bytes=full,
    )


def _coords(meshes: Meshes) -> dict[str, int]:
    return {axis: meshes[axis].get_local_rank() for axis in AXES}


def _groups(meshes: Meshes) -> dict[str, int]:
    sizes = {axis: meshes[axis].size() for axis in AXES}
    return sizes | {"dp": meshes["dp"].size(), "edp": meshes["edp"].size()}


def _stages(runtime: Runtime) -> list[dict[str, Any]]:
    if runtime.pipeline is None:
        model = runtime.model
        layers = [int(k) for k in model.layers] if hasattr(model, "layers") else []
        return [{"stage": 0, "layers": layers, "embed": True, "head": True, "mtp": True}]
    out = []
    for stage in runtime.pipeline.stages:
        chunk = _chunk(stage.submod)
        out.append(
            {
                "stage": stage.stage_index,
                "layers": [int(k) for k in chunk.layers],
                "embed": chunk.embed is not None,
                "head": chunk.head is not None,
                "mtp": chunk.mtp is not None,
            }
        )
    return out


def _chunk(module: torch.nn.Module) -> Transformer:
    return getattr(module, "module", module)  # DDP wraps


def _full_model_bytes(runtime: Runtime) -> float:
    from dstrain.model.flops import param_counts

    return float(param_counts(runtime.model_args).total * FP32)


def _build_peak(model: torch.nn.Module) -> float:
    """What materialising allocates: every local shard and buffer, plus the initialiser's
    largest draw (one block of rows of a global tensor, and the sampler's temporary)."""
    held, draw = 0, 0
    for param in model.parameters():
        local = param._local_tensor if hasattr(param, "_local_tensor") else param
        held += local.numel() * local.element_size()
        row = math.prod(param.shape[1:])
        draw = max(draw, min(param.numel(), max(1, BLOCK_ELEMENTS // max(row, 1)) * row))
    held += sum(b.numel() * b.element_size() for b in model.buffers())
    return float(held + 2 * FP32 * draw)


# ---- the step under fake tensors -------------------------------------------------------------


def _step(
    config: DstrainConfig, runtime: Runtime
) -> tuple[float | None, str, float | None, float | None]:
    """One micro-batch through this rank's model (or each of its stages) under fake tensors;
    returns (activation peak bytes, what ran, the loss's peak bytes: None without a head, the
    FLOPs recomputed per step)."""
    grouped = _grouped_mm_needs_bf16(config, runtime)
    if grouped:
        return None, f"not run: {grouped}", None, None
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    stages = [stage.submod for stage in runtime.pipeline.stages] if runtime.pipeline else []
    with fake:
        for module in (runtime.model, *stages):  # the stages hold the shared RoPE tables too
            module.to_empty(device="cpu")
    with fake:
        _chunk_masks(config, (runtime.model, *stages))
    with _balanced_dispatch(runtime.model):
        if runtime.pipeline is None:
            return _whole_model_step(config, runtime, fake)
        return _pipeline_step(config, runtime, fake)


def _chunk_masks(config: DstrainConfig, modules: tuple[torch.nn.Module, ...]) -> None:
    """Under context parallelism, build the chunks' causal masks before the memory is tracked:
    on the CPU attention takes one [L, end] mask per chunk, which a GPU does not hold (its fused
    kernels apply the bottom-right bias themselves), and the dry run reports a GPU rank."""
    shards = {
        id(m.context): m.context
        for root in modules
        for m in root.modules()
        if isinstance(m, MLA | MHA) and m.context is not None
    }  # one per pipeline stage: each was parallelized on its own
    for shard in shards.values():
        local = config.train.seq_len // shard.size
        for rows, start in shard.query_chunks(local):
            length = rows.stop - rows.start
            shard.chunk_mask(length, start + length, "cpu")


def _grouped_mm_needs_bf16(config: DstrainConfig, runtime: Runtime) -> str | None:
    """torch 2.13's meta kernel of `_grouped_mm` (what fake tensors run) takes bf16 only."""
    if runtime.model_args.num_routed_experts and config.train.precision == "fp8":
        return (
            "the routed experts' FP8 GEMMs split their rows by the expert counts, which fake "
            "tensors do not hold"
        )
    if runtime.model_args.num_routed_experts and config.train.precision != "bf16":
        return (
            "the routed experts' grouped GEMM has a bf16-only meta kernel in torch "
            f"{torch.__version__.split('+')[0]}, and this run is {config.train.precision}"
        )
    return None


@contextlib.contextmanager
def _balanced_dispatch(model: torch.nn.Module):
    experts = [m for m in model.modules() if isinstance(m, ExpertParallelExperts)]
    for module in experts:
        module.balanced = True
    try:
        yield
    finally:
        for module in experts:
            module.balanced = False


def _tokens(config: DstrainConfig, runtime: Runtime) -> torch.Tensor:
    shape = (runtime.batch.micro_batch_size, config.train.seq_len)
    return torch.randint(0, runtime.model_args.vocab_size, shape)


def _inputs(
    config: DstrainConfig, runtime: Runtime
) -> tuple[torch.Tensor, dict, list[torch.Tensor] | None]:
    """One micro-batch's model inputs on this rank, and each depth's targets where they are not
    the tokens': under context parallelism its part of the sequences, with each MTP depth's
    input tokens and targets (`step.model_inputs`, `loss.split_targets`)."""
    context = context_shard(runtime.meshes)
    if context is None:
        return _tokens(config, runtime), {}, None
    shape = (runtime.batch.micro_batch_size, config.train.seq_len + 1)
    batch = torch.randint(0, runtime.model_args.vocab_size, shape)
    depths = runtime.model_args.num_mtp_modules
    tokens, extra = model_inputs(batch, None, context, depths)
    return tokens, extra, split_targets(labels_of(batch), depths, context.split)


def _whole_model_step(
    config: DstrainConfig, runtime: Runtime, fake: FakeTensorMode
) -> tuple[float, str, float, float]:
    tracker, recompute = _tracker(runtime.model, runtime.optimizer), _RecomputeFlops()
    with fake:
        with tracker, recompute:
            tokens, extra, targets = _inputs(config, runtime)
            with autocast(config.train.precision, torch.device("cpu")):
                outputs = runtime.model(tokens, **extra)
            _loss(outputs, tokens, runtime, targets).backward()
        loss_peak = _loss_peak(outputs, tokens, runtime, targets)
        # Outside the tracker: its peak is the moment of the largest total, and the first
        # step's new Adam moments would make that a moment with no activations left.
        runtime.optimizer.step()
        runtime.optimizer.zero_grad(set_to_none=True)
    peak = tracker.get_tracker_snapshot("peak")
    ran = "ran: forward, backward and optimizer step of one micro-batch"
    recomputed = recompute.get_total_flops() * runtime.batch.grad_accum_steps
    return _activations(peak), ran, loss_peak, float(recomputed)


def _loss(
    outputs: object,
    tokens: torch.Tensor,
    runtime: Runtime,
    targets: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """The trainer's own loss (`train/loss.py`: each head's cross-entropy over its logits upcast
    to fp32), so the peak holds what the real step's loss holds; the tokens stand in as labels."""
    depths = len(outputs) if isinstance(outputs, tuple) else 1
    counts = TokenCounts(tuple(tokens.numel() for _ in range(depths)))
    weight = runtime.model_args.mtp_loss_weight
    total, _ = loss_terms(outputs, tokens, counts, weight, targets=targets)
    return total


def _loss_peak(
    outputs: object,
    tokens: torch.Tensor,
    runtime: Runtime,
    targets: list[torch.Tensor] | None = None,
) -> float:
    """The loss's own peak on this rank: the logits it holds (every head's, main and MTP) and
    the most the cross-entropy's forward and backward allocate on top of them, its gradient
    of the logits included. Measured on detached copies, apart from the step's tracker."""
    heads = outputs if isinstance(outputs, tuple) else (outputs,)
    leaves = tuple(_detached(h) for h in heads)
    held = sum(_local_bytes(h) for h in leaves)
    tracker = MemTracker()
    with tracker:
        heads_out = leaves if isinstance(outputs, tuple) else leaves[0]
        _loss(heads_out, tokens, runtime, targets).backward()
    return held + _activations(tracker.get_tracker_snapshot("peak"))


def _detached(t: torch.Tensor) -> torch.Tensor:
    """A copy of a head's output that starts a graph. A DTensor's is built on a plain leaf: under
    fake tensors the gradient of a DTensor leaf is counted at more than twice its real size."""
    if isinstance(t, DTensor):
        local = t.to_local().detach().requires_grad_()
        return DTensor.from_local(local, t.device_mesh, t.placements, run_check=False)
    return t.detach().requires_grad_()


def _local_bytes(t: torch.Tensor) -> float:
    local = t.to_local() if isinstance(t, DTensor) else t  # a DTensor's own shard
    return float(local.numel() * local.element_size())


def _tracker(module: torch.nn.Module, optimizer: object = None) -> MemTracker:
    """A memory tracker that tells activations from parameters. Under FSDP2 (ZeRO-1/2/3) the
    forward all-gathers the parameters into new storage, which a plain tracker would count as
    activations (and a pipeline stage's, once per micro-batch in flight); FSDP's own tracker
    files it under its unsharded parameters."""
    if isinstance(module, FSDPModule):
        return FSDPMemTracker(module, optimizer)
    tracker = MemTracker()
    tracker.track_external(*(x for x in (module, optimizer) if x is not None))
    return tracker


def _activations(snapshot: dict) -> float:
    """Activation and temporary bytes of a tracker snapshot (all devices)."""
    total = 0.0
    for categories in snapshot.values():
        for kind, value in categories.items():
            if str(kind).rsplit(".", 1)[-1] in ("ACT", "TEMP"):
                total += value
    return total


def _pipeline_step(
    config: DstrainConfig, runtime: Runtime, fake: FakeTensorMode
) -> tuple[float, str, float | None, float]:
    """Each stage on one micro-batch: the activations it holds from forward to backward, and
    the peak of running one; then the schedule's order on this rank."""
    held, transient, losses, recomputed, first = {}, {}, [], {}, set()
    for stage in runtime.pipeline.stages:
        i = stage.stage_index
        held[i], transient[i], loss, recomputed[i] = _stage_step(
            config, runtime, stage.submod, fake
        )
        losses += [] if loss is None else [loss]
        first |= {i} if stage.is_first else set()
    p = config.parallel
    v = 2 if p.pp_schedule in V_SHAPED else p.num_virtual_stages
    pp_rank = runtime.meshes["pp"].get_local_rank()
    order = schedule_actions(p.pp_schedule, p.pp, runtime.batch.grad_accum_steps, v)[pp_rank]
    # Each backward pass recomputes its stage's regions; on the first stage upstream's
    # input-gradient pass has no input gradient to compute and runs nothing (its W, all of it).
    passes = [a.stage for a in order if a.kind in "BW" or (a.kind == "I" and a.stage not in first)]
    holding = peak = 0.0
    for action in order:
        if action.kind == "F":
            holding += held[action.stage]
            peak = max(peak, holding + transient[action.stage])
        elif action.kind in ("B", "W"):
            peak = max(peak, holding + transient[action.stage])
            holding -= held[action.stage]
    stages = ", ".join(str(s) for s in held)
    return (
        peak,
        (
            f"ran: forward and backward of one micro-batch on stages {stages}; in flight per "
            f"upstream's {p.pp_schedule} order with {runtime.batch.grad_accum_steps} micro-batches"
        ),
        max(losses, default=None),
        float(sum(recomputed[s] for s in passes)),
    )


def _stage_step(
    config: DstrainConfig, runtime: Runtime, module: torch.nn.Module, fake: FakeTensorMode
) -> tuple[float, float, float | None, float]:
    """(bytes saved for backward after forward, peak extra while running it, the loss's peak:
    None without the head, FLOPs recomputed by one full backward) of one stage."""
    chunk = _chunk(module)
    tracker, recompute = _tracker(module), _RecomputeFlops()
    with fake, tracker, recompute:
        tokens, extra, targets = _inputs(config, runtime)
        if chunk.embed is not None:
            inputs = tokens
        else:
            dtype = torch.bfloat16 if config.train.precision in ("bf16", "fp8") else torch.float32
            shape = (*tokens.shape, runtime.model_args.dim)
            inputs = torch.randn(shape, dtype=dtype, requires_grad=True)
        kwargs = {}
        if chunk.mtp is not None and (chunk.embed is None or extra):
            # a last stage without the embedding takes MTP's tokens [B, S] (under cp, every
            # depth's part [B, D, L]); with it, they default to the tokens' own
            kwargs = {"next_tokens": extra.get("next_tokens", tokens)}
        with autocast(config.train.precision, torch.device("cpu")):
            outputs = module(inputs, **kwargs)
        after_forward = _activations(tracker.get_tracker_snapshot("current"))
        if chunk.head is not None:
            _loss(outputs, tokens, runtime, targets).backward()
        else:
            outputs.backward(torch.ones_like(outputs))
    peak = _activations(tracker.get_tracker_snapshot("peak"))
    loss_peak = None
    if chunk.head is not None:
        with fake:
            loss_peak = _loss_peak(outputs, tokens, runtime, targets)
    return after_forward, max(0.0, peak - after_forward), loss_peak, recompute.get_total_flops()


class _RecomputeFlops(FlopCounterMode):
    """torch's FLOP counter, counting only the forward that activation checkpointing runs again
    in backward: ops run with grad mode on inside an autograd graph task (the engine runs the
    backward's own ops with grad mode off; non-reentrant checkpointing turns it on to
    recompute). Outputs the selective policy keeps are replayed, not run, so not counted."""

    def __init__(self) -> None:
        # torch 2.13 has no formula for the routed experts' grouped GEMM
        grouped = {torch.ops.aten._grouped_mm: _grouped_mm_flops}
        super().__init__(display=False, custom_mapping=grouped)

    def _count_flops(self, func_packet: object, out: object, args: tuple, kwargs: dict) -> object:
        # torch 2.13's private id of the running graph task (-1 outside backward), the one
        # torch.utils.checkpoint keys its recomputation by
        if torch.is_grad_enabled() and torch._C._current_graph_task_id() != -1:
            return super()._count_flops(func_packet, out, args, kwargs)
        return out


def _grouped_mm_flops(
    a_shape: tuple, b_shape: tuple, *args: object, out_shape: tuple, **kwargs: object
) -> int:
    """[T, K] x [G, K, N] (or [G, M, K] x [G, K, N]) -> 2 x output x K; [K, T] x [T, N] with
    offsets (the weight gradient, [G, K, N]) -> 2 K T N."""
    if len(a_shape) == 2 and len(b_shape) == 2:
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]
    return 2 * math.prod(out_shape) * a_shape[-1]
