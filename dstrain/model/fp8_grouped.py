"""The routed experts' GEMMs in FP8 as one grouped computation (DeepSeek-V3's recipe, `fp8.py`).

Legend: T rows (token copies) sorted by expert, I the contraction of a GEMM, O its output width,
E experts, n_e rows of expert e, P rows padded so that every expert starts on a 128-row tile.

One quantisation pass per operand for all experts, not one per expert:
- forward and dgrad: the 1 x 128 tiles run along each row, so the whole [T, I] is quantised at
  once and every expert's rows are a slice of it; the weights [E, O, I] are quantised in 128 x
  128 blocks in one pass over the stack;
- wgrad: the tiles run along the tokens, and a tile must not hold two experts' rows, so the rows
  are first scattered to P positions, each expert from a 128-aligned start (zeros between; a
  zero changes no amax and no product), then quantised at once.

The GEMMs then run per expert on slices of those operands. No kernel in torch 2.13 does a
grouped blockwise GEMM: `scaled_grouped_mm` takes TensorWise / RowWise scales (SM90) and MX
scales (SM100) only, and `_grouped_mm`'s CUDA kernel takes bf16 alone (its meta kernel says
so). The slices need the split sizes on the host, so the caller passes `sizes` as Python ints:
one device-to-host read per MoE layer and micro-batch, shared by its three GEMMs forward and
backward (`moe.grouped_swiglu`; under expert parallelism it rides on the all-to-all's read).
Where a tensor of them is needed on the device (wgrad's scatter) it is computed there from the
counts, not copied from the host: a blocking host-to-device copy waits for the stream too.

The result is bit-identical to one `fp8.Fp8Matmul` per expert: the same tiles, blocks and
chunk products.
"""

from collections.abc import Callable

import torch

from dstrain.model import fp8
from dstrain.model.fp8 import (
    COMPUTE,
    TILE,
    Quantized,
    blockwise_mm,
    no_autocast,
    quantize_blocks,
    quantize_tiles,
)


def _rows(q: Quantized, start: int, stop: int) -> Quantized:
    """Rows [start, stop) of a 1 x 128-tile operand."""
    return Quantized(q.data[start:stop], q.scale[start:stop], 1, stop - start, q.cols)


def _expert(q: Quantized, e: int) -> Quantized:
    """Expert e's weight from a stack quantised in 128 x 128 blocks."""
    return Quantized(q.data[e], q.scale[e], TILE, q.rows, q.cols)


