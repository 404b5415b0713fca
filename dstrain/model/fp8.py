"""FP8 GEMMs by DeepSeek-V3's fine-grained recipe (V3 report section 3.3 and appendix B).

Legend: M rows of the left operand (tokens), N rows of the right one (output features), K the
contraction, Kc = ceil(K / 128) chunks of K, Nb = ceil(N / 128) blocks of N.

Format: E4M3 (`float8_e4m3fn`, largest finite 448) for every GEMM input, forward and backward.
Scaling, online max-abs:
- activations and activation gradients: one scale per 1 x 128 tile (a row's 128 consecutive
  elements along K). The V3 report (appendix B.2) found 128 x 128 blocks on activation gradients
  diverged a 16B MoE; 1 x 128 tiles follow their per-token outliers.
- weights: one scale per 128 x 128 block. A block's elements are the same under transposition,
  so the backward's W^T reuses the forward's quantised weight unchanged.
Scales are decode factors, amax / 448 in fp32 (V3's reference kernel, `act_quant`); a tile of
zeros gets scale 1. Widths that 128 does not divide are zero-padded: a zero changes no amax and
no product.

Accumulation: `y = sum_c (a_c @ b_c^T) * sa_c * sb_c` over the K chunks, the partial product of
each 128-long chunk taken exactly and scaled into an fp32 accumulator: V3's "promotion to CUDA
cores every 128 elements", which cuBLASLt's blockwise kernel also performs.

Backends (`backend`):
- "scaled_mm": `torch.nn.functional.scaled_mm` with `BlockWise1x128` / `BlockWise128x128`
  (cuBLASLt, SM90 with CUDA >= 12.9). Its scale layouts: 1 x 128 scales [rows, Kc]
  outer-dim-major (stride 1 along rows); 128 x 128 scales [L4, blocks] with Kc padded to L4, a
  multiple of 4, and K-major in memory (pytorch#166752: an earlier torch gave wrong answers for
  other layouts, so every operand here is padded to whole 128 tiles before the call).
- "emulated": the same formula in plain torch (fp32 products of the E4M3 values, exact, one fp32
  matmul per chunk). On a CPU, where blockwise `scaled_mm` raises, this is the only path; on a
  GPU it is what the run falls back to only when allowed.

Backward (per `Fp8Matmul`): dgrad = q(dY, 1x128 along N) @ q(W)^T-blocks; wgrad = q(dY^T, 1x128
along the tokens) @ q(X^T, 1x128 along the tokens). The tokens' tiles never cross a sequence
(each sequence is padded to whole tiles), so splitting a batch over ranks or micro-batches
changes no scale: FP8 parity across data-parallel layouts rests on it. The forward input is
kept in its compute dtype (bf16) for wgrad, not in FP8 as V3 caches it.
"""

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dstrain.errors import UserError

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
TILE = 128
BACKENDS = ("scaled_mm", "emulated")
COMPUTE = torch.bfloat16  # what FP8 is quantised from, and what its GEMMs output


def blockwise_kernel_reason(device: torch.device) -> str | None:
    """Why `device` cannot run cuBLASLt's blockwise FP8 GEMM; None where it can."""
    if device.type != "cuda":
        return f"{device.type} has no FP8 GEMM"
    if not hasattr(F, "scaled_mm"):
        return f"torch {torch.__version__} has no torch.nn.functional.scaled_mm"
    major, minor = torch.cuda.get_device_capability(device)
    name = torch.cuda.get_device_name(device)
    if (major, minor) != (9, 0):
        return (
            f"{name} is compute capability {major}.{minor}; the blockwise 1x128/128x128 kernel "
            "runs on SM90 (H100/H200/H800) only"
        )
    cuda = tuple(int(p) for p in (torch.version.cuda or "0.0").split(".")[:2])
    if cuda < (12, 9):
        return f"this torch is built with CUDA {torch.version.cuda}; blockwise FP8 needs 12.9"
    return None


