"""The CUDA-only calls of the training step, judged by torch's own meta kernels on a CPU.

A GPU step calls kernels the CPU step never reaches: blockwise `scaled_mm` (cuBLASLt, SM90) for
FP8, `_grouped_mm`'s CUDA path for the routed experts. torch's meta kernels for those ops carry
the CUDA code's own checks (operand majorness, scale layouts, dtypes, strides), so running the
real modules on the `meta` device, forward and backward, has torch refuse what cuBLASLt or
CUTLASS would refuse on an H100, without one. What they cannot judge (numerics, speed) is
`benchmarks/gpu_check.py`'s, on a GPU.

Shapes are DeepSeek-V3's: [B, 4096, 7168] activations into its projections, and expert chunks of
0, 1, 127, 128 and 129 rows (a chunk that 128 divides is where a missing copy hides: nothing
gets padded).
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dstrain.model import moe
from dstrain.model.fp8_grouped import fp8_grouped_mm
from dstrain.model.fp8_linear import Fp8Linear
from dstrain.model.moe import GroupedExperts

META = torch.device("meta")
BF16 = torch.bfloat16
V3_DIM, V3_EXPERT = 7168, 2048
EXPERT_ROWS = [0, 1, 127, 128, 129]

# (input shape, out features): V3's MLA down-projections and output projection, its dense FFN
# down-projection, and shapes 128 does not divide.
LINEARS = [
    ((2, 4096, V3_DIM), 1536),  # wq_a
    ((2, 4096, V3_DIM), 576),  # wkv_a (kv_lora_rank + qk_rope_head_dim)
    ((1, 4096, 16384), V3_DIM),  # wo: 128 heads x v_head_dim 128
    ((2, 100, 256), 384),
    ((256, 512), 384),  # 2-D input
    ((3, 129, 200), 130),
]


def _backward(y: torch.Tensor) -> None:
    y.backward(torch.empty_like(y))


@pytest.mark.parametrize("shape,out", LINEARS, ids=lambda v: str(v))
@pytest.mark.parametrize("weight_dtype", [BF16, torch.float32], ids=["fsdp-bf16", "fp32"])
def test_fp8_linear_forward_and_backward_pass_scaled_mm_meta_kernel(shape, out, weight_dtype):
    linear = Fp8Linear(shape[-1], out, bias=False, device=META, dtype=weight_dtype)
    linear.fp8_backend = "scaled_mm"
    x = torch.empty(shape, device=META, dtype=BF16, requires_grad=True)
    y = linear(x)
    assert y.shape == (*shape[:-1], out) and y.dtype == BF16
    _backward(y)  # dgrad and wgrad: wgrad's operands are the tokens-major transposes
    assert x.grad.shape == x.shape and linear.weight.grad.shape == linear.weight.shape


class _HostToDevice(TorchDispatchMode):
    """Records every copy from the host to the run's device: a blocking one waits for the
    stream on a GPU (torch synchronizes it), a host sync the step cannot afford per expert.
    `.to(device)` of a host tensor dispatches `_to_copy`; `torch.tensor(data, device=...)` and
    `torch.as_tensor` copy below the dispatcher, so they are wrapped while the mode is on."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        super().__init__()
        self.copies: list[str] = []
        for name in ("tensor", "as_tensor"):
            monkeypatch.setattr(torch, name, self._recording(name, getattr(torch, name)))

    def _recording(self, name: str, original):
        def build(*args, **kwargs):
            self.copies.append(f"torch.{name}")
            return original(*args, **kwargs)

        return build

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        sources = args[1:2] if func is torch.ops.aten.copy_.default else args[:1]
        from_host = any(isinstance(s, torch.Tensor) and s.device.type == "cpu" for s in sources)
        if from_host and isinstance(out, torch.Tensor) and out.device == META:
            self.copies.append(str(func))
        return out


@pytest.mark.parametrize(
    "inner,outer", [(V3_DIM, V3_EXPERT), (V3_EXPERT, V3_DIM)], ids=["w1-w3", "w2"]
)
def test_fp8_experts_pass_scaled_mm_meta_kernel_on_every_chunk_size(inner, outer, monkeypatch):
    x = torch.empty(sum(EXPERT_ROWS), inner, device=META, dtype=BF16, requires_grad=True)
    w = torch.empty(len(EXPERT_ROWS), outer, inner, device=META, requires_grad=True)
    counts = torch.empty(len(EXPERT_ROWS), dtype=torch.int64, device=META)
    with _HostToDevice(monkeypatch) as recorded:
        y = fp8_grouped_mm(x, w, counts, EXPERT_ROWS, "scaled_mm")
        assert y.shape == (sum(EXPERT_ROWS), outer)
        _backward(y)
    assert x.grad.shape == x.shape and w.grad.shape == w.shape
    assert recorded.copies == []  # the wgrad's scatter index is computed on the device


def test_fp8_swiglu_experts_pass_the_meta_kernels_through_the_module():
    """The module's own path: GroupedExperts with `fp8_backend = scaled_mm`, its split sizes
    read once from the counts (here given, as meta tensors hold none)."""
    experts = GroupedExperts(len(EXPERT_ROWS), 256, 384).to_empty(device=META)
    x = torch.empty(sum(EXPERT_ROWS), 256, device=META, dtype=BF16, requires_grad=True)
    counts = torch.empty(len(EXPERT_ROWS), dtype=torch.int64, device=META)
    y = moe.grouped_swiglu(
        x, experts.w1, experts.w2, experts.w3, counts, "scaled_mm", sizes=EXPERT_ROWS
    )
    _backward(y)
    assert experts.w2.grad.shape == experts.w2.shape


@pytest.mark.parametrize("rows", [sum(EXPERT_ROWS), 1], ids=["mixed-chunks", "one-row"])
def test_bf16_grouped_gemm_passes_grouped_mm_meta_kernel_without_host_sizes(rows):
    """bf16 experts run `_grouped_mm` with device offsets: no split sizes, forward or backward."""
    E = len(EXPERT_ROWS)
    x = torch.empty(rows, V3_DIM, device=META, dtype=BF16, requires_grad=True)
    w = torch.empty(E, V3_EXPERT, V3_DIM, device=META, dtype=BF16, requires_grad=True)
    counts = torch.empty(E, dtype=torch.int64, device=META)
    assert moe._can_group(x, w)
    y = moe._grouped_matmul(x, w, counts)
    _backward(y)
    assert w.grad.shape == w.shape


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fp32_and_fp16_experts_leave_the_grouped_kernel_that_cuda_refuses(dtype):
    """CUDA's `_grouped_mm` takes bf16 only (its meta kernel refuses the rest), so fp32 and
    fp16 experts off the CPU take the per-expert path on host sizes, which the meta kernels
    accept; the CPU's own kernel runs them grouped."""
    x = torch.empty(sum(EXPERT_ROWS), 64, device=META, dtype=dtype, requires_grad=True)
    w = torch.empty(len(EXPERT_ROWS), 32, 64, device=META, dtype=dtype, requires_grad=True)
    offsets = torch.empty(len(EXPERT_ROWS), dtype=torch.int32, device=META)
    with pytest.raises(RuntimeError, match="BF16"):
        torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets)
    assert not moe._can_group(x, w)
    assert moe._can_group(torch.empty(2, 64, dtype=dtype), torch.empty(1, 32, 64, dtype=dtype))
    _backward(moe._grouped_matmul(x, w, offsets, EXPERT_ROWS))
    assert w.grad.shape == w.shape
