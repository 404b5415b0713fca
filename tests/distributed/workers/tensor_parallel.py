"""TP / SP parity: the same tiny model trained on the tp ranks and on one process (rank 0).

Every case builds the model with the same seed on every rank, applies TP to it, trains a few SGD
steps on one token batch fed to all tp ranks, and reports the per-step loss differences against
the one-process run, the final weights' differences (DTensors gathered with `full_tensor()`), and
whether the parameters that TP leaves plain stayed identical across the ranks. The `split` cases
route each tp rank's share of the tokens (`parallel.moe_tp = split_tokens`) and report the rows
the routed experts received on each rank.
"""

import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from dstrain.config.parallel_dims import ParallelDims
from dstrain.model.moe import MoE
from dstrain.model.transformer import Transformer, build_model
from dstrain.parallel.mesh import build_meshes
from dstrain.parallel.moe_tokens import apply_token_split, reduce_split_grads
from dstrain.parallel.tensor_parallel import apply_tp
from dstrain.train.loss import ce_sum
from tests.distributed.harness import worker_main
from tests.unit.tiny import tiny_args

STEPS, BATCH, SEQ, LR, MTP_WEIGHT = 8, 2, 8, 0.5, 0.3


def cases(tp: int) -> dict[str, tuple[dict, bool, bool, tuple[int, int]]]:
    """name -> (ModelArgs changes, sequence_parallel, split tokens, (batch, seq)). Heads: 2 per
    rank."""
    heads = dict(num_heads=2 * tp)
    shape = (BATCH, SEQ)
    return {
        "tp": (heads, False, False, shape),
        "sp": (heads | dict(aux_loss_alpha=0.01), True, False, shape),
        "sp_no_mtp": (heads | dict(num_mtp_modules=0), True, False, shape),
        "sp_mha_gqa_gelu": (
            heads | dict(attention="mha", num_kv_heads=tp, mlp="gelu", num_mtp_modules=0),
            True,
            False,
            shape,
        ),
        "tp_direct_query": (heads | dict(q_lora_rank=0), False, False, shape),
        "sp_split": (heads | dict(aux_loss_alpha=0.01), True, True, shape),
        # 7 tokens: rows that tp does not divide (DTensor's uneven shards).
        "tp_split_uneven": (heads | dict(aux_loss_alpha=0.01), False, True, (1, 7)),
    }


def tensor_parallel(out_dir):
    """argv[2:]: the cases to run (all by default)."""
    tp = dist.get_world_size()
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=tp, pp=1, ep=1, world_size=tp)
    tp_mesh = build_meshes(dims, "cpu")["tp"]
    chosen = {name: case for name, case in cases(tp).items() if name in sys.argv[2:]}
    result = {
        name: run_case(tiny_args(**changes), sp, split, shape, tp_mesh)
        for name, (changes, sp, split, shape) in (chosen or cases(tp)).items()
    }
    result["sharding"] = check_sharding(tp_mesh)
    return result


def run_case(args, sp: bool, split: bool, shape: tuple[int, int], tp_mesh) -> dict:
    batch, seq = shape
    torch.manual_seed(0)
    tokens = torch.randint(args.vocab_size, (batch, seq + 1))
    torch.manual_seed(1)
    model = build_model(args)
    apply_tp(model, tp_mesh, sequence_parallel=sp)
    finish = None
    if split:
        apply_token_split(model, tp_mesh)
        finish = lambda: reduce_split_grads(model, tp_mesh.get_group())  # noqa: E731
    rows = expert_rows(model)
    report = {"losses": train(model, tokens, finish), "plain_spread": plain_spread(model)}
    report["expert_rows"] = sum(rows)
    grads, report["norm_grad"] = last_grads(model, tokens, finish)
    weights = {name: full(p) for name, p in model.named_parameters()}
    if dist.get_rank() == 0:
        torch.manual_seed(1)
        reference = build_model(args)
        reference_rows = expert_rows(reference)
        report["ref_losses"] = train(reference, tokens)
        report["ref_expert_rows"] = sum(reference_rows)
        ref_grads, report["ref_norm_grad"] = last_grads(reference, tokens)
        report["weight_diff"] = max_diff(weights, dict(reference.named_parameters()))
        report["grad_diff"] = max_diff(grads, ref_grads)
    return report


