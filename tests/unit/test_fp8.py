"""FP8 quantisation and the blockwise GEMM (dstrain/model/fp8.py) against fp64 references.

Error bounds (E4M3: 3 mantissa bits, largest finite 448, smallest normal 2^-6):
- a quantised element is within 2^-4 of its value relatively (half an ulp of a 4-bit
  significand) where it lands in E4M3's normal range, and within 2^-10 x scale absolutely where
  it lands among the subnormals (half the subnormal spacing 2^-9, in scaled units);
- the blockwise GEMM equals the fp64 product of the dequantised operands, summed per 128-chunk
  with the chunk's two scales, to fp32 accumulation: within 8 x 2^-24 x sum |a||b| per output.
"""

import pytest
import torch

from dstrain.errors import UserError
from dstrain.model import fp8, fp8_grouped
from dstrain.model.fp8_linear import Fp8Linear

SHAPES = [(5, 7, 9), (130, 200, 300), (256, 128, 128), (1, 129, 257)]


def _data(rows, cols, seed):
    g = torch.Generator().manual_seed(seed)
    # Heavy-tailed, with a few outliers, as activations are.
    x = torch.randn(rows, cols, generator=g) ** 3
    x[0, 0] = 300.0
    return x


def _bound(x, scale_per_element):
    return torch.maximum(x.abs() * 2**-4, scale_per_element * 2**-10) * (1 + 1e-6)


def _expand(scale, rows, cols, block_rows):
    s = scale.repeat_interleave(fp8.TILE, 1)[:, :cols]
    if block_rows == fp8.TILE:
        s = s.repeat_interleave(fp8.TILE, 0)
    return s[:rows]


