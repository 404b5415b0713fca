"""How fast the kernels a training step spends its time in really run, per GPU architecture:
fused attention by kernel, sequence length, head dim and direction (`attention_efficiency`),
and GEMMs by shape and dtype (`gemm_efficiency`). Each is a share of the dense datasheet peak
(`hardware.GPUSpec.peak_tflops`), read from published measurements; the source of every figure
is beside it. Nothing here is fitted to a training run: the planner's validation against
published runs (`planner/published.py`) is out of sample for these numbers.
"""

import math
from dataclasses import dataclass

# ---- fused attention -------------------------------------------------------------------------
# Attention FLOPs are counted as FlashAttention's benchmarks count them (Dao 2023, sec. 4.1;
# Shah et al. 2024, sec. 4.1): forward 4 s^2 d per head, halved under the causal mask; backward
# 2.5x the forward (it recomputes the scores). `planner/compute.py` counts the same, so these
# shares apply to its FLOPs directly.


@dataclass(frozen=True)
class AttentionKernel:
    """A fused attention kernel's efficiency, causal, head dim 128, at long sequences (the
    plateau); the sequence length at which it reaches half of that (short sequences leave the
    GPU's SMs idle on the causal mask's ragged tiles): eff(s) = plateau x s / (s + half); and
    its efficiency at head dim 64 against 128 (each halving of the head dim below 128 costs
    that factor again)."""

    forward: float
    backward: float
    head_dim_64: float
    half_length: float = 512.0


# FlashAttention-2 on A100 (Dao 2023, arXiv 2307.08691): "up to 73% of the theoretical max in
# the forward pass, up to 63% in the backward pass"; forward + backward, causal, head dim 64,
# at 512 / 2k / 4k / 8k tokens: 28 / 45 / 50 / 53 % of 312 TFLOP/s (Fig. 4c), which these
# plateaus reproduce within a point with 0.9 at head dim 64.
FLASH2_AMPERE = AttentionKernel(forward=0.70, backward=0.60, head_dim_64=0.9)
# FlashAttention-2 on H100 SXM (Shah et al. 2024, arXiv 2407.08608, Figs. 5-6; flash-attention
# PR #1791): causal head dim 128 forward 298 / 319 / 333 TFLOP/s at 2k / 4k / 8k (30-34 % of
# 989), backward 29-32 %; head dim 64 forward 27 / 29 / 30 %. The kernel torch's SDPA ran on
# H100 up to 2.8 (except 2.5.0).
FLASH2_HOPPER = AttentionKernel(forward=0.36, backward=0.33, head_dim_64=0.9)
# FlashAttention-3 and cuDNN 9 on H100 SXM (same figures): causal head dim 128 forward 521 /
# 579 / 602 TFLOP/s at 2k / 4k / 8k (53-61 %), 292 (30 %) at 512; backward 54 % causal at 8k
# (PR #1791), 51-57 % non-causal; head dim 64 forward 460 against 602 TFLOP/s at 8k, backward
# 472 against 559 (0.8). torch's SDPA prefers cuDNN on SM90 from 2.9 (PR #162073), as
# Transformer Engine does under NeMo and Megatron-LM.
FLASH3_HOPPER = AttentionKernel(forward=0.65, backward=0.57, head_dim_64=0.8)

# What "flash" runs on each architecture today (the newest fused kernel for it); "flash2"
# names FlashAttention-2 where a run used it on a newer GPU.
FLASH_BY_ARCH = {
    "ampere": FLASH2_AMPERE,
    "hopper": FLASH3_HOPPER,
    "blackwell": FLASH3_HOPPER,
}
FLASH2_BY_ARCH = {"hopper": FLASH2_HOPPER, "blackwell": FLASH2_HOPPER}
# Architectures with no published attention measurement here (Volta has no FlashAttention;
# Ada, CDNA): the A100 kernel's shares, for lack of better.
FALLBACK_ATTENTION = FLASH2_AMPERE


def attention_efficiency(
    arch: str, kernel: str, seq_len: float, head_dim: float, *, backward: bool
) -> float:
    """Share of the dense 16-bit peak a fused attention kernel (`kernel`: "flash" or "flash2")
    reaches on `arch` at `seq_len` tokens and `head_dim` (of the scores' q and k)."""
    table = FLASH2_BY_ARCH if kernel == "flash2" else FLASH_BY_ARCH
    found = table.get(arch) or FLASH_BY_ARCH.get(arch) or FALLBACK_ATTENTION
    plateau = found.backward if backward else found.forward
    halvings = max(0.0, math.log2(128 / head_dim))
    return plateau * found.head_dim_64**halvings * seq_len / (seq_len + found.half_length)


# ---- GEMMs ----------------------------------------------------------------------------------
# A GEMM of M x K by K x N reaches its architecture's large-shape plateau only when its output
# tiles fill every SM several times over and its K loop is long against its prologue and
# epilogue. The shape model:
#
#     eff(M, N, K) = plateau x [x / (x + 0.08)] x [K / (K + K_half)] / (the same at 8192^3),
#     x = M N / (SMs x tile elements)         (waves of output tiles, from 0 to many)
#
# with a floor of GEMM_FLOOR_S per kernel. Its shape constants are fitted to the 267 H100 bf16
# GEMMs of at least 1 GFLOP in XLA's measured matmul table (openxla/xla
# `xla/service/gpu/model/default_matmul_perf_table.txtpb` @ 336bb15c, b x m x n x k from 1 x
# 256^3 to 4 x 4096^3, median kernel time): median error 3.9 %, largest 16 %. Its floor is that
# table's 5.0 us at 256^3. NVIDIA's "Matrix Multiplication Background" guide (DU-09799-001,
# tile and wave quantization) is why the occupancy term exists; the smooth form stands for
# cuBLAS choosing among tile shapes, split-K and stream-K, which blurs the waves' steps.
GEMM_WAVE_HALF = 0.08
GEMM_FLOOR_S = 5e-6
REFERENCE_DIM = 8192  # the plateau is stated at 8192^3