def _tile_starts(sizes: list[int]) -> tuple[list[int], int]:
    """Each expert's first column when every expert starts on a whole 128-tile, and the total."""
    starts, position = [], 0
    for n in sizes:
        starts.append(position)
        position += -(-n // TILE) * TILE
    return starts, position


def _tiles_along_rows(x_TI: torch.Tensor, counts_E: torch.Tensor, padded_rows: int) -> Quantized:
    """x^T [I, P] quantised in 1 x 128 tiles along the rows of x, each expert's rows from a
    128-aligned column (`_tile_starts`): its first tile its own."""
    # Row t of expert e moves by e's padded start minus its start: on the device, from the counts.
    padded_E = (counts_E + TILE - 1) // TILE * TILE
    shift_E = (padded_E.cumsum(0) - padded_E) - (counts_E.cumsum(0) - counts_E)
    T = x_TI.size(0)
    index_T = torch.arange(T, device=x_TI.device) + shift_E.repeat_interleave(
        counts_E, output_size=T
    )
    padded = x_TI.new_zeros(padded_rows, x_TI.size(1)).index_copy_(0, index_T, x_TI)
    return quantize_tiles(padded.t())


def _columns(q: Quantized, start: int, n: int) -> Quantized:
    """Columns [start, start + n) of a 1 x 128-tile operand, `start` on a tile boundary."""
    stop = start + -(-n // TILE) * TILE
    data = q.data[:, start:stop].contiguous()
    scale = q.scale[:, start // TILE : stop // TILE].contiguous()
    return Quantized(data, scale, 1, q.rows, n)


class Fp8GroupedMatmul(torch.autograd.Function):
    """y[rows of e] = x[rows of e] @ w[e]^T for every expert e, every GEMM in E4M3.

    x [T, I] sorted by expert, w [E, O, I] in any float dtype (quantised from bf16 copies),
    `counts_E` the E row counts on the device and `sizes` the same as ints (zero allowed);
    y [T, O] bf16, dx in x's dtype, dw in w's.
    An expert without rows contributes nothing and gets a zero gradient; y hangs off x in the
    autograd graph even when T is 0, so an EP rank that received no rows still runs the
    dispatch's backward all-to-all with its peers."""

    @staticmethod
    def forward(ctx, x_TI, w_EOI, counts_E, sizes, backend):
        x_c, w_c = x_TI.to(COMPUTE), w_EOI.to(COMPUTE)
        ctx.sizes, ctx.backend, ctx.x_dtype, ctx.w_dtype = sizes, backend, x_TI.dtype, w_EOI.dtype
        with fp8.fp8_gemm_region():
            qx, qw = quantize_tiles(x_c), quantize_blocks(w_c)
            y_TO = _per_expert(qx, lambda e: _expert(qw, e), sizes, COMPUTE, backend)
        ctx.save_for_backward(x_c, w_c, counts_E)  # bf16, not E4M3: as `fp8.Fp8Matmul`
        return y_TO

    @staticmethod
    def backward(ctx, grad_TO):
        x_TI, w_EOI, counts_E = ctx.saved_tensors
        grad_TO = grad_TO.to(COMPUTE)
        sizes, backend = ctx.sizes, ctx.backend
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            qg, qw = quantize_tiles(grad_TO), quantize_blocks(w_EOI)
            weight_t = lambda e: _expert(qw, e).t()  # noqa: E731
            grad_x = _per_expert(qg, weight_t, sizes, ctx.x_dtype, backend)
        if ctx.needs_input_grad[1]:
            starts, padded_rows = _tile_starts(sizes)
            qg_OP, qx_IP = (_tiles_along_rows(t, counts_E, padded_rows) for t in (grad_TO, x_TI))
            grad_w = torch.zeros(w_EOI.shape, dtype=torch.float32, device=w_EOI.device)
            for e, (start, n) in enumerate(zip(starts, sizes, strict=True)):
                if n:
                    a, b = _columns(qg_OP, start, n), _columns(qx_IP, start, n)
                    grad_w[e] = blockwise_mm(a, b, torch.float32, backend)
            grad_w = grad_w.to(ctx.w_dtype)
        return grad_x, grad_w, None, None, None


def _per_expert(
    q_TI: Quantized,
    weight: Callable[[int], Quantized],
    sizes: list[int],
    out_dtype: torch.dtype,
    backend: str,
) -> torch.Tensor:
    """Each expert's rows of `q_TI` times `weight(e)`^T, concatenated: [T, O] in `out_dtype`."""
    out, start = [], 0
    for e, n in enumerate(sizes):
        if n:
            out.append(blockwise_mm(_rows(q_TI, start, start + n), weight(e), out_dtype, backend))
        start += n
    if not out:
        return q_TI.data.new_zeros(0, weight(0).rows, dtype=out_dtype)
    return torch.cat(out)


@torch.compiler.disable
def fp8_grouped_mm(
    x_TI: torch.Tensor,
    w_EOI: torch.Tensor,
    counts_E: torch.Tensor,
    sizes: list[int],
    backend: str,
) -> torch.Tensor:
    """x @ w[e]^T per expert in FP8 (bf16 output), outside autocast (as `fp8.fp8_matmul`).
    Eager under torch.compile: the slices follow data-dependent sizes."""
    with no_autocast(x_TI.device):
        return Fp8GroupedMatmul.apply(x_TI, w_EOI, counts_E, sizes, backend)
