"""Vocab-parallel loss under TP: the head's logits (main and MTP) stay a DTensor sharded over the
vocabulary, and the trainer's loss (`train/loss.py: loss_terms`) over them gives one process's
loss and gradients. Rank 0 also runs the one-process reference with the same weights.
"""

import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from dstrain.config.parallel_dims import ParallelDims
from dstrain.model.transformer import build_model
from dstrain.parallel.mesh import build_meshes
from dstrain.parallel.tensor_parallel import apply_tp
from dstrain.train.loss import IGNORE_INDEX, TokenCounts, ce_sum, loss_terms
from tests.distributed.workers.tensor_parallel import full, max_diff
from tests.unit.tiny import tiny_args

BATCH, SEQ, MTP_WEIGHT = 2, 8, 0.3


def cases(tp: int) -> dict[str, tuple[dict, bool]]:
    """name -> (ModelArgs changes, sequence_parallel); a vocabulary of 64 * tp."""
    common = dict(num_heads=2 * tp, vocab_size=64 * tp)
    return {
        "tp": (common, False),
        "tp_no_mtp": (common | dict(num_mtp_modules=0), False),
        "sp": (common, True),
        "sp_no_mtp": (common | dict(num_mtp_modules=0), True),
        "sp_two_mtp": (common | dict(num_mtp_modules=2), True),
    }


def loss_parallel(out_dir):
    tp = dist.get_world_size()
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=tp, pp=1, ep=1, world_size=tp)
    tp_mesh = build_meshes(dims, "cpu")["tp"]
    return {name: run_case(tiny_args(**c), sp, tp_mesh) for name, (c, sp) in cases(tp).items()}


def batch(args) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    tokens = torch.randint(args.vocab_size, (BATCH, SEQ + 1))
    labels = tokens[:, 1:].clone()
    labels[0, :3] = IGNORE_INDEX  # a prompt: targets that carry no loss
    return tokens[:, :-1], labels


def step(model, inputs: torch.Tensor, labels: torch.Tensor) -> tuple[list, dict, dict]:
    outputs = model(inputs)
    heads = outputs if isinstance(outputs, tuple) else (outputs,)
    counts = TokenCounts.of([labels], len(heads) - 1)
    total, parts = loss_terms(outputs, labels, counts, MTP_WEIGHT)
    total.backward()
    grads = {name: full(p.grad) for name, p in model.named_parameters() if p.grad is not None}
    with torch.no_grad():  # the evaluation path: forward only
        eval_sum = ce_sum(model(inputs)[0] if len(heads) > 1 else model(inputs), labels)
    values = {"total": total.item(), **{k: v.item() for k, v in parts.items()}}
    values["eval_sum"] = eval_sum.item()
    return list(heads), values, grads


def run_case(args, sp: bool, tp_mesh) -> dict:
    inputs, labels = batch(args)
    torch.manual_seed(1)
    model = build_model(args)
    apply_tp(model, tp_mesh, sequence_parallel=sp)
    heads, values, grads = step(model, inputs, labels)
    report = {
        "values": values,
        "heads": [
            {
                "dtensor": isinstance(h, DTensor),
                "placements": [str(p) for p in h.placements] if isinstance(h, DTensor) else None,
                "global": list(h.shape),
                "local": list((h.to_local() if isinstance(h, DTensor) else h).shape),
            }
            for h in heads
        ],
    }
    if dist.get_rank() == 0:
        torch.manual_seed(1)
        reference = build_model(args)
        _, report["ref_values"], ref_grads = step(reference, inputs, labels)
        report["grad_diff"] = max_diff(grads, ref_grads)
    return report


if __name__ == "__main__":
    from tests.distributed.harness import worker_main

    sys.exit(worker_main(loss_parallel))
