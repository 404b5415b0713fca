"""Each rank's matmul throughput, all ranks at once (as in training, where they share the host's
cores, power and memory bandwidth), so a slow or throttled device stands out.

GPUs: bf16 8192^3, reported against the datasheet peak of the shared hardware table (via
`dstrain.metrics.peak`). CPUs: fp32 1024^3; bf16 is fast only with AVX512-BF16/AMX and
pathologically slow elsewhere (TORCH-CPU-NOTES), so fp32 is the portable yardstick, and a CPU has
no datasheet peak worth quoting.
"""

import time

import torch
import torch.distributed as dist

from dstrain.bench.timing import synchronize
from dstrain.metrics.peak import peak_flops

SETTINGS = {  # device type: (dtype, precision name, matrix size, timed calls)
    "cuda": (torch.bfloat16, "bf16", 8192, 20),
    "cpu": (torch.float32, "fp32", 1024, 8),
}


def gemm_tflops(device: torch.device) -> float:
    """This rank's TFLOP/s for one square matmul, timed after a world barrier."""
    dtype, _, size, iters = SETTINGS.get(device.type, SETTINGS["cpu"])
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    c = torch.empty(size, size, device=device, dtype=dtype)
    torch.mm(a, b, out=c)  # warm-up: kernel selection, thread pool
    synchronize(device)
    dist.barrier()
    started = time.perf_counter()
    for _ in range(iters):
        torch.mm(a, b, out=c)
    synchronize(device)
    return 2 * size**3 * iters / (time.perf_counter() - started) / 1e12


def gemm_settings(device: torch.device) -> dict[str, object]:
    """What the GEMM check ran, and the device's datasheet peak (GPUs in the table only)."""
    _, precision, size, iters = SETTINGS.get(device.type, SETTINGS["cpu"])
    peak = peak_flops(device, precision).flops / 1e12 if device.type == "cuda" else None
    return {"dtype": precision, "size": size, "iters": iters, "peak_tflops": peak or None}
