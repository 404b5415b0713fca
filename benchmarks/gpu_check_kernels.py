"""The kernel rows of the prepared GPU check (`gpu_check.py`, step 3): each runs a GPU kernel and
an independent reference on the same inputs, forward and backward, and says "ok" only where the
kernel ran and agreed. Where the kernel cannot run here the row says "skip" and why: it is never
compared with the fallback the training would take, which is its own reference.

- cuBLASLt's blockwise FP8 `scaled_mm` (SM90, CUDA >= 12.9) against the exact emulation: alone on
  fresh operands, then through the training code itself, `fp8_matmul` and the routed experts'
  `fp8_grouped_matmul`, whose backward hands the kernel transposed operands (the wgrad).
- bf16 `grouped_mm` (the experts' kernel) against a loop of per-expert fp32 matmuls.
- FlexAttention's BlockMask (documents on CUDA) against SDPA with the boolean mask.
"""

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpu_check import Table

FP8_KERNEL, FP8_REFERENCE = "scaled_mm", "emulated"
FP8 = "cuBLASLt blockwise FP8 scaled_mm"
GROUPED = "grouped_mm (CUDA)"
FLEX = "FlexAttention"
BOTTOM_RIGHT = "SDPA causal_lower_right"
# Max |kernel - reference| over max |reference|, per output and per expert. The FP8 kernel and
# the emulation multiply the same E4M3 values; they may differ by the bf16 rounding of an output
# (y, and dx for bf16 x: at most 2^-7 of an element's own magnitude, one ulp) and the
# accumulation order (fp32; the tensor cores' limited-precision sums inside a 128-chunk, ~2^-14).
# bf16 grouped_mm rounds its outputs to bf16 (half an ulp, 2^-8) against fp32. 1e-2 bounds both
# with room; a wrong operand layout or scale (the kind of bug this guards) is off by O(1).
TOLERANCE = 1e-2
COUNTS = (0, 1, 127, 128, 129)  # rows per expert: none, one, and either side of a whole tile
MATMUL_SHAPES = [((2, 256, 512), 384), ((2, 200, 300), 130), ((1, 4096, 7168), 2048)]
GROUPED_SHAPES = [(384, 512), (2048, 7168)]  # (out, in) of each expert's weight; V3's w1 last


def kernel_row(
    table: "Table",
    check: str,
    kernel: str,
    reason: str | None,
    compare: Callable[[], tuple[float, str]],
) -> None:
    """One row: `compare()` runs `kernel` and its reference on the same inputs and returns the
    worst relative gap and what it measured. Where the kernel cannot run (`reason`), the row
    skips: a fallback compared with itself proves nothing."""
    if reason is not None:
        table.skip(check, reason, kernel)
        return
    try:
        gap, detail = compare()
    except Exception as exc:  # a kernel that does not run here is a finding, not a crash
        table.add(check, False, f"{type(exc).__name__}: {exc}"[:300], kernel)
        return
    finally:
        _free_cuda()
    table.add(check, gap <= TOLERANCE, f"{detail} (tolerance {TOLERANCE:.0e})", kernel)


def _free_cuda() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def rel_gap(got, ref) -> float:
    """max |got - ref| / max |ref| in fp32; a zero reference must be matched exactly."""
    if got.shape != ref.shape:
        raise ValueError(f"shape {tuple(got.shape)} against the reference's {tuple(ref.shape)}")
    if ref.numel() == 0:
        return 0.0
    diff = (got.float() - ref.float()).abs().max().item()
    scale = ref.float().abs().max().item()
    return diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf)


def expert_gap(got, ref, counts: list[int], by_rows: bool) -> float:
    """The worst `rel_gap` over the experts: their row blocks (`by_rows`) or their weights."""
    if by_rows:
        pairs = zip(got.split(counts), ref.split(counts), strict=True)
    else:
        pairs = zip(got, ref, strict=True)
    return max(rel_gap(a, b) for a, b in pairs)


def gaps_detail(gaps: dict[str, float]) -> tuple[float, str]:
    return max(gaps.values()), ", ".join(f"{k} {v:.1e}" for k, v in gaps.items()) + " of max-abs"


def _randn(shape, seed: int, device, dtype, cube: bool = False):
    """Reproducible normal values; `cube`d for heavy tails (tiles of very different scales)."""
    import torch

    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    return (x**3 if cube else x).to(device, dtype)