@dataclass(frozen=True)
class GemmPlateau:
    """Efficiency at large shapes (a share of the dense peak of the dtype) and the K at which
    the K loop runs at half speed, for one architecture and dtype."""

    plateau: float
    k_half: float


@dataclass(frozen=True)
class GemmUnit:
    """The SMs and the output tile (elements) of one architecture's GEMM kernels."""

    sms: int
    tile: int
    bf16: GemmPlateau
    fp8: GemmPlateau | None = None


GEMMS = {
    # A100 SXM: 86.9 % (271.2 TFLOP/s) at the best shape of a brute-force search (Bekman's
    # Maximum Achievable Matmul FLOPS table, stas00/ml-engineering compute/accelerator, torch
    # 2.6); 108 SMs, 256 x 128 tiles. The H100's shape constants: an A100 cuBLAS fp16 sweep
    # (triton-lang/triton#3551) gives 33.6 % at 1024^3 and 74.7 % at 2048^3, this 42 % and 72 %.
    "ampere": GemmUnit(108, 256 * 128, GemmPlateau(0.87, 128)),
    # H100 SXM: 80.3-80.6 % at large shapes (MAMF 794.5 TFLOP/s; 797.5 at 8192^3,
    # zzc0721/torch-performance-test-data#79; XLA's table 780 at 4096^3); 132 SMs, 128 x 256
    # tiles. FP8: 70.9 % of 1979 at MAMF's best shape (73.4 % on H200), and DeepSeek's blockwise
    # recipe in DeepGEMM 68.6-76.8 % at 4096 x 7168 x 16384 on H800 (deepseek-ai/DeepGEMM
    # README, PRs #74-#86), falling to 30-42 % at K = 512: the K loop of an FP8 GEMM, twice as
    # fast per step and promoted to fp32 every 128, has K_half 800 against those rows (median
    # error 8 % at M = 4096). The measured FP8 / BF16 ratio at large shapes is then 1.8 (MAMF
    # 1.77), not the datasheet's 2.
    "hopper": GemmUnit(132, 128 * 256, GemmPlateau(0.806, 128), GemmPlateau(0.72, 800)),
    # B200: 77.6 % bf16 and 76.3 % fp8 at MAMF's best shapes; XLA's table 74 % and 73 % at
    # 4 x 4096^3. 148 SMs; Hopper's tile and K constants.
    "blackwell": GemmUnit(148, 128 * 256, GemmPlateau(0.776, 128), GemmPlateau(0.76, 800)),
    # MI300X: 51.4 % (668.4 of 1300, MAMF with PyTorch's TunableOp); 304 CUs; Hopper's tile
    # and K constants.
    "cdna3": GemmUnit(304, 128 * 256, GemmPlateau(0.51, 128)),
}
# Architectures without a measured table here (Volta, Ada, CDNA2, a CPU): a flat share, the
# planner's former single constant.
FALLBACK_GEMM = 0.75


def gemm_efficiency(arch: str, dtype: str, m: float, n: float, k: float) -> float:
    """Share of `dtype`'s dense peak (16-bit or "fp8") one M x K by K x N GEMM reaches on `arch`,
    before its per-kernel floor (`GEMM_FLOOR_S`) and its memory traffic are counted."""
    unit = GEMMS.get(arch)
    if unit is None:
        return FALLBACK_GEMM
    plateau = unit.fp8 if dtype == "fp8" and unit.fp8 else unit.bf16
    reference = _shape(unit, plateau, REFERENCE_DIM, REFERENCE_DIM, REFERENCE_DIM)
    return plateau.plateau * _shape(unit, plateau, m, n, k) / reference


def _shape(unit: GemmUnit, plateau: GemmPlateau, m: float, n: float, k: float) -> float:
    waves = m * n / (unit.sms * unit.tile)
    return waves / (waves + GEMM_WAVE_HALF) * k / (k + plateau.k_half)


# ---- inside a training step -----------------------------------------------------------------
# The kernels above were measured alone. Inside a training step they run slower: every GPU of
# the node draws its full power at once and clocks down further, kernels queue behind the host,
# and caches are shared with whatever ran before. No microbenchmark measures that, so this one
# share is learnt from the published runs (`planner/published.py`, `fit_sustained`): the value
# that minimises the planner's mean absolute log throughput error over all of them. Leaving each
# source out and fitting it on the others moves it by at most a few points (`dstrain plan
# --validate` prints that check), so it is not tuned to any one source.
SUSTAINED_SHARE = 0.803


# ---- communication's share of the SMs -------------------------------------------------------
# NCCL runs each channel of a collective as a thread block on an SM of its own, so a collective
# that overlaps compute takes those SMs away from it for as long as it runs. DeepSeek-V3's
# report (arXiv 2412.19437, sec. 3.2.1) found 20 of the H800's 132 SMs enough to saturate its
# InfiniBand and NVLink all-to-all; NCCL's rings over a node's 8 NICs run 16 channels.
COMM_SMS = 20


def comm_sm_share(arch: str) -> float:
    """The share of `arch`'s SMs an overlapped collective occupies (0 where unknown)."""
    unit = GEMMS.get(arch)
    return COMM_SMS / unit.sms if unit else 0.0
