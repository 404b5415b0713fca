"""The selective recompute policy (`parallel/activation_checkpoint.py`): what it keeps and what it
runs again, op by op, and on an FP8 model, whose GEMMs' quantisation must all run again."""

from functools import partial

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from dstrain.model.fp8 import inside_fp8_gemm
from dstrain.model.fp8_linear import apply_fp8
from dstrain.model.transformer import build_model
from dstrain.parallel import activation_checkpoint
from dstrain.parallel.activation_checkpoint import KEPT_OPS, apply_ac
from dstrain.planner.memory import UP_PROJECTION
from tests.unit.tiny import tiny_args

aten = torch.ops.aten
KEEP, RECOMPUTE = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE


def _decide(op, *args):
    return activation_checkpoint._keep_costly(None, op, *args)


def test_matmuls_are_kept_and_up_projections_and_elementwise_ops_run_again():
    x = torch.randn(4, 16)
    square = torch.randn(16, 16)
    up = torch.randn(16, 16 * UP_PROJECTION)
    just_under = torch.randn(16, 16 * UP_PROJECTION - 1)
    assert _decide(aten.mm.default, x, square) == KEEP
    assert _decide(aten.mm.default, x, just_under) == KEEP
    assert _decide(aten.mm.default, x, up) == RECOMPUTE
    assert _decide(aten.addmm.default, torch.zeros(16), x, square) == KEEP
    assert _decide(aten.addmm.default, torch.zeros(up.shape[1]), x, up) == RECOMPUTE
    assert _decide(aten.bmm.default, x[None], up[None]) == RECOMPUTE
    assert _decide(aten.silu.default, x) == RECOMPUTE
    assert _decide(aten.mul.Tensor, x, x) == RECOMPUTE
    # the CPU's flash kernel and torch's own reduce-scatter are among the kept ops
    assert aten._scaled_dot_product_flash_attention_for_cpu.default in KEPT_OPS
    assert torch.ops._c10d_functional.reduce_scatter_tensor.default in KEPT_OPS
    assert torch.ops._c10d_functional.all_to_all_single.default not in KEPT_OPS


def _fp8_loss_and_grads(ac: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = build_model(tiny_args(), device="cpu", seed=0)
    apply_fp8(model, "emulated")
    apply_ac(model, mode=ac)
    tokens = torch.randint(0, model.args.vocab_size, (2, 17), generator=torch.Generator())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(tokens)[0]
    loss = logits.float().logsumexp(-1).mean()
    loss.backward()
    grads = {
        name.replace("._checkpoint_wrapped_module", ""): p.grad
        for name, p in model.named_parameters()
    }
    return loss.detach(), grads


def test_an_fp8_gemm_keeps_none_of_its_intermediates_and_the_step_is_unchanged(monkeypatch):
    seen: list[tuple[bool, CheckpointPolicy]] = []

    def recording(ctx, op, *args, **kwargs):
        decision = activation_checkpoint._keep_costly(ctx, op, *args, **kwargs)
        seen.append((inside_fp8_gemm(), decision))
        return decision

    policy = partial(create_selective_checkpoint_contexts, recording)
    monkeypatch.setattr(activation_checkpoint, "_selective_context", policy)
    loss, grads = _fp8_loss_and_grads("selective")
    inside = [decision for was_inside, decision in seen if was_inside]
    outside = [decision for was_inside, decision in seen if not was_inside]
    assert inside and all(d == RECOMPUTE for d in inside)
    assert KEEP in outside  # the attention kernel and the fp32 router's matmul
    assert not inside_fp8_gemm()  # the flag is down once the GEMMs are done
    plain_loss, plain_grads = _fp8_loss_and_grads("none")
    assert torch.equal(loss, plain_loss)
    assert grads.keys() == plain_grads.keys()
    for name, grad in grads.items():
        if grad is None:
            assert plain_grads[name] is None, name
        else:
            assert torch.equal(grad, plain_grads[name]), name


@pytest.mark.parametrize("split_backward", [False, True])
def test_split_backward_schedules_keep_the_per_op_policy(split_backward):
    model = build_model(tiny_args(), device="meta")
    apply_ac(model, mode="selective", split_backward=split_backward)
    block = model.layers["1"]
    assert type(block).__name__ == "CheckpointWrapper"  # the whole block, as under 1F1B
    assert type(block._checkpoint_wrapped_module.attention).__name__ != "CheckpointWrapper"
    context_fn = block.checkpoint_fn.keywords["context_fn"]
    expected = "_two_backward_context" if split_backward else "_selective_context"
    assert context_fn is getattr(activation_checkpoint, expected)


def test_the_two_backward_cache_replays_a_kept_output_twice():
    """torch's own cache lets a region's kept outputs be replayed once; this one, twice, and it
    still refuses a kept output modified in place."""
    x = torch.randn(4, 16, requires_grad=True)
    w = torch.randn(16, 16, requires_grad=True)
    torch_cache, two_backward = (
        activation_checkpoint._selective_context,
        activation_checkpoint._two_backward_context,
    )
    for context, replays in (torch_cache, 1), (two_backward, 2):
        y = torch.utils.checkpoint.checkpoint(
            lambda x: (x @ w).sin(), x, use_reentrant=False, context_fn=context
        )
        torch.autograd.grad(y.sum(), [x], retain_graph=True)  # one graph task
        if replays == 2:
            (dw,) = torch.autograd.grad(y.sum(), [w])  # another
            torch.testing.assert_close(dw, torch.autograd.grad((x @ w).sin().sum(), [w])[0])
        else:
            with pytest.raises(RuntimeError, match="backward an extra time"):
                torch.autograd.grad(y.sum(), [w])
    caching, cached = activation_checkpoint._two_backward_context()
    with caching:
        kept = x.detach() @ w.detach()
    kept.add_(1)
    with cached, pytest.raises(RuntimeError, match="mutated"):
        x.detach() @ w.detach()
