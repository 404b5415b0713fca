"""Expert parallelism against the single-device MoE and model, on 2 or 4 gloo ranks.

Every rank gets its own batch. Each rank also runs the unsharded reference on every rank's batch
(the tensors are tiny), so it can check its own share without trusting a collective: its MoE
output and input gradient against the reference on its batch, its expert-weight gradients
against the sum of the reference gradients over its ep group, and (2 ranks) a few training steps
of a tiny model against one process on the concatenated batch. Results are raw differences; the
test holds the tolerances.

Legend: T tokens, D dim, E routed experts, W ep ranks, L = E / W experts per rank.
"""

import copy
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from dstrain.config.model_args import ModelArgs
from dstrain.config.parallel_dims import ParallelDims
from dstrain.model.moe import MoE
from dstrain.model.transformer import Transformer, build_model
from dstrain.parallel.activation_checkpoint import apply_ac
from dstrain.parallel.expert_parallel import ExpertParallelExperts, apply_ep
from dstrain.parallel.materialize import materialize
from dstrain.parallel.mesh import build_meshes
from dstrain.train.loss import TokenCounts, loss_terms
from dstrain.train.step import update_balancing_bias
from tests.distributed.harness import worker_main
from tests.unit.tiny import tiny_args

TOKENS = 12  # per rank: few enough that some (rank, expert) pairs get no rows by chance
MOE_ARGS = {
    # Device-limited routing: E=4 in 2 groups, top-1 group, K=2: at ep2 a group is one rank.
    4: ModelArgs(
        dim=32,
        num_routed_experts=4,
        num_activated_experts=2,
        num_shared_experts=1,
        moe_inter_dim=16,
        n_group=2,
        topk_group=1,
        route_scale=2.5,
    ),
    8: ModelArgs(
        dim=32,
        num_routed_experts=8,
        num_activated_experts=3,
        num_shared_experts=1,
        moe_inter_dim=16,
        n_group=4,
        topk_group=2,
        route_scale=2.5,
    ),
}
NEVER = -10.0  # a balancing bias that no affinity in (0, 1) overcomes


def _moe_cases(num_experts: int) -> dict[str, dict]:
    """name -> (router groups, experts never chosen, whether rank 0 keeps to its own experts)."""
    cases = {
        "random": dict(),
        # Ep rank 0's tokens pick its own experts (and at ep4 at most one other rank's).
        "rank0_keeps_home": dict(home=True),
        # No group limit; expert 1 is never chosen: ep rank 0 gets no rows for one local expert.
        "unused_expert": dict(n_group=1, topk_group=1, never=[1]),
    }
    if num_experts == 4:
        # The second group's score includes expert 3's -10: ep rank 1 receives no rows at all.
        cases["idle_rank"] = dict(never=[3])
    return cases


def run(out_dir) -> dict:
    world = dist.get_world_size()
    layouts = {"ep2": 2} if world == 2 else {"ep4": 4, "ep2_efsdp2": 2}
    results: dict = {"rank": dist.get_rank()}
    for layout, ep in layouts.items():
        dims = ParallelDims(
            dp_replicate=1, dp_shard=world, cp=1, tp=1, pp=1, ep=ep, world_size=world
        )
        meshes = build_meshes(dims, "cpu")
        E = 4 if ep == 2 and world == 2 else 8
        for name, case in _moe_cases(E).items():
            results[f"{layout}/{name}"] = _moe_case(E, case, meshes["ep"])
        if world == 2:
            results["meta"] = _meta_build(meshes["ep"])
            results["train"] = _train(meshes["ep"], ac="none")
            results["train_ac"] = _train(meshes["ep"], ac="selective")
    return results


