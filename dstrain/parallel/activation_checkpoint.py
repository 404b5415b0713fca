"""Activation checkpointing: recompute in backward instead of keeping activations.

`full` wraps every transformer block: only the block inputs are kept, and the whole block runs
again in backward.

`selective` wraps every block with torch's selective activation checkpointing
(`create_selective_checkpoint_contexts`, the per-op policy torchtitan uses): the outputs of the
matmuls, the attention kernels, and the reduce-scatters and all-reduces are kept, and everything
else the block computes (norms, RoPE, the activation functions, casts, residual adds, the MoE's
permutation) runs again in backward. That is the trade Korthikanti et al. 2022 name selective
recomputation: drop the tensors that are large and cheap to recompute, keep the costly ones,
for a few percent more compute instead of a whole forward. Three kinds of matmul run again too:
- up-projections, whose output is at least UP_PROJECTION times wider than their input (MLA's
  query and key-value up-projections, 16x and 64x in DeepSeek-V3): large outputs that are cheap
  to regenerate from a small kept input, which DeepSeek-V3 recomputes too (report, sec. 3.2.3);
- the routed experts (their grouped GEMMs and their dispatch and combine all-to-alls): their
  tensors are top-k copies of every token, which would dominate what the policy keeps, so a
  MoE layer pays its experts' forward and two all-to-alls again (Megatron-LM's
  `--recompute-modules moe`);
- an FP8 GEMM, which is quantisation and chunk products rather than one op.
The rules read ops and shapes only, so they hold under torch.compile too (except the FP8 one:
FP8 GEMMs run eagerly). On a GPU that runs the routed experts without grouped GEMMs (fp32 or
fp16 experts) their per-expert matmuls are kept. The MoE's count all-to-all and split sizes are
recomputed with the routing (a host sync again).

The schedules that split each backward into an input-gradient and a weight-gradient pass (zbv,
dualpipev) run two autograd graph tasks over one region: torch recomputes the region once per
graph task, and its per-op policy lets only the first replay the kept outputs ("only allowed to
backward once on any region computed under selective activation checkpoint": torch 2.13's
`_CachedTorchDispatchMode` marks each kept output consumed as it replays it). There the same
policy runs with a cache that survives the first replay (`_two_backward_context`), so the
weight-gradient pass replays the kept matmul and attention outputs too and recomputes what
1F1B recomputes; the pipeline runs all the parameter groups of one weight-gradient pass under
one `torch.utils.checkpoint.GraphExecGroup`, so that pass recomputes each region once, not once
per group (`parallel/pipeline.py`). A split chunk thus recomputes its regions twice, once per
pass. The kept outputs live until the region's graph is freed, after its weight pass: what
1F1B keeps between forward and backward, no more.

Uses torch.utils.checkpoint (non-reentrant), the wrapper torchtitan and FSDP2 compose with.
"""

from collections import defaultdict
from functools import partial

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from dstrain.model.fp8 import inside_fp8_gemm
from dstrain.model.transformer import Transformer, TransformerBlock
from dstrain.planner.memory import UP_PROJECTION

_aten = torch.ops.aten
_functional = torch.ops._c10d_functional
# The ops whose outputs `selective` keeps: what is costly to run again. Not every build has
# every kernel (the CPU flash kernel, cuDNN's): they are looked up by name. Not the routed
# experts' grouped GEMMs, nor the all-to-alls that carry their tokens.
_KEPT_NAMES = (
    (_aten, "mm"),
    (_aten, "addmm"),
    (_aten, "bmm"),
    (_aten, "_scaled_mm"),
    (_aten, "_scaled_dot_product_flash_attention"),
    (_aten, "_scaled_dot_product_flash_attention_for_cpu"),
    (_aten, "_scaled_dot_product_efficient_attention"),
    (_aten, "_scaled_dot_product_cudnn_attention"),
    (_aten, "_scaled_dot_product_attention_math"),
    # A kept collective is not run again in backward. Not the all-gathers, as in torchtitan's
    # list: sequence parallelism gathers a norm's output, which is large and cheap to gather.
    (_functional, "reduce_scatter_tensor"),
    (_functional, "all_reduce"),
)
KEPT_OPS = frozenset(
    getattr(namespace, name).default for namespace, name in _KEPT_NAMES if hasattr(namespace, name)
) | {torch._higher_order_ops.flex_attention}


def apply_ac(model: Transformer, *, mode: str, split_backward: bool = False) -> None:
    """Wrap `model`'s blocks (and MTP blocks) in place; mode is none, selective or full.
    `split_backward`: the pipeline schedule runs input- and weight-gradient backwards apart
    (zbv, dualpipev), so `selective` keeps its cache for the second (module docstring)."""
    if mode == "none":
        return
    context = {}
    if mode == "selective":
        context["context_fn"] = _two_backward_context if split_backward else _selective_context
    for parent in _block_parents(model):
        for name, block in parent.named_children():
            if isinstance(block, TransformerBlock):
                wrapped = checkpoint_wrapper(block, preserve_rng_state=False, **context)
                parent.register_module(name, wrapped)


def _keep_costly(ctx: object, op: object, *args: object, **kwargs: object) -> CheckpointPolicy:
    if op not in KEPT_OPS or inside_fp8_gemm() or _up_projection(op, args):
        return CheckpointPolicy.PREFER_RECOMPUTE
    return CheckpointPolicy.MUST_SAVE


def _up_projection(op: object, args: tuple) -> bool:
    """A matmul whose output is UP_PROJECTION or more times wider than its input."""
    if op in (_aten.mm.default, _aten.bmm.default, _aten._scaled_mm.default):
        a, b = args[0], args[1]
    elif op == _aten.addmm.default:
        a, b = args[1], args[2]
    else:
        return False
    return b.shape[-1] >= UP_PROJECTION * a.shape[-1]


_selective_context = partial(create_selective_checkpoint_contexts, _keep_costly)


class _FirstWriteWins(dict):
    """One op's entries in the selective cache (call index -> kept output, or the marker that
    says recompute): an entry, once written, is never replaced."""

    def __setitem__(self, key: object, value: object) -> None:
        self.setdefault(key, value)


def _two_backward_context() -> tuple[object, object]:
    """`_selective_context` (torch's two dispatch modes, forward and recompute) for a region
    that is backpropagated twice. torch has no option for it (`allow_cache_entry_mutation`
    only lifts the check that a kept output was not modified in place), so the cache is ours,
    relying on torch 2.13's private layout: both modes share `.storage`, op -> {call index ->
    entry}; the forward writes each entry once, and each replay overwrites the entry it
    returns with a "consumed" marker. A dict that keeps its first value makes every replay
    return the kept output; the in-place-modification check still runs on each."""
    caching, cached = _selective_context()
    caching.storage = cached.storage = defaultdict(_FirstWriteWins)
    return caching, cached


def _block_parents(model: Transformer) -> list[nn.Module]:
    parents: list[nn.Module] = [model.layers]
    if model.mtp is not None:
        parents += list(model.mtp.values())
    return parents