def choose_backend(requested: str, device: torch.device | None) -> str:
    """The FP8 backend for `train.fp8_backend = requested` on `device` (None: a dry run on
    meta, which runs the emulation's shapes). UserError where the request cannot be met."""
    if requested == "emulated" or device is None or device.type == "meta":
        return "emulated"
    reason = blockwise_kernel_reason(device)
    if reason is None:
        return "scaled_mm"
    if requested == "auto" and device.type == "cpu":
        return "emulated"
    raise UserError(
        f"train.precision = fp8 cannot run its blockwise kernel here: {reason}",
        "train in bf16 on this device, or set train.fp8_backend = emulated to run the exact "
        "plain-torch emulation (much slower than bf16)",
        exit_code=1,
    )


@dataclass(frozen=True)
class Quantized:
    """An E4M3 operand [rows, K padded to 128] and its fp32 decode scales: [rows, Kc] for 1 x 128
    tiles (`block_rows` 1), [ceil(rows / 128), Kc] for 128 x 128 blocks (`block_rows` 128)."""

    data: torch.Tensor
    scale: torch.Tensor
    block_rows: int
    rows: int  # before padding
    cols: int

    def row_scales(self) -> torch.Tensor:
        """The scale of every (row, chunk): [rows padded, Kc]."""
        if self.block_rows == 1:
            return self.scale
        return self.scale.repeat_interleave(TILE, dim=0)[: self.data.size(0)]

    def t(self) -> "Quantized":
        """The transpose of a 128 x 128-block operand: the same values and blocks."""
        assert self.block_rows == TILE
        data = _pad_to(self.data, 0, TILE).t()
        return Quantized(data.contiguous(), self.scale.t().contiguous(), TILE, self.cols, self.rows)


def _pad_to(x: torch.Tensor, dim: int, multiple: int) -> torch.Tensor:
    dim %= x.dim()
    extra = -x.size(dim) % multiple
    if extra == 0:
        return x
    pad = [0, 0] * (x.dim() - 1 - dim) + [0, extra]
    return F.pad(x, pad)


def _scales(amax: torch.Tensor) -> torch.Tensor:
    amax = amax.float()
    return torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))


def _cast(x_scaled: torch.Tensor) -> torch.Tensor:
    # Saturate: amax / (amax / 448) can round a hair above 448, which E4M3 has no finite for.
    return x_scaled.clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)


