"""Context parallelism at the model: each cp rank runs the same weights on its two chunks of
every sequence (head-tail order), attention gathering the MLA latent (or MHA's keys and values)
over the group; the loss summed over the ranks and the gradients summed over them equal one
process on the whole sequences. Every rank also runs the one-process reference itself.
"""

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dstrain.model.transformer import build_model
from dstrain.parallel.context_parallel import ContextShard, apply_context_parallel
from tests.distributed.workers.tensor_parallel import max_diff
from tests.unit.tiny import tiny_args

BATCH = 2


def cases() -> dict[str, dict]:
    """name -> ModelArgs changes (no MTP here: the trainer gives it each depth's split tokens,
    checked in the parity matrix)."""
    common = dict(num_mtp_modules=0)
    return {
        "mla": common,
        "mla_q_proj": common | dict(q_lora_rank=0),
        "mla_yarn": common | dict(rope_factor=4.0, original_seq_len=8, mscale_all_dim=1.0),
        "gqa": common | dict(attention="mha", num_heads=4, num_kv_heads=2, head_dim=8),
        "dense": common | dict(num_routed_experts=0, first_k_dense=3),
        # the balance loss's statistics summed over the cp ranks: per sequence, and V2's
        # batch-wise form (its gradients reach the router only through the loss)
        "moe_aux": common | dict(aux_loss_alpha=0.05),
        "moe_aux_batch": common | dict(aux_loss_alpha=0.05, seq_aux=False),
    }


def context_parallel(out_dir):
    cp, rank = dist.get_world_size(), dist.get_rank()
    shard = ContextShard(dist.group.WORLD, cp, rank)
    seq = 8 * cp  # 2 x cp chunks of 4 tokens
    return {name: run_case(tiny_args(**c), shard, seq) for name, c in cases().items()}


def loss_sum(model, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = model(inputs)
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum")


def run_case(args, shard: ContextShard, seq: int) -> dict:
    torch.manual_seed(0)
    tokens = torch.randint(args.vocab_size, (BATCH, seq + 1))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    model = build_model(args, seed=1)
    apply_context_parallel(model, shard)
    local_inputs, local_labels = shard.split(inputs), shard.split(labels)
    logits = model(local_inputs)
    loss = F.cross_entropy(logits.flatten(0, 1).float(), local_labels.flatten(), reduction="sum")
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    grads = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)  # what FSDP's reduce over dp_shard x cp does
            grads[name] = p.grad
    reference = build_model(args, seed=1)
    ref_logits = reference(inputs)
    ref_loss = F.cross_entropy(ref_logits.flatten(0, 1).float(), labels.flatten(), reduction="sum")
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
    positions = shard.positions(local_inputs.size(1))
    mask = shard.causal_mask(local_inputs.size(1))
    return {
        "loss": total.item(),
        "ref_loss": ref_loss.item(),
        "logits_diff": (logits - ref_logits[:, positions]).abs().max().item(),
        "grad_diff": max_diff(grads, ref_grads),
        "grad_names": sorted(grads) == sorted(ref_grads),
        "positions": positions.tolist(),
        "attention_pairs": int(mask.sum()),  # this rank's (query, key) pairs: its work
    }


if __name__ == "__main__":
    from tests.distributed.harness import worker_main

    sys.exit(worker_main(context_parallel))