def expert_rows(model: Transformer) -> list[int]:
    """A list that grows by the rows each routed-experts forward receives (training steps)."""
    rows: list[int] = []
    for module in model.modules():
        if isinstance(module, MoE):
            module.experts.register_forward_hook(
                lambda _module, args, _out: rows.append(args[0].size(0))
            )
    return rows


def train(model: Transformer, tokens: torch.Tensor, finish=None) -> list[float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for _ in range(STEPS):
        loss = lm_loss(model, tokens)
        loss.backward()
        if finish is not None:
            finish()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def lm_loss(model: Transformer, tokens: torch.Tensor) -> torch.Tensor:
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    out = model(inputs)
    logits, *mtp = out if isinstance(out, tuple) else (out,)
    # The trainer's cross-entropy: under TP the logits are a vocabulary shard (a DTensor).
    loss = ce_sum(logits, labels) / labels.numel()
    for k, mtp_logits in enumerate(mtp, start=1):
        mtp_loss = ce_sum(mtp_logits, labels[:, k:]) / labels[:, k:].numel()
        loss = loss + MTP_WEIGHT / len(mtp) * mtp_loss
    return loss


def last_grads(model: Transformer, tokens: torch.Tensor, finish=None) -> tuple[dict, dict]:
    """Full gradients of one more backward, and this rank's own copy of a block norm's."""
    lm_loss(model, tokens).backward()
    if finish is not None:
        finish()
    grads = {name: full(p.grad) for name, p in model.named_parameters()}
    norm_grad = model.layers["0"].attention_norm.weight.grad
    is_dtensor = isinstance(norm_grad, DTensor)
    own = {
        "placements": [str(p) for p in norm_grad.placements] if is_dtensor else None,
        "local": (norm_grad.to_local() if is_dtensor else norm_grad).tolist(),
    }
    model.zero_grad()
    return grads, own


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t.detach()


def max_diff(ours: dict, reference: dict) -> dict:
    """Largest |ours - reference| over all tensors, absolute and relative to the tensor's scale."""
    diffs, scaled = {}, {}
    for name, ref in reference.items():
        diff = (ours[name] - ref.detach()).abs().max().item()
        diffs[name], scaled[name] = diff, diff / ref.detach().abs().max().item()
    worst, worst_scaled = max(diffs, key=diffs.get), max(scaled, key=scaled.get)
    return {
        "abs": diffs[worst],
        "abs_at": worst,
        "rel": scaled[worst_scaled],
        "rel_at": worst_scaled,
    }


def plain_spread(model: Transformer) -> float:
    """Largest difference between a plain (non-DTensor) parameter and rank 0's copy of it."""
    spread = 0.0
    for p in model.parameters():
        if not isinstance(p, DTensor):
            theirs = p.detach().clone()
            dist.broadcast(theirs, 0)
            spread = max(spread, (p.detach() - theirs).abs().max().item())
    return spread


def check_sharding(tp_mesh) -> dict:
    torch.manual_seed(1)
    model = build_model(tiny_args(num_heads=2 * tp_mesh.size()))
    full_rows = {
        n: model.layers["0"].attention.get_submodule(n).weight.shape[0] for n in ("wq_b", "wkv_b")
    }
    apply_tp(model, tp_mesh, sequence_parallel=True)
    attention = model.layers["0"].attention
    local_rows = {n: attention.get_submodule(n).weight.to_local().shape[0] for n in full_rows}
    try:
        apply_tp(build_model(tiny_args(num_heads=3)), tp_mesh, sequence_parallel=False)
        bad_heads = "no error"
    except ValueError as e:
        bad_heads = str(e)
    return {"full_rows": full_rows, "local_rows": local_rows, "bad_heads": bad_heads}


if __name__ == "__main__":
    sys.exit(worker_main(tensor_parallel))
