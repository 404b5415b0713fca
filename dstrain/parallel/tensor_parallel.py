"""Tensor parallelism (Megatron-LM) and sequence parallelism (Korthikanti et al. 2022) with DTensor.

`apply_tp` rewrites the single-device model in place through `parallelize_module`; the model code
stays unaware of it. Every collective sits at an autograd boundary that DTensor owns:

    colwise Linear (wq/wq_b, wkv_b, wk, wv, w1, w3, head):  weight rows split (Shard(0)); its input
        is Replicate, so: identity in forward, all-reduce of the input gradient in backward.
        Where a module's input stays a DTensor (MHA, dense FFN, shared experts), the Partial input
        gradients of its colwise layers add up first and are reduced once.
    rowwise Linear (wo, w2):  weight columns split (Shard(1)); its output is Partial, so:
        all-reduce in forward (reduce-scatter to Shard(1) with SP), identity in backward
        (all-gather of the output gradient with SP).
    MTP proj (rowwise on a Replicate input):  local slice of the input and all-reduce in forward;
        all-gather of the input gradient in backward.
    vocab-parallel embedding (rowwise):  rows of the table split; all-reduce in forward
        (reduce-scatter with SP), nothing in backward (all-gather with SP).
    head:  colwise with a Shard(-1) output (a DTensor, for the main head and every MTP depth):
        no collective; the loss is vocab-parallel (`train/loss.py`: all-reduces of [B*S]
        statistics), so no rank holds the whole [B, S, V] logits (DeepSeek-V3: 129,280 columns).
    SP, into attention / FFN / MoE:  all-gather over the sequence in forward, reduce-scatter of
        the gradient in backward (a local slice for MLA and MoE, whose plain modules leave every
        rank with the full gradient already).
    SP, out of the MoE:  a local slice in forward, all-gather in backward.
    SP norm weights:  all-reduce of their gradient in backward (`_reduce_replicated_grads`).
    MLA shared RoPE key:  identity in forward, all-reduce in backward (`_sum_rope_key_grad`).

Placements (tp ranks, "plain" = an ordinary replicated tensor that no collective touches):
    MLA   wq_b (or wq), wkv_b: Shard(0); wo: Shard(1); wq_a, wkv_a, q_norm, kv_norm: plain.
          Each rank computes the full low-rank latents and its own heads; heads are reshaped with
          `view(B, S, -1, head_dim)`, so local heads need no change in the model.
    MHA   wq, wk, wv: Shard(0); wo: Shard(1).
    FFN   w1, w3: Shard(0); w2: Shard(1). The MoE's shared experts the same.
    MoE   router gate and routed experts: plain. Every rank routes the same full set of tokens
          with the full expert weights (expert parallelism is a separate axis), so their gradients
          agree across tp ranks and need no reduction. The MoE output is Replicate.
    norms plain without SP; with SP the block norms (and the final norm, without MTP) are
          Replicate DTensors on Shard(1) activations. Their weight gradients come out Partial
          (each rank's sequence shard), and DTensor would leave `.grad` Partial; a hook
          all-reduces them in backward (`_reduce_replicated_grads`).
    embed Shard(0) (vocab-parallel); head Shard(0), its logits Shard(-1); RoPE tables: plain
          buffers.

With SP the residual stream between blocks is a DTensor Shard(1), so `h.size(1)` in the model is
the global sequence length and the RoPE tables cover all positions. Multi-token prediction slices
the sequence (`h[:, :-1]`, `emb[:, k:]`), which a sequence shard cannot do; so with MTP and SP the
embedding outputs Replicate, the first block slices its input to Shard(1) (all-gather in
backward), the last block all-gathers its output (a local slice in backward), the final norm runs
on the full sequence, and the MTP blocks (sequence S - k, rarely divisible by tp) use the plain TP
plan. Without MTP the all-gather happens at the head's input instead, after the final norm.

The model then mixes DTensor and plain parameters (until FSDP2 wraps them all): foreach/fused
optimizers and `clip_grad_norm_` refuse mixed lists ("got mixed torch.Tensor and DTensor"), so
without FSDP use `foreach=False` or separate parameter groups.
"""

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from dstrain.config.model_args import ModelArgs
from dstrain.model.attention import MLA
from dstrain.model.ffn import FeedForward
from dstrain.model.moe import MoE
from dstrain.model.transformer import Transformer, TransformerBlock


