"""Where FP8 weight gradients accumulate across micro-batches under FSDP2 bf16 (DeepSeek-V3
accumulates them in fp32).

`Fp8Matmul`'s wgrad comes out of its GEMM in fp32. Under FSDP2 with `param_dtype = bf16` the
weight it differentiates is the gathered bf16 parameter, and autograd gives a parameter a
gradient of its own dtype: each micro-batch's wgrad is rounded to bf16 once. From there FSDP2
accumulates in `reduce_dtype = fp32`:
- ZeRO-2/3: each micro-batch is reduce-scattered in fp32 and added to the fp32 sharded grad;
- ZeRO-1 (sync deferred to the last micro-batch): FSDP2 upcasts the first unsharded grad to an
  fp32 `unsharded_accumulated_grad` and adds the next ones into it.
So the sum over micro-batches is fp32, exactly the fp32 sum of the bf16-rounded wgrads, and
the deviation from V3's recipe is that one rounding per micro-batch, measured below against
the FP8 quantisation error it sits beside. Without FSDP (DDP, one process) the master weight
is fp32 and so is its FP8 wgrad: nothing is rounded.
"""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from dstrain.model.fp8_linear import Fp8Linear
from dstrain.parallel.data_parallel import mixed_precision

MICRO_BATCHES = 3


@pytest.fixture(scope="module")
def one_rank():
    # An in-process store: no MASTER_* variables left behind for the tests after this one.
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    dist.destroy_process_group()


def _model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(256, 192, bias=False), nn.Linear(192, 128, bias=False))
    for layer in model:
        layer.__class__ = Fp8Linear
        layer.fp8_backend = "emulated"
    return model


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(2, 64, 256, generator=g) for _ in range(MICRO_BATCHES)]


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).float().square().mean()


def _rounded_per_micro_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """The first layer's FP8 wgrad summed over the micro-batches as FSDP2 bf16 sums it (each
    micro-batch's fp32 wgrad rounded to bf16, then summed in fp32), and unrounded. fp32 master
    weights holding bf16 values run the same forward and backward as FSDP2's bf16 copies
    (the FP8 GEMMs quantise from bf16), with an fp32 wgrad."""
    model = _model()
    for layer in model:
        layer.weight.data = layer.weight.data.to(torch.bfloat16).float()
    rounded, exact = torch.zeros(192, 256), torch.zeros(192, 256)
    for x in _batches():
        model.zero_grad()
        _loss(model, x.to(torch.bfloat16)).backward()
        exact += model[0].weight.grad
        rounded += model[0].weight.grad.to(torch.bfloat16).float()
    return rounded, exact


@pytest.mark.parametrize("zero_stage", [1, 2])
def test_fp8_wgrads_accumulate_in_fp32_under_fsdp2_bf16(one_rank, zero_stage):
    model = _model()
    policy = mixed_precision(torch.bfloat16)  # what the trainer's FSDP2 runs
    for layer in model:
        fully_shard(layer, mesh=one_rank, mp_policy=policy, reshard_after_forward=False)
    fully_shard(model, mesh=one_rank, mp_policy=policy, reshard_after_forward=False)
    for i, x in enumerate(_batches()):
        last = i == MICRO_BATCHES - 1
        if zero_stage == 1:  # train/step.py's grad_sync: defer the reduction
            model.set_requires_gradient_sync(last)
        _loss(model, x.to(torch.bfloat16)).backward()
        if zero_stage == 1 and not last:
            # FSDP2's private accumulator (torch 2.13 `FSDPParam.unsharded_accumulated_grad`).
            fsdp_param = model[0]._get_fsdp_state()._fsdp_param_group.fsdp_params[0]
            assert fsdp_param.unsharded_accumulated_grad.dtype == torch.float32
        else:
            assert model[0].weight.grad.to_local().dtype == torch.float32
    rounded, exact = _rounded_per_micro_batch()
    got = model[0].weight.grad.to_local()
    # The fp32 sum of bf16-rounded wgrads, added in the order FSDP2 adds them (micro-batch 0,
    # 1, 2): bit for bit, measured on AVX512 and AVX2 kernels alike.
    torch.testing.assert_close(got, rounded, rtol=0, atol=0)
    deviation = ((got - exact).norm() / exact.norm()).item()
    print(f"FP8 wgrad summed over {MICRO_BATCHES} micro-batches: {deviation:.2e} from fp32")
    assert 0 < deviation < 2**-8, deviation  # one bf16 rounding per micro-batch (2^-9 each)
