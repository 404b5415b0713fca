"""How other training engines run what dstrain's trainer runs, where it changes the planner's
numbers. The published runs were made with them (`planner/published.py`: an entry names its
engine), and `dstrain plan --engine` predicts a layout as one of them would run it. Each trait
with its source.
"""

from dataclasses import dataclass

from dstrain.errors import UserError


@dataclass(frozen=True)
class Engine:
    """`loss_parallel`: the loss over each tp rank's vocabulary shard (else the logits are
    all-gathered over tp first). `selective_matmuls`: the share of the matmuls' outputs its
    selective recompute drops and runs again (None: dstrain's per-op policy, which drops the
    routed experts', the up-projections' and the FP8 GEMMs' and no other). `loss_held`,
    `loss_transient`: bytes per logit and head its cross-entropy keeps until backward, and the
    extra its backward needs for one head (None: dstrain's, by precision, `memory.py`).
    `fp8_input_bytes`: bytes per element of an FP8 GEMM's saved input; `fp8_weight_bytes`: bytes
    per FP8-recipe parameter of weight copies kept across micro-batches. `cp_gather`: context
    parallelism all-gathers what each token contributes to the keys and values (MLA's latent)
    and reduce-scatters its gradient, rather than passing keys and values around a ring."""

    name: str
    loss_parallel: bool
    selective_matmuls: float | None
    loss_held: float | None
    loss_transient: float | None
    fp8_input_bytes: float
    fp8_weight_bytes: float
    cp_gather: bool = False


ENGINES = {
    e.name: e
    for e in (
        # dstrain's trainer: under TP the head's logits stay sharded over the vocabulary and
        # the cross-entropy is vocab-parallel (`train/loss.py`; without TP an eager fp32 one,
        # measured by the dry run); FP8 GEMMs keep their bf16 inputs and no E4M3 copy
        # outlives a GEMM (`model/fp8.py`).
        # Context parallelism gathers MLA's latent (`parallel/context_parallel.py`).
        Engine("dstrain", True, None, None, None, 2.0, 0.0, cp_gather=True),
        # Megatron-LM, NeMo and Megatron-Bridge, and the forks of the table (Megatron-DeepSpeed,
        # metaseq, Zero Bubble's): vocab-parallel cross-entropy, which keeps an fp32 softmax of
        # its shard (4 bytes per logit) and writes the gradient into it, with the 16-bit logits
        # beside it while it runs (megatron/core/tensor_parallel/cross_entropy.py);
        # selective recompute keeps every matmul's output (core attention, or the modules named
        # by --recompute-modules); Transformer Engine keeps an FP8 linear's input in FP8 and
        # caches each weight's FP8 copy and transpose across micro-batches (2 bytes per
        # parameter; `is_first_microbatch`).
        Engine("megatron", True, 0.0, 4.0, 2.0, 1.0, 2.0),
        # torchtitan: loss_parallel under TP; cross-entropy on logits.float() with the logits
        # deleted before backward, which keeps the fp32 log-probabilities (4) and needs two fp32
        # gradients and a 16-bit cast in backward (torchtitan/components/loss.py); its
        # selective recompute saves every other matmul's output (the per-op policy) or every
        # other block's input (the per-layer one); torchao's Float8Linear keeps the bf16 input
        # and keeps no FP8 weight copy.
        Engine("torchtitan", True, 0.5, 4.0, 10.0, 2.0, 0.0),
        # MosaicML's Composer (llm-foundry): FSDP without TP, the eager fp32 cross-entropy as
        # torchtitan runs it, and Transformer Engine for FP8.
        Engine("composer", False, 0.0, 4.0, 10.0, 1.0, 2.0),
    )
}


def engine(name: str) -> Engine:
    if name not in ENGINES:
        raise UserError(f"unknown engine {name!r}", f"use one of {', '.join(ENGINES)}")
    return ENGINES[name]