@pytest.mark.parametrize("rows,cols", [(5, 9), (130, 300), (1, 257), (256, 128)])
def test_tiles_round_within_the_e4m3_bound(rows, cols):
    x = _data(rows, cols, 0).to(torch.float64)
    q = fp8.quantize_tiles(x.float())
    assert q.data.dtype == torch.float8_e4m3fn and q.scale.shape == (rows, -(-cols // 128))
    err = (fp8.dequantize(q).double() - x).abs()
    assert (err <= _bound(x, _expand(q.scale, rows, cols, 1).double())).all()
    # Each tile's largest element maps to 448 exactly: the scale is amax / 448.
    amax = fp8.tile_amax(x.float())
    assert torch.allclose(q.scale, amax / 448, rtol=0)


@pytest.mark.parametrize("rows,cols", [(7, 9), (200, 300), (129, 257)])
def test_blocks_round_within_the_bound_and_transpose_to_the_same_values(rows, cols):
    w = _data(rows, cols, 1).to(torch.float64) * 0.02
    q = fp8.quantize_blocks(w.float())
    assert q.scale.shape == (-(-rows // 128), -(-cols // 128))
    err = (fp8.dequantize(q).double() - w).abs()
    assert (err <= _bound(w, _expand(q.scale, rows, cols, 128).double())).all()
    assert torch.equal(fp8.dequantize(q.t()), fp8.dequantize(q).t())


def test_zero_tiles_get_scale_one_and_stay_zero():
    x = torch.zeros(3, 200)
    x[1, 150] = 2.0
    q = fp8.quantize_tiles(x)
    assert q.scale[0].tolist() == [1.0, 1.0] and q.scale[1, 0] == 1.0
    assert torch.equal(fp8.dequantize(q), x)


def _chunked_reference(a: fp8.Quantized, b: fp8.Quantized) -> torch.Tensor:
    """The GPU's formula in fp64: sum_c (qa_c . qb_c) * sa_c * sb_c."""
    qa = a.data[: a.rows].double().view(a.rows, -1, 128)
    qb = b.data[: b.rows].double().view(b.rows, -1, 128)
    sa, sb = a.row_scales()[: a.rows].double(), b.row_scales()[: b.rows].double()
    return torch.einsum("mck,nck,mc,nc->mn", qa, qb, sa, sb)


@pytest.mark.parametrize("M,N,K", SHAPES)
@pytest.mark.parametrize("rhs", ["blocks", "tiles"])
def test_the_emulation_is_the_chunked_formula_to_fp32_accumulation(M, N, K, rhs):
    a = fp8.quantize_tiles(_data(M, K, 2))
    quantize_b = fp8.quantize_blocks if rhs == "blocks" else fp8.quantize_tiles
    b = quantize_b(_data(N, K, 3) * 0.02)
    got = fp8.emulated_mm(a, b).double()
    expected = _chunked_reference(a, b)
    magnitude = fp8.dequantize(a).double().abs() @ fp8.dequantize(b).double().abs().T
    assert ((got - expected).abs() <= 8 * 2**-24 * magnitude + 1e-30).all()


@pytest.mark.parametrize("M,N,K", SHAPES)
def test_the_fp8_product_is_within_quantisation_error_of_the_exact_one(M, N, K):
    x, w = _data(M, K, 4), _data(N, K, 5) * 0.02
    got = fp8.blockwise_mm(fp8.quantize_tiles(x), fp8.quantize_blocks(w), torch.float32, "emulated")
    exact = x.double() @ w.double().T
    # Each product carries at most (1 + 2^-4)^2 - 1 < 0.13 relative error.
    assert ((got.double() - exact).abs() <= 0.13 * (x.double().abs() @ w.double().abs().T)).all()
    rel = (got.double() - exact).norm() / exact.norm()
    assert rel < 0.06, rel


def test_gradients_flow_in_fp8_and_stay_close_to_the_exact_ones():
    g = torch.Generator().manual_seed(6)
    x = torch.randn(2, 40, 200, generator=g, requires_grad=True)
    w = (torch.randn(130, 200, generator=g) * 0.05).requires_grad_()
    y = fp8.fp8_matmul(x, w, "emulated")
    assert y.dtype == torch.bfloat16
    upstream = torch.randn(y.shape, generator=g)
    (y.float() * upstream).sum().backward()
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ((x2 @ w2.T) * upstream).sum().backward()
    assert x.grad.dtype == torch.float32 and w.grad.dtype == torch.float32
    for got, exact in [(y.float(), x2 @ w2.T), (x.grad, x2.grad), (w.grad, w2.grad)]:
        rel = ((got - exact).norm() / exact.norm()).item()
        assert 1e-3 < rel < 0.06, rel  # quantised (not bf16-exact), within E4M3's noise


def test_wgrad_tiles_do_not_cross_sequences():
    """Splitting the batch (ranks, micro-batches) changes no scale: the sum of the two halves'
    weight gradients is the whole batch's exactly, up to fp32 addition."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(4, 48, 128, generator=g)
    w = torch.randn(64, 128, generator=g) * 0.05
    grads = []
    for part in (x, x[:2], x[2:]):
        wp = w.clone().requires_grad_()
        fp8.fp8_matmul(part, wp, "emulated").float().sum().backward()
        grads.append(wp.grad)
    torch.testing.assert_close(grads[1] + grads[2], grads[0], rtol=1e-6, atol=1e-6)


def test_scaled_mm_operands_have_the_layouts_cublaslt_requires():
    a = fp8.quantize_tiles(_data(200, 300, 8))
    data, scale = fp8.scaled_mm_operand(a)
    assert data.shape == (256, 384) and scale.shape == (256, 3) and scale.stride(0) == 1
    b = fp8.quantize_blocks(_data(130, 300, 9))
    data, scale = fp8.scaled_mm_operand(b)
    # [L4, Nb]: Kc = 3 padded to 4, K-major in memory (stride 1 along the K blocks).
    assert data.shape == (256, 384) and scale.shape == (4, 2) and scale.stride(0) == 1
    assert (scale > 0).all()


def test_a_cpu_runs_the_emulation_and_an_explicit_kernel_request_is_refused():
    cpu = torch.device("cpu")
    assert fp8.choose_backend("auto", cpu) == "emulated"
    assert fp8.choose_backend("emulated", cpu) == "emulated"
    assert fp8.choose_backend("auto", None) == "emulated"
    with pytest.raises(UserError, match="blockwise kernel") as info:
        fp8.choose_backend("scaled_mm", cpu)
    assert "fp8_backend = emulated" in info.value.fix


@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "fsdp-bf16"])
def test_grouped_experts_equal_one_fp8_gemm_per_expert_bit_for_bit(w_dtype):
    """One quantisation pass for all experts (`fp8_grouped.py`) gives exactly what one
    `Fp8Matmul` per expert gives: the same tiles (wgrad's aligned to each expert's first row),
    blocks and chunk products, forward, dgrad and wgrad; an expert without rows gets zeros."""
    sizes = [0, 1, 127, 128, 129, 3]
    g = torch.Generator().manual_seed(11)
    x = torch.randn(sum(sizes), 200, generator=g) ** 3
    w = (torch.randn(len(sizes), 136, 200, generator=g) * 0.05).to(w_dtype)
    upstream = torch.randn(sum(sizes), 136, generator=g)

    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    yg = fp8_grouped.fp8_grouped_mm(xg, wg, torch.tensor(sizes), sizes, "emulated")
    (yg.float() * upstream).sum().backward()

    xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
    chunks = xl.split(sizes)
    yl = torch.cat([fp8.fp8_matmul(c, wl[e], "emulated") for e, c in enumerate(chunks) if len(c)])
    (yl.float() * upstream).sum().backward()

    assert torch.equal(yg, yl) and torch.equal(xg.grad, xl.grad)
    assert wg.grad.dtype == w_dtype and torch.equal(wg.grad, wl.grad)
    assert not wg.grad[0].any()


def test_an_fp8_linear_with_a_bias_adds_it_after_the_fp8_matmul():
    """DeepSeek's linears have none, but a model with biases keeps them under the recipe."""
    linear = torch.nn.Linear(128, 128, bias=True, dtype=torch.bfloat16)
    torch.nn.init.normal_(linear.bias, std=1.0)
    x = torch.randn(4, 128, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0))
    linear.__class__ = Fp8Linear  # as apply_fp8 converts the recipe's linears
    expected = fp8.fp8_matmul(x, linear.weight, "emulated") + linear.bias
    assert torch.equal(linear(x), expected)
