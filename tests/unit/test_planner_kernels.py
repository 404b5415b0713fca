"""The kernel tables of dstrain.planner.kernels against the published measurements they come
from (each test names its source, as the module does)."""

import pytest

from dstrain.planner.kernels import (
    COMM_SMS,
    GEMM_FLOOR_S,
    attention_efficiency,
    comm_sm_share,
    gemm_efficiency,
)

H100_PEAK = 989e12


def _h100_tflops(m: int, n: int, k: int) -> float:
    """What the model gives for one H100 bf16 GEMM, floor included, as XLA's table times it."""
    flops = 2 * m * n * k
    seconds = GEMM_FLOOR_S + flops / (H100_PEAK * gemm_efficiency("hopper", "bf16", m, n, k))
    return flops / seconds / 1e12


@pytest.mark.parametrize(
    ("shape", "measured", "within"),
    [
        # openxla/xla default_matmul_perf_table.txtpb @ 336bb15c, sm_90, bf16 (TFLOP/s)
        ((4096, 4096, 4096), 780.2, 0.06),
        ((2048, 2048, 2048), 641.0, 0.10),
        ((1024, 1024, 1024), 252.8, 0.12),
        ((4096, 4096, 256), 398.6, 0.12),  # a short K costs the most
        ((4096, 1024, 4096), 751.7, 0.15),  # among the worst: the model's largest error is 16 %
        ((4096, 1024, 1024), 497.6, 0.12),
        # zzc0721/torch-performance-test-data#79, H100 80GB HBM3
        ((8192, 8192, 8192), 797.5, 0.02),
    ],
)
def test_h100_gemms_follow_the_measured_table(shape, measured, within):
    assert _h100_tflops(*shape) == pytest.approx(measured, rel=within)


def test_plateaus_are_the_published_large_shape_shares():
    big = (8192, 8192, 8192)
    assert gemm_efficiency("hopper", "bf16", *big) == pytest.approx(0.806)  # MAMF / 8192^3
    assert gemm_efficiency("ampere", "bf16", *big) == pytest.approx(0.87)  # MAMF's A100 SXM
    # FP8 on H100: 70.9 % of 1979 at MAMF's best shape; 1.8x bf16's speed, not 2x
    fp8 = gemm_efficiency("hopper", "fp8", *big) * 1979
    assert 1.7 < fp8 / (gemm_efficiency("hopper", "bf16", *big) * 989) < 1.9
    # DeepGEMM on H800: K = 512 runs at well under half the speed of K = 7168 (590 vs 1304)
    short = gemm_efficiency("hopper", "fp8", 4096, 32768, 512)
    long = gemm_efficiency("hopper", "fp8", 4096, 4096, 7168)
    assert short / long == pytest.approx(590 / 1304, rel=0.2)
    assert gemm_efficiency("volta", "bf16", *big) == 0.75  # no table: the flat fallback


def test_attention_follows_flashattention_measurements():
    # FA3 on H100, causal head dim 128 forward: 292 / 521 / 602 TFLOP/s at 512 / 2k / 8k
    for seq, measured in ((512, 292), (2048, 521), (8192, 602)):
        got = attention_efficiency("hopper", "flash", seq, 128, backward=False) * 989
        assert got == pytest.approx(measured, rel=0.12)
    # FA2 on A100, forward + backward, causal, head dim 64: 28 / 45 / 53 % at 512 / 2k / 8k
    for seq, measured in ((512, 0.28), (2048, 0.45), (8192, 0.53)):
        forward = attention_efficiency("ampere", "flash", seq, 64, backward=False)
        backward = attention_efficiency("ampere", "flash", seq, 64, backward=True)
        assert 3.5 / (1 / forward + 2.5 / backward) == pytest.approx(measured, rel=0.05)
    # FlashAttention-2 on H100 reaches about half of FA3's speed (30-34 % of the peak)
    fa2 = attention_efficiency("hopper", "flash2", 8192, 128, backward=False)
    assert 0.30 < fa2 < 0.36


def test_an_overlapped_collective_takes_deepseeks_20_sms():
    assert comm_sm_share("hopper") == pytest.approx(COMM_SMS / 132)
    assert comm_sm_share("cpu") == 0.0