def tile_amax(x_RK: torch.Tensor) -> torch.Tensor:
    """Max-abs of every 1 x 128 tile along the last dim: [R, Kc] (fp32)."""
    x = _pad_to(x_RK, 1, TILE)
    return x.abs().view(x.size(0), x.size(1) // TILE, TILE).amax(-1).float()


def _blocks(w_NK: torch.Tensor) -> torch.Tensor:
    """[..., N, K] zero-padded into 128 x 128 blocks: [..., Nb, 128, Kc, 128]."""
    w = _pad_to(_pad_to(w_NK, -1, TILE), -2, TILE)
    return w.unflatten(-1, (-1, TILE)).unflatten(-3, (-1, TILE))


def block_amax(w_NK: torch.Tensor) -> torch.Tensor:
    """Max-abs of every 128 x 128 block of [..., N, K]: [..., Nb, Kc] (fp32)."""
    return _blocks(w_NK).abs().amax(dim=(-3, -1)).float()


def quantize_tiles(x_RK: torch.Tensor) -> Quantized:
    """E4M3 with one scale per 1 x 128 tile of each row. The data is row-major whatever
    `x_RK`'s strides (a transposed view for wgrad): cuBLASLt reads operands by their strides
    and refuses a column-major left operand (`scaled_mm`'s "self must be row_major")."""
    scale = _scales(tile_amax(x_RK))
    x = _pad_to(x_RK, 1, TILE).contiguous().float()
    x = x.view(x.size(0), x.size(1) // TILE, TILE)
    data = _cast(x / scale[..., None]).flatten(1)
    return Quantized(data, scale, 1, x_RK.size(0), x_RK.size(1))


def quantize_blocks(w_NK: torch.Tensor) -> Quantized:
    """E4M3 with one scale per 128 x 128 block, of one weight [N, K] or of a stack of them
    [E, N, K] in one pass (the routed experts'): data [..., N, K padded], scale [..., Nb, Kc]."""
    scale = _scales(block_amax(w_NK))
    N, K = w_NK.shape[-2:]
    blocks = _blocks(w_NK).float() / scale[..., :, None, :, None]
    data = _cast(blocks).flatten(-2).flatten(-3, -2)[..., :N, :]
    return Quantized(data, scale, TILE, N, K)


def dequantize(q: Quantized) -> torch.Tensor:
    """The fp32 values `q` stands for: [rows, cols]."""
    x = q.data.float().view(q.data.size(0), -1, TILE) * q.row_scales()[..., None]
    return x.view(q.data.size(0), -1)[: q.rows, : q.cols]


def blockwise_mm(a: Quantized, b: Quantized, out_dtype: torch.dtype, backend: str) -> torch.Tensor:
    """a @ b^T [a.rows, b.rows] from two quantised operands sharing K (a in 1 x 128 tiles; b in
    128 x 128 blocks or 1 x 128 tiles), by `backend` (module docstring)."""
    assert a.block_rows == 1 and a.cols == b.cols, (a.block_rows, a.cols, b.cols)
    if backend == "scaled_mm":
        return _scaled_mm(a, b, out_dtype)
    return emulated_mm(a, b).to(out_dtype)


def emulated_mm(a: Quantized, b: Quantized) -> torch.Tensor:
    """sum over K chunks c of (a_c @ b_c^T) * sa[:, c] * sb[:, c], in fp32: [a.rows, b.rows].
    The products of two E4M3 values are exact in fp32 (8 significant bits at most)."""
    sa, sb = a.row_scales()[: a.rows], b.row_scales()[: b.rows]
    qa = a.data[: a.rows].float().view(a.rows, -1, TILE)
    qb = b.data[: b.rows].float().view(b.rows, -1, TILE)
    out = torch.zeros(a.rows, b.rows, dtype=torch.float32, device=a.data.device)
    for c in range(qa.size(1)):
        out += (qa[:, c] @ qb[:, c].T) * sa[:, c, None] * sb[None, :, c]
    return out


def _scaled_mm(a: Quantized, b: Quantized, out_dtype: torch.dtype) -> torch.Tensor:
    a_data, scale_a = scaled_mm_operand(a)
    b_data, scale_b = scaled_mm_operand(b)
    recipe = F.ScalingType
    out = F.scaled_mm(
        a_data,
        b_data.t(),
        scale_a,
        recipe.BlockWise1x128,
        scale_b,
        recipe.BlockWise128x128 if b.block_rows == TILE else recipe.BlockWise1x128,
        output_dtype=out_dtype,
    )
    return out[: a.rows, : b.rows]


def scaled_mm_operand(q: Quantized) -> tuple[torch.Tensor, torch.Tensor]:
    """The E4M3 rows (padded to whole 128-row tiles) and the scales in the layout cuBLASLt's
    blockwise kernel requires (module docstring)."""
    # Row-major E4M3 rows: mat_a as it is, mat_b through `.t()` as the column-major operand
    # cuBLASLt requires (a no-op copy for what `quantize_*` made; a strided slice is copied).
    data = _pad_to(q.data, 0, TILE).contiguous()
    if q.block_rows == 1:
        scale = _pad_to(q.scale, 0, TILE)
        scale = torch.where(scale == 0, torch.ones_like(scale), scale)
        return data, scale.t().contiguous().t()  # [rows, Kc], stride 1 along rows
    scale = _pad_to(q.scale, 1, 4)  # [Nb, L4]
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    return data, scale.contiguous().t()  # [L4, Nb], K-major


def by_sequence(x_BSK: torch.Tensor) -> torch.Tensor:
    """[K, B * S padded] : the tokens of each sequence padded to whole 128-tiles, so a tile of
    the token dimension never holds two sequences."""
    B, S, K = x_BSK.shape
    x = _pad_to(x_BSK, 1, TILE)
    return x.reshape(-1, K).t()


_STATE = threading.local()


def inside_fp8_gemm() -> bool:
    """True while an FP8 GEMM's forward runs its quantisation and chunk products: the selective
    recompute policy (`parallel/activation_checkpoint.py`) keeps none of those intermediates."""
    return getattr(_STATE, "inside", False)


@contextlib.contextmanager
def fp8_gemm_region() -> Iterator[None]:
    """Marks an FP8 GEMM's forward (`inside_fp8_gemm`)."""
    _STATE.inside = True
    try:
        yield
    finally:
        _STATE.inside = False


class Fp8Matmul(torch.autograd.Function):
    """y = x @ w^T with every GEMM of forward and backward in E4M3 (module docstring).

    x [B, S, K] or [M, K] and w [N, K] in any float dtype: both are quantised from their bf16
    copies (what FSDP's bf16 all-gather hands over, so that sharded and unsharded runs quantise
    the same values); y is bf16, dx in x's dtype, dw in w's (fp32 master weights get an fp32
    gradient: wgrad accumulates in fp32)."""

    @staticmethod
    def forward(ctx, x, w, backend):
        x_c, w_c = x.to(COMPUTE), w.to(COMPUTE)
        ctx.backend, ctx.x_dtype, ctx.w_dtype = backend, x.dtype, w.dtype
        with fp8_gemm_region():
            y = blockwise_mm(
                quantize_tiles(x_c.reshape(-1, x.size(-1))), quantize_blocks(w_c), COMPUTE, backend
            )
        # The bf16 weight, not its E4M3 copy: under FSDP2 (bf16 param_dtype) it is the gathered
        # parameter itself, whose storage FSDP frees after forward and gathers again for
        # backward; a saved E4M3 copy would keep every layer's whole weight alive meanwhile.
        # Backward quantises it again (the same blocks, the same values).
        ctx.save_for_backward(x_c, w_c)
        return y.view(*x.shape[:-1], w.size(0))

    @staticmethod
    def backward(ctx, grad_y):
        x, w = ctx.saved_tensors
        grad_y = grad_y.to(COMPUTE)
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            qg = quantize_tiles(grad_y.reshape(-1, grad_y.size(-1)))
            qw_t = quantize_blocks(w).t()
            grad_x = blockwise_mm(qg, qw_t, ctx.x_dtype, ctx.backend).view(x.shape)
        if ctx.needs_input_grad[1]:
            if x.dim() == 3:
                g_NT, x_KT = by_sequence(grad_y), by_sequence(x)
            else:
                g_NT, x_KT = grad_y.t(), x.t()
            qg, qx = quantize_tiles(g_NT), quantize_tiles(x_KT)
            grad_w = blockwise_mm(qg, qx, torch.float32, ctx.backend).to(ctx.w_dtype)
        return grad_x, grad_w, None


def fp8_matmul(x: torch.Tensor, w: torch.Tensor, backend: str) -> torch.Tensor:
    """x @ w^T in FP8 (bf16 output), outside autocast: the quantisation is explicit, and
    autocast would recast the fp32 chunk products to bf16."""
    with no_autocast(x.device):
        return Fp8Matmul.apply(x, w, backend)


def no_autocast(device: torch.device) -> contextlib.AbstractContextManager:
    """Autocast off on `device`; nothing on `meta` (the CUDA-rules tests' device), which has
    no autocast."""
    if device.type == "meta":
        return contextlib.nullcontext()
    return torch.autocast(device.type, enabled=False)