def apply_tp(model: Transformer, tp_mesh: DeviceMesh, *, sequence_parallel: bool) -> None:
    """Shard `model` in place over the 1-D `tp_mesh` (see the module docstring for placements).

    Every tp rank must feed the same token batch [B, S]; with `sequence_parallel`, S must divide by
    the tp degree. Works on a model built on `meta` (the trainer's path: materialise afterwards,
    `dstrain/parallel/materialize.py`, which fills each shard with its part of the one-process
    weights) and on one that holds weights (equal on all tp ranks; rank 0's are scattered).
    Parameters left plain stay identical across tp ranks as long as the optimizer steps do.
    """
    tp = tp_mesh.size()
    _check_divisible(model.args, tp)
    # With MTP the last hidden state and the embedding must be whole sequences (module docstring).
    gather_early = sequence_parallel and model.mtp is not None
    parallelize_module(model, tp_mesh, _ends_plan(model, sequence_parallel, gather_early))
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, _block_plan(block, sequence_parallel))
        _fix_rope_key_grad(block, tp_mesh)
    if gather_early:
        _shard_residual_between_blocks(model, tp_mesh)
    for module in (model.mtp or {}).values():
        parallelize_module(
            module.proj,
            tp_mesh,
            RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        )
        parallelize_module(module.block, tp_mesh, _block_plan(module.block, False))
        _fix_rope_key_grad(module.block, tp_mesh)
    if sequence_parallel:
        _reduce_replicated_grads(model)
        if model.embed is not None:  # a later pipeline stage receives hidden states
            model.register_forward_pre_hook(_check_sequence_divides(tp))


def _ends_plan(model: Transformer, sp: bool, gather_early: bool) -> dict[str, ParallelStyle]:
    seq_sharded = sp and not gather_early
    layout = Shard(1) if seq_sharded else Replicate()
    plan: dict[str, ParallelStyle] = {}
    if model.embed is not None:
        # A DTensor output under SP, so that the model's `h.size(1)` is the global length.
        plan["embed"] = RowwiseParallel(
            input_layouts=Replicate(), output_layouts=layout, use_local_output=not seq_sharded
        )
    if model.norm is not None and seq_sharded:
        plan["norm"] = SequenceParallel()
    if model.head is not None:
        # Logits stay sharded over the vocabulary, a DTensor the loss reads as such.
        plan["head"] = ColwiseParallel(
            input_layouts=layout, output_layouts=Shard(-1), use_local_output=False
        )
    return plan


def _block_plan(block: TransformerBlock, sp: bool) -> dict[str, ParallelStyle]:
    """Attention and FFN of one block. Under SP the block's input and output (the residual
    stream) are DTensors Shard(1); without SP they are plain full tensors."""
    plan: dict[str, ParallelStyle] = {}
    if sp:
        plan["attention_norm"] = SequenceParallel()
        plan["ffn_norm"] = SequenceParallel()
    plan.update(_prefixed("attention", _attention_plan(block.attention, sp)))
    plan.update(_prefixed("ffn", _ffn_plan(block.ffn, sp)))
    return plan


def _attention_plan(attention: nn.Module, sp: bool) -> dict[str, ParallelStyle]:
    seq = Shard(1) if sp else Replicate()
    # MLA's down-projections are plain modules, which take plain tensors: hand it a local input.
    # Each of its consumers returns a full gradient (colwise all-reduce, `_sum_rope_key_grad`).
    # MHA keeps a DTensor input, so the Partial gradients of wq, wk, wv add up first and are
    # reduced once (one reduce-scatter with SP, one all-reduce without).
    is_mla = isinstance(attention, MLA)
    plan: dict[str, ParallelStyle] = {
        "": PrepareModuleInput(
            input_layouts=(seq, None, None),
            desired_input_layouts=(Replicate(), None, None),
            use_local_output=is_mla,
        ),
        "wo": RowwiseParallel(output_layouts=seq, use_local_output=not sp),
    }
    if is_mla:
        plan["wq_b" if attention.q_lora_rank else "wq"] = ColwiseParallel()
        plan["wkv_b"] = ColwiseParallel()
    else:
        plan.update({name: ColwiseParallel() for name in ("wq", "wk", "wv")})
    return plan


def _ffn_plan(ffn: nn.Module, sp: bool) -> dict[str, ParallelStyle]:
    seq = Shard(1) if sp else Replicate()
    if isinstance(ffn, FeedForward):
        entry = PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),))
        return {"": entry} | _mlp_plan(ffn, out=seq, local_out=not sp)
    assert isinstance(ffn, MoE), type(ffn)
    plan: dict[str, ParallelStyle] = {}
    if sp:
        # The router and the routed experts are plain modules: they need a local, full input.
        # Their output is full on every rank; each keeps its own slice of the sequence.
        plan[""] = PrepareModuleInputOutput(
            input_layouts=(Shard(1),),
            desired_input_layouts=(Replicate(),),
            use_local_input=True,
            output_layouts=(Replicate(),),
            desired_output_layouts=(Shard(1),),
            use_local_output=False,
        )
    if ffn.shared_experts is not None:
        # The shared output is added to the full routed output, so it is all-reduced (not
        # reduce-scattered). A DTensor input makes w1's and w3's input gradients one all-reduce.
        shared = {
            "": PrepareModuleInput(
                input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),)
            )
        }
        shared |= _mlp_plan(ffn.shared_experts, out=Replicate(), local_out=True)
        plan.update(_prefixed("shared_experts", shared))
    return plan