def run_backward(fn: Callable, x, w, grad_y) -> tuple:
    """fn(x, w), then its backward from `grad_y`: (y, dx, dw) of fresh leaves."""
    x, w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    y = fn(x, w)
    y.backward(grad_y)
    return y.detach(), x.grad, w.grad


@contextlib.contextmanager
def counting(name: str) -> Iterator[list[int]]:
    """Counts the calls of `torch.nn.functional.<name>` meanwhile (in a list, for the caller)."""
    import torch

    real, calls = getattr(torch.nn.functional, name), [0]

    def counted(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    setattr(torch.nn.functional, name, counted)
    try:
        yield calls
    finally:
        setattr(torch.nn.functional, name, real)


def run_on_kernel(name: str, fn: Callable, x, w, grad_y) -> tuple:
    """`run_backward` that proves the kernel ran: forward and backward must each call
    `torch.nn.functional.<name>` (the backward twice: dgrad and wgrad), else some GEMM fell
    back to another path, which might be the very reference it is compared with."""
    x, w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    with counting(name) as forward:
        y = fn(x, w)
    with counting(name) as backward:
        y.backward(grad_y)
    if forward[0] < 1 or backward[0] < 2:
        raise RuntimeError(
            f"{name} ran {forward[0]} time(s) in forward and {backward[0]} in backward "
            "(want 1 and 2 at least): the kernel path fell back to another"
        )
    return y.detach(), x.grad, w.grad


def compare_fp8_matmul(device, x_shape: tuple[int, ...], n: int) -> tuple[float, str]:
    """`fp8_matmul` forward and backward on the kernel against the emulation: the training's
    own code path, whose wgrad hands the GEMM transposed (by-sequence) operands."""
    import torch

    from dstrain.model import fp8

    x = _randn(x_shape, 0, device, torch.bfloat16, cube=True)
    w = _randn((n, x_shape[-1]), 1, device, torch.float32) * 0.02  # fp32 master weights
    grad_y = _randn((*x_shape[:-1], n), 2, device, torch.bfloat16)
    got = run_on_kernel("scaled_mm", lambda a, b: fp8.fp8_matmul(a, b, FP8_KERNEL), x, w, grad_y)
    ref = run_backward(lambda a, b: fp8.fp8_matmul(a, b, FP8_REFERENCE), x, w, grad_y)
    names = ("y", "dx", "dw")
    return gaps_detail({k: rel_gap(a, b) for k, a, b in zip(names, got, ref, strict=True)})


def compare_fp8_grouped(device, out_dim: int, in_dim: int) -> tuple[float, str]:
    """The routed experts' `fp8_grouped_matmul` forward and backward on the kernel against the
    emulation, with expert row counts `COUNTS`, expert by expert."""
    import torch

    from dstrain.model import moe

    counts = list(COUNTS)
    counts_E = torch.tensor(counts, device=device)
    x = _randn((sum(counts), in_dim), 3, device, torch.bfloat16, cube=True)
    w = _randn((len(counts), out_dim, in_dim), 4, device, torch.float32) * 0.02
    grad_y = _randn((sum(counts), out_dim), 5, device, torch.bfloat16)

    def experts(backend: str) -> Callable:
        return lambda a, b: moe.fp8_grouped_matmul(a, b, counts_E, backend)

    got = run_on_kernel("scaled_mm", experts(FP8_KERNEL), x, w, grad_y)
    ref = run_backward(experts(FP8_REFERENCE), x, w, grad_y)
    return gaps_detail(
        {
            "y": expert_gap(got[0], ref[0], counts, by_rows=True),
            "dx": expert_gap(got[1], ref[1], counts, by_rows=True),
            "dw": expert_gap(got[2], ref[2], counts, by_rows=False),
        }
    )


def compare_grouped_mm(device, out_dim: int, in_dim: int) -> tuple[float, str]:
    """bf16 `torch.nn.functional.grouped_mm`, called as `moe._grouped_matmul` calls it, forward
    and backward, against a loop of per-expert fp32 matmuls on the same bf16 values."""
    import torch

    counts = list(COUNTS)
    offsets = torch.cumsum(torch.tensor(counts, device=device), 0, dtype=torch.int32)
    x = _randn((sum(counts), in_dim), 6, device, torch.bfloat16)
    w = _randn((len(counts), out_dim, in_dim), 7, device, torch.bfloat16) * 0.02
    grad_y = _randn((sum(counts), out_dim), 8, device, torch.bfloat16)

    def grouped(x_TI, w_EOI):
        return torch.nn.functional.grouped_mm(x_TI, w_EOI.transpose(-2, -1), offs=offsets)

    def loop(x_TI, w_EOI):
        chunks = x_TI.split(counts)
        return torch.cat([c @ w_OI.T for c, w_OI in zip(chunks, w_EOI, strict=True)])

    got = run_backward(grouped, x, w, grad_y)  # the kernel itself, called directly
    ref = run_backward(loop, x.float(), w.float(), grad_y.float())
    return gaps_detail(
        {
            "y": expert_gap(got[0], ref[0], counts, by_rows=True),
            "dx": expert_gap(got[1], ref[1], counts, by_rows=True),
            "dw": expert_gap(got[2], ref[2], counts, by_rows=False),
        }
    )


def compare_fp8_fresh(device) -> tuple[float, str]:
    """`blockwise_mm` alone on freshly quantised contiguous operands, fp32 out: both right
    operand kinds (128 x 128 blocks, 1 x 128 tiles), shapes 128 does and does not divide."""
    import torch

    from dstrain.model import fp8

    gaps = {}
    for M, N, K in [(256, 768, 512), (200, 300, 130), (4096, 2048, 7168)]:
        x = _randn((M, K), 9, device, torch.float32, cube=True)
        w = _randn((N, K), 10, device, torch.float32) * 0.02
        qx = fp8.quantize_tiles(x)
        for kind, q in (("blocks", fp8.quantize_blocks(w)), ("tiles", fp8.quantize_tiles(w))):
            got = fp8.blockwise_mm(qx, q, torch.float32, FP8_KERNEL)
            gaps[f"{M}x{N}x{K} {kind}"] = rel_gap(got, fp8.emulated_mm(qx, q))
    return gaps_detail(gaps)


def grouped_mm_reason(device) -> str | None:
    """Why `device` cannot run grouped_mm's CUDA kernel; None where it can."""
    import torch

    if device.type != "cuda":
        return f"{device.type}: grouped_mm's CUDA kernel needs a CUDA device"
    if not hasattr(torch.nn.functional, "grouped_mm"):
        return f"torch {torch.__version__} has no torch.nn.functional.grouped_mm"
    return None


def flex_reason(device) -> str | None:
    """Why `device` cannot run FlexAttention (where documents fall back to SDPA)."""
    from dstrain.model import documents

    if device.type != "cuda":
        return f"{device.type}: FlexAttention's BlockMask runs on CUDA only (here both are SDPA)"
    if documents._flex() is None:
        return "this torch has no torch.nn.attention.flex_attention"
    return None


def check_kernels(table: "Table", device) -> None:
    """Every kernel row (module docstring), in the order the table shows them."""
    from dstrain.model import fp8

    fp8_reason = fp8.blockwise_kernel_reason(device)
    vs = f"{FP8_KERNEL} vs {FP8_REFERENCE}"
    kernel_row(
        table,
        f"fp8 blockwise_mm (fresh operands, 3 shapes): {vs}",
        FP8,
        fp8_reason,
        lambda: compare_fp8_fresh(device),
    )
    for x_shape, n in MATMUL_SHAPES:
        kernel_row(
            table,
            f"fp8_matmul fwd+bwd [{','.join(map(str, x_shape))}]x[{n},{x_shape[-1]}]: {vs}",
            FP8,
            fp8_reason,
            lambda x_shape=x_shape, n=n: compare_fp8_matmul(device, x_shape, n),
        )
    counts = ",".join(map(str, COUNTS))
    for out_dim, in_dim in GROUPED_SHAPES:
        experts = f"counts [{counts}] x [{len(COUNTS)},{out_dim},{in_dim}]"
        kernel_row(
            table,
            f"fp8_grouped_matmul fwd+bwd {experts}: {vs}",
            FP8,
            fp8_reason,
            lambda o=out_dim, i=in_dim: compare_fp8_grouped(device, o, i),
        )
        kernel_row(
            table,
            f"grouped_mm bf16 fwd+bwd {experts}: kernel vs fp32 loop",
            GROUPED,
            grouped_mm_reason(device),
            lambda o=out_dim, i=in_dim: compare_grouped_mm(device, o, i),
        )
    kernel_row(
        table,
        "document mask: FlexAttention BlockMask vs SDPA bool mask",
        FLEX,
        flex_reason(device),
        lambda: compare_document_mask(device),
    )
    kernel_row(
        table,
        "cp chunked attention: bottom-right causal bias vs explicit mask",
        BOTTOM_RIGHT,
        None if device.type == "cuda" else f"{device.type}: the bias is used on CUDA only",
        lambda: compare_bottom_right(device),
    )
    if fp8_reason is None:
        try:
            table.info("fp8 GEMM speed", _fp8_speed(device))
        except Exception as exc:
            table.add("fp8 GEMM speed", False, f"{type(exc).__name__}: {exc}"[:300], FP8)


def compare_document_mask(device) -> tuple[float, str]:
    """FlexAttention's BlockMask (the CUDA path of data.document_mask) against SDPA with the
    boolean mask (the CPU path, which the CPU tests prove right) on one model and batch: logits
    and gradients."""
    import torch

    from dstrain.config.flavors import flavor_args
    from dstrain.model import documents
    from dstrain.model.transformer import build_model

    model = build_model(flavor_args("debug"), device, seed=0)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model.args.vocab_size, (2, 256), generator=g).to(device)
    ids = torch.sort(torch.randint(0, 6, (2, 256), generator=g), dim=1).values.to(device)

    def run(flex: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        saved = list(documents._COMPILED_FLEX)
        if not flex:
            documents._COMPILED_FLEX[:] = [None]  # the SDPA path with a boolean mask
        try:
            model.zero_grad()
            logits = model(tokens, documents=ids)[0]
            logits.float().square().mean().backward()
        finally:
            documents._COMPILED_FLEX[:] = saved
        return logits.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    (a, ga), (b, gb) = run(True), run(False)
    grads = max(rel_gap(x, y) for x, y in zip(ga, gb, strict=True))
    return gaps_detail({"logits": rel_gap(a, b), "grads": grads})


def compare_bottom_right(device) -> tuple[float, str]:
    """Context parallelism's attention of one rank's two chunks (cp 4, rank 1: queries of
    chunks 1 and 6 against the keys up to each one's end) in bf16 at V3's head dims: on CUDA
    torch's `causal_lower_right` bias, which the fused kernels apply themselves, against the
    same chunks under the explicit [L, end] boolean mask (the CPU's path, proven against one
    process by the CPU tests): outputs and the gradients of q, k and v."""
    import torch

    from dstrain.model import attention
    from dstrain.parallel.context_parallel import ContextShard

    shard = ContextShard(None, 4, 1)
    local, whole, heads, qk, v_dim = 1024, 4096, 16, 192, 128
    g = torch.Generator().manual_seed(0)

    def tensor(*shape: int) -> torch.Tensor:
        x = torch.randn(*shape, generator=g).to(device, torch.bfloat16)
        return x.requires_grad_()

    q = tensor(2, local, heads, qk)
    k, v = tensor(2, whole, heads, qk), tensor(2, whole, heads, v_dim)

    def run(explicit: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        original = attention._bottom_right
        if explicit:
            attention._bottom_right = lambda q, end, c: c.chunk_mask(q.size(1), end, q.device)
        try:
            out = attention._attention(q, k, v, qk**-0.5, None, shard)
            grads = torch.autograd.grad(out.float().square().mean(), (q, k, v))
        finally:
            attention._bottom_right = original
        return out.detach(), list(grads)

    (a, ga), (b, gb) = run(False), run(True)
    grads = max(rel_gap(x, y) for x, y in zip(ga, gb, strict=True))
    return gaps_detail({"out": rel_gap(a, b), "grads": grads})


def _fp8_speed(device) -> str:
    import torch

    from dstrain.model import fp8

    x = torch.randn(8192, 7168, device=device, dtype=torch.bfloat16)
    w = torch.randn(2048, 7168, device=device, dtype=torch.bfloat16)
    qx, qw = fp8.quantize_tiles(x), fp8.quantize_blocks(w)

    def best(fn) -> float:
        fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(10):
            start = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        return min(times)

    gemm = best(lambda: fp8.blockwise_mm(qx, qw, torch.bfloat16, FP8_KERNEL))
    bf16 = best(lambda: x @ w.T)
    whole = best(lambda: fp8.fp8_matmul(x, w, FP8_KERNEL))
    return (
        f"8192x2048x7168: GEMM {bf16 / gemm:.2f}x bf16's speed; with quantisation "
        f"{bf16 / whole:.2f}x"
    )