def _moe_case(num_experts: int, case: dict, ep_mesh) -> dict:
    changes = {k: case[k] for k in ("n_group", "topk_group") if k in case}
    args = ModelArgs.model_validate({**MOE_ARGS[num_experts].model_dump(), **changes})
    ref = _reference_moe(args, case.get("never", []))
    ep_moe = copy.deepcopy(ref)
    apply_ep(ep_moe, ep_mesh)
    group = dist.get_process_group_ranks(ep_mesh.get_group())
    batches = {
        r: _moe_batch(ref, r, ep_mesh.size(), home=case.get("home", False) and r == group[0])
        for r in group
    }
    ref_runs = {r: _forward_backward(ref, *batches[r]) for r in group}
    me = dist.get_rank()
    x, g = batches[me]
    x = x.clone().requires_grad_()
    out = ep_moe(x)
    out.backward(g)
    L = num_experts // ep_mesh.size()
    block = slice(ep_mesh.get_local_rank() * L, (ep_mesh.get_local_rank() + 1) * L)
    expert_grads = {}
    for name in ("w1", "w2", "w3"):
        local = getattr(ep_moe.experts, name).grad.to_local()
        want = sum(ref_runs[r]["grads"][f"experts.{name}"][block] for r in group)
        expert_grads[name] = _diff(local, want)
    dense = {n: p.grad for n, p in ep_moe.named_parameters() if not isinstance(p, DTensor)}
    return {
        "out": _diff(out, ref_runs[me]["out"]),
        "x_grad": _diff(x.grad, ref_runs[me]["x_grad"]),
        "expert_grads": expert_grads,
        "dense_grads": max(_diff(dense[n], ref_runs[me]["grads"][n])["rel"] for n in dense),
        "sends": _send_matrix(ref, batches, group, L),
        "local_experts": _local_experts(ep_moe),
    }


def _reference_moe(args: ModelArgs, never: list[int]) -> MoE:
    torch.manual_seed(0)
    moe = MoE(args)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.3)
        moe.router.expert_bias.normal_(0, 0.05)
        moe.router.expert_bias[never] = NEVER
    return moe


