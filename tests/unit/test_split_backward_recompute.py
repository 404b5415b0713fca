"""`selective` under the schedules that split each backward into an input-gradient and a
weight-gradient pass (zbv, dualpipev; `parallel/activation_checkpoint.py`): both passes keep the
per-op policy's matmul outputs, each pass recomputes a block once, and the gradients are those of
no recompute. The passes are upstream's own (`torch.distributed.pipelining._backward`), run on a
middle stage of the tiny model, one process."""

import pytest
import torch
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight
from torch.utils._python_dispatch import TorchDispatchMode

from dstrain.model.transformer import build_model
from dstrain.parallel import pipeline
from dstrain.parallel.activation_checkpoint import apply_ac
from tests.unit.tiny import tiny_args

MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}


class _CountMatmuls(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in MATMULS
        return func(*args, **(kwargs or {}))


class _WeightPass:
    """The stage method the pipeline wraps (`PipelineStage.backward_weight_one_chunk`)."""

    def __init__(self, params: list[torch.nn.Parameter], groups: list) -> None:
        self.params, self.groups = params, groups

    def backward_weight_one_chunk(self) -> None:
        stage_backward_weight(iter(self.params), self.groups)


def _middle_stage(ac: str, split: bool) -> torch.nn.Module:
    # 8 heads: the key-value up-projection (8 -> 8 x 16) is one the policy runs again
    model = build_model(tiny_args(num_mtp_modules=0, num_heads=8), device="cpu", seed=0)
    model.embed = model.norm = model.head = None  # hidden states in and out
    apply_ac(model, mode=ac, split_backward=split)
    return model


def _backward(ac: str, split: bool) -> tuple[int, int, torch.Tensor, dict]:
    """Matmuls run in the input-gradient and weight-gradient passes (one full backward when not
    `split`), the input's gradient and the parameters'."""
    model = _middle_stage(ac, split)
    params = list(model.parameters())
    x = torch.randn(2, 16, model.args.dim, generator=torch.Generator().manual_seed(1))
    x.requires_grad_(True)
    out = model(x)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    first, second = _CountMatmuls(), _CountMatmuls()
    if split:
        with first:
            _, groups = stage_backward_input([out], [grad_out], [x], iter(params))
        weight_pass = _WeightPass(params, groups)
        pipeline._one_recompute_per_weight_pass(weight_pass)  # as build_pipeline does
        with second:
            weight_pass.backward_weight_one_chunk()
    else:
        with first:
            out.backward(grad_out)
    names = {
        n.replace("._checkpoint_wrapped_module", ""): p.grad for n, p in model.named_parameters()
    }
    return first.count, second.count, x.grad, names


def model_layers() -> int:
    return tiny_args().num_layers


def test_split_backward_keeps_the_matmul_outputs_and_recomputes_once_per_pass():
    plain_input, plain_weight, *_ = _backward("none", split=True)
    one_input, one_weight, *_ = _backward("none", split=False)
    sel_input, sel_weight, *_ = _backward("selective", split=True)
    sel_full, _, *_ = _backward("selective", split=False)
    assert plain_input + plain_weight == one_input  # the passes split the backward's matmuls
    recomputed_1f1b = sel_full - one_input
    assert recomputed_1f1b == model_layers()  # one up-projection per block runs again
    # each pass recomputes each block once, with the policy's rules: what 1F1B recomputes
    assert sel_input - plain_input == recomputed_1f1b
    assert sel_weight - plain_weight == recomputed_1f1b


@pytest.mark.parametrize("ac", ["selective", "full"])
def test_split_backward_gradients_are_those_of_no_recompute(ac):
    _, _, dx, grads = _backward(ac, split=True)
    _, _, ref_dx, ref_grads = _backward("none", split=True)
    torch.testing.assert_close(dx, ref_dx, rtol=0, atol=0)
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        if ref_grads[name] is None:
            assert grad is None, name
        else:
            torch.testing.assert_close(grad, ref_grads[name], rtol=0, atol=0, msg=name)