def _mlp_plan(ffn: FeedForward, *, out: Placement, local_out: bool) -> dict[str, ParallelStyle]:
    plan = {
        "w1": ColwiseParallel(),
        "w2": RowwiseParallel(output_layouts=out, use_local_output=local_out),
    }
    if ffn.w3 is not None:  # None for the GELU FFN
        plan["w3"] = ColwiseParallel()
    return plan


def _prefixed(prefix: str, plan: dict[str, ParallelStyle]) -> dict[str, ParallelStyle]:
    return {f"{prefix}.{name}" if name else prefix: style for name, style in plan.items()}


def _fix_rope_key_grad(block: TransformerBlock, tp_mesh: DeviceMesh) -> None:
    if isinstance(block.attention, MLA):
        block.attention.wkv_a.register_forward_hook(_sum_rope_key_grad(block.attention, tp_mesh))


def _sum_rope_key_grad(attention: MLA, tp_mesh: DeviceMesh) -> Callable:
    """MLA's decoupled RoPE key (the last qk_rope_head_dim columns of wkv_a's output) is shared by
    all heads, and each rank uses it for its own heads only; so its gradient on each rank is a
    partial sum over heads. Mark it Partial on the way back: identity in forward, all-reduce in
    backward (Megatron's "f"). The latent columns already get a full gradient from wkv_b."""
    rope_dim = attention.rope_dim

    def hook(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        latent, rope_key = out.split([out.size(-1) - rope_dim, rope_dim], dim=-1)
        rope_key = DTensor.from_local(rope_key, tp_mesh, [Replicate()], run_check=False)
        return torch.cat([latent, rope_key.to_local(grad_placements=[Partial()])], dim=-1)

    return hook


def _reduce_replicated_grads(model: Transformer) -> None:
    """A Replicate DTensor weight applied to Shard(1) activations (the SP norms) gets a Partial
    gradient, and DTensor leaves `.grad` Partial: each rank would hold its own sequence shard's
    share, which grad clipping, logging and a non-DTensor optimizer would take for the whole.
    Reduce it as it arrives: one all-reduce of the weight's size per backward. (FSDP2 does the
    same redistribution itself when it wraps these parameters, so the result is the same there.)
    """
    for param in model.parameters():
        if isinstance(param, DTensor) and all(p.is_replicate() for p in param.placements):
            param.register_hook(_to_replicate)


def _to_replicate(grad: DTensor) -> DTensor:
    if all(p.is_replicate() for p in grad.placements):
        return grad
    return grad.redistribute(placements=[Replicate()] * grad.device_mesh.ndim)


def _shard_residual_between_blocks(model: Transformer, tp_mesh: DeviceMesh) -> None:
    """SP with MTP: the first block slices the full embedding output to Shard(1) (all-gather in
    backward); the last block all-gathers its output (a local slice in backward). On a pipeline
    stage, only the stage holding the embedding (head) slices (gathers); a last stage without
    blocks (DeepSeek-V3's `pp_last_stage_less_layers`) gathers its input."""
    blocks = list(model.layers.values())
    if model.embed is not None:
        parallelize_module(
            blocks[0],
            tp_mesh,
            PrepareModuleInput(
                input_layouts=(Replicate(), None, None),
                desired_input_layouts=(Shard(1), None, None),
            ),
        )
    if model.head is not None and blocks:
        parallelize_module(
            blocks[-1],
            tp_mesh,
            PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Replicate()),
        )
    elif model.head is not None:  # a last stage of only the norm, head and MTP: gather its input
        parallelize_module(
            model,
            tp_mesh,
            PrepareModuleInput(
                input_layouts=(Shard(1),),
                desired_input_layouts=(Replicate(),),
                use_local_output=True,
            ),
        )


def _check_divisible(args: ModelArgs, tp: int) -> None:
    widths = {"num_heads": args.num_heads, "kv_heads": args.kv_heads, "vocab_size": args.vocab_size}
    if args.first_k_dense > 0 or not args.is_moe:
        widths["inter_dim"] = args.inter_dim
    if args.num_mtp_modules:
        widths["2 x dim (MTP proj)"] = 2 * args.dim
    if args.is_moe and args.num_shared_experts:
        widths["num_shared_experts x moe_inter_dim"] = args.num_shared_experts * args.moe_inter_dim
    for name, width in widths.items():
        if width % tp:
            raise ValueError(
                f"tensor parallelism splits {name} = {width} over tp = {tp} ranks, which does not "
                f"divide it; choose a tp degree that divides {width}"
            )


def _check_sequence_divides(tp: int) -> Callable:
    def hook(module: nn.Module, args: tuple) -> None:
        seq_len = args[0].size(1)
        if seq_len % tp:
            raise ValueError(
                f"sequence parallelism splits the sequence ({seq_len} tokens) over tp = {tp} "
                f"ranks; use a sequence length divisible by {tp}, or sequence_parallel = false"
            )

    return hook