def _moe_batch(ref: MoE, rank: int, ep: int, home: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank-specific input [2, T/2, D] and output gradient. With `home`, the input leans along
    the direction whose router logits are +4 for ep rank 0's experts and -4 for the rest."""
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(2, TOKENS // 2, ref.router.gate.in_features, generator=gen)
    if home:
        L = ref.num_experts // ep
        target_E = torch.full((ref.num_experts,), -4.0)
        target_E[:L] = 4.0
        x = 0.05 * x + torch.linalg.pinv(ref.router.gate.weight.detach()) @ target_E
    return x, torch.randn(x.shape, generator=gen)


def _forward_backward(moe: MoE, x: torch.Tensor, g: torch.Tensor) -> dict:
    moe.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    out = moe(x)
    out.backward(g)
    grads = {n: p.grad.clone() for n, p in moe.named_parameters()}
    return {"out": out.detach(), "x_grad": x.grad, "grads": grads}


def _send_matrix(ref: MoE, batches: dict, group: list[int], L: int) -> dict:
    """Rows each rank sends each ep rank, and the fewest rows any (ep rank, local expert) got."""
    counts = {}
    with torch.no_grad():
        for r in group:
            _, experts_TK, _ = ref.router(batches[r][0].flatten(0, 1))
            counts[r] = torch.bincount(experts_TK.flatten(), minlength=ref.num_experts)
    total_E = sum(counts.values())
    return {
        "rows": [counts[r].view(-1, L).sum(1).tolist() for r in group],
        "min_rows_per_local_expert": int(total_E.min()),
        "min_rows_per_rank": int(total_E.view(-1, L).sum(1).min()),
    }


def _local_experts(model: nn.Module) -> list[dict]:
    """Per ExpertParallelExperts: local first dims, and whether its local storage is exactly
    the L experts (no full copy kept anywhere in the module)."""
    found = []
    for mod in model.modules():
        if isinstance(mod, ExpertParallelExperts):
            locals_ = [p.to_local() for p in mod.parameters()]
            per_expert = sum(t[0].numel() for t in locals_)
            stored = sum(t.numel() for t in locals_) + sum(b.numel() for b in mod.buffers())
            found.append(
                {
                    "global_E": mod.w1.shape[0],
                    "local_E": [t.shape[0] for t in locals_],
                    "stored_over_per_expert": stored / per_expert,
                }
            )
    return found


def _meta_build(ep_mesh) -> dict:
    """The trainer's order: build on meta, apply_ep, then materialize and initialize."""
    with torch.device("meta"):
        model = Transformer(tiny_args())
    apply_ep(model, ep_mesh)
    materialize(model, torch.device("cpu"), seed=0)
    return {
        "local_experts": _local_experts(model),
        "finite": all(
            bool(p.to_local().isfinite().all())
            if isinstance(p, DTensor)
            else bool(p.isfinite().all())
            for p in model.parameters()
        ),
    }


def _train(ep_mesh, ac: str, steps: int = 3, batch: int = 4, seq: int = 17) -> dict:
    """AdamW steps with EP on each rank's half of the batch, dense gradients summed across ranks
    (the loss is normalized by the global token count), router loads summed before the bias
    update; against one process on the whole batch."""
    args = tiny_args(n_group=1, topk_group=1, aux_loss_alpha=0.01)
    torch.manual_seed(0)
    # fp64: in fp32, 3 AdamW steps at lr 1e-2 leave entries with gradients near eps (the MTP
    # block's shared expert) up to 3.7e-3 of their scale apart; in fp64 the logic shows exact.
    ref = build_model(args).double()
    model = copy.deepcopy(ref)
    apply_ep(model, ep_mesh)
    apply_ac(model, mode=ac)  # after EP, as parallelize_model orders them
    for moe in (m for m in model.modules() if isinstance(m, MoE)):
        moe.aux_loss_scale = 1.0 / ep_mesh.size()  # each rank's balance loss averages its half
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rank, world = ep_mesh.get_local_rank(), ep_mesh.size()
    gen = torch.Generator().manual_seed(7)
    losses, ref_losses = [], []
    for _ in range(steps):
        full = torch.randint(0, args.vocab_size, (batch, seq), generator=gen)
        counts = TokenCounts.of([full[:, 1:]], args.num_mtp_modules)
        ref_losses.append(_step(ref, opt_ref, full, counts, args))
        mine = full.chunk(world)[rank]
        losses.append(_step(model, opt, mine, counts, args, group=ep_mesh.get_group()))
    return {"losses": losses, "ref_losses": ref_losses, **_param_diffs(model, ref, ep_mesh)}


def _step(model, opt, tokens, counts, args, group=None) -> list[float]:
    outputs = model(tokens[:, :-1])
    total, parts = loss_terms(outputs, tokens[:, 1:], counts, args.mtp_loss_weight)
    total.backward()
    loss = torch.stack([total.detach(), parts["main"], parts["mtp"]])
    if group is not None:
        dist.all_reduce(loss, group=group)
        for p in model.parameters():
            if p.grad is not None and not isinstance(p, DTensor):  # experts: summed by all-to-all
                dist.all_reduce(p.grad, group=group)
        for name, buf in model.named_buffers():
            if name.endswith("tokens_per_expert"):
                dist.all_reduce(buf, group=group)
    opt.step()
    opt.zero_grad(set_to_none=True)
    update_balancing_bias(model, args.bias_update_speed)
    return loss.tolist()


def _param_diffs(model: nn.Module, ref: nn.Module, ep_mesh) -> dict:
    ref_params = dict(ref.named_parameters())
    ref_buffers = dict(ref.named_buffers())
    dense, experts, worst = 0.0, 0.0, ""
    for name, p in model.named_parameters():
        want = ref_params[name.replace("_checkpoint_wrapped_module.", "")].detach()
        if isinstance(p, DTensor):
            L = want.shape[0] // ep_mesh.size()
            start = ep_mesh.get_local_rank() * L
            experts = max(experts, _diff(p.to_local(), want[start : start + L])["rel"])
        else:
            rel = _diff(p, want)["rel"]
            dense, worst = (rel, name) if rel > dense else (dense, worst)
    bias = max(
        _diff(b, ref_buffers[n.replace("_checkpoint_wrapped_module.", "")])["abs"]
        for n, b in model.named_buffers()
        if n.endswith("expert_bias")
    )
    return {
        "dense_params": dense,
        "worst_dense": worst,
        "expert_params": experts,
        "expert_bias": bias,
        "local_experts": _local_experts(model),
    }


def _diff(got: torch.Tensor, want: torch.Tensor) -> dict:
    got, want = got.detach().double(), want.detach().double()
    err, scale = (got - want).abs().max().item(), want.abs().max().item()
    return {"abs": err, "scale": scale, "rel": err / scale if scale > 0 else err}


if __name__ == "__main__":
    sys.exit(worker_main(run))
