"""A forward-only pass through the pipeline's stages, for validation.

Why not the schedule's own `eval`: upstream runs the schedule's whole action list with backward
turned off, and the zero-bubble and DualPipeV schedules (their I/W actions) then fail ("can't
steal_bwd_input if this stage doesn't have backward", torch 2.13). Validation needs no overlap:
here every rank walks the same global order, micro-batch by micro-batch and stage by stage,
running the stages it holds and passing activations to the next stage's rank point to point
(a small header first: shape, dtype, and for the DTensor activations of TP + SP their sharding),
so the sends and receives pair up under any stage placement, looped or V-shaped.
"""

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from dstrain.parallel.pipeline import Pipeline

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_MAX_DIMS = 4


def forward_only(
    pipe: Pipeline, inputs: list[torch.Tensor], next_tokens: list[torch.Tensor] | None
) -> list[object]:
    """Each micro-batch through every stage; the last stage's outputs, one per micro-batch, on
    the rank that holds it (elsewhere an empty list). `inputs`: the micro-batches' token ids
    (read on the first stage's rank); `next_tokens`: token i+1 at position i, for MTP."""
    me = dist.get_rank(pipe.group)
    held = {stage.stage_index: stage for stage in pipe.stages}
    last = len(pipe.holders) - 1
    device = pipe.stages[0].device
    outputs = []
    for i, tokens in enumerate(inputs):
        x: object = tokens
        for s, holder in enumerate(pipe.holders):
            if holder != me:
                continue
            if s > 0 and pipe.holders[s - 1] != me:
                x = _recv(pipe, pipe.holders[s - 1], device)
            kwargs = {} if next_tokens is None else {"next_tokens": next_tokens[i]}
            x = held[s].submod(x, **kwargs)
            if s == last:
                outputs.append(x)
            elif pipe.holders[s + 1] != me:
                _send(x, pipe.group, pipe.holders[s + 1])
    return outputs


def _send(x: torch.Tensor, group: dist.ProcessGroup, to: int) -> None:
    """Header [ndim, shape.., dtype, DTensor shard dim (-1: Replicate, -2: a plain tensor)],
    then the (local) data."""
    layout = -2
    if isinstance(x, DTensor):
        (placement,) = x.placements
        layout = placement.dim if isinstance(placement, Shard) else -1
        x = x.to_local()
    shape = list(x.shape) + [0] * (_MAX_DIMS - x.dim())
    header = torch.tensor([x.dim(), *shape, _DTYPES.index(x.dtype), layout], device=x.device)
    peer = dist.get_global_rank(group, to)
    dist.send(header, peer, group=group)
    dist.send(x.contiguous(), peer, group=group)


def _recv(pipe: Pipeline, source: int, device: torch.device) -> torch.Tensor:
    peer = dist.get_global_rank(pipe.group, source)
    header = torch.empty(_MAX_DIMS + 3, dtype=torch.int64, device=device)
    dist.recv(header, peer, group=pipe.group)
    ndim, *shape, dtype, layout = header.tolist()  # host sync: once per hop, validation only
    out = torch.empty(shape[:ndim], dtype=_DTYPES[dtype], device=device)
    dist.recv(out, peer, group=pipe.group)
    if layout == -2:
        return out
    placement = Replicate() if layout == -1 else Shard(layout)
    return DTensor.from_local(out, pipe.tp_mesh, [placement], run_check=False)
