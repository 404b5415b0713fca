"""The device's peak FLOP/s, the denominator of MFU.

GPUs: the dense peak of the shared hardware table (`dstrain/hardware.py`), by device name. CPUs
have no datasheet peak that means anything for PyTorch, so the peak is measured once per machine
and precision (a large matmul, best of a few runs, with the threads training will use) and
cached under ~/.cache/dstrain. MFU on a CPU is therefore "fraction of this machine's matmul
speed", which is what tells a user whether the model or the framework is the bottleneck.
"""

import json
import os
import platform
import time
from pathlib import Path

import torch

from dstrain.hardware import gpu_from_device_name

CACHE = Path(os.environ.get("DSTRAIN_CACHE", Path.home() / ".cache" / "dstrain"))


def peak_flops(device: torch.device, precision: str) -> float:
    """FLOP/s (not TFLOP/s) for `precision` ('fp32', 'bf16', 'fp16') on `device`."""
    if device.type == "cuda":
        spec = gpu_from_device_name(torch.cuda.get_device_name(device))
        if spec is None:
            return 0.0  # unknown GPU: MFU is not reported rather than guessed
        # fp32 training runs its matmuls as TF32 on tensor cores: bf16 is the honest peak there.
        return spec.peak_tflops("bf16" if precision == "fp32" else precision) * 1e12
    return _measured_cpu_peak(precision)


def _measured_cpu_peak(precision: str) -> float:
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    key = f"{platform.node()}-{platform.processor()}-{torch.get_num_threads()}t-{precision}"
    path = CACHE / "cpu_peak.json"
    cached = json.loads(path.read_text()) if path.exists() else {}
    if key in cached:
        return cached[key]
    # fp16 matmuls are pathologically slow on most CPUs: measure a small one.
    size = 256 if dtype == torch.float16 else 1024
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    cached[key] = 2 * size**3 / best
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cached, indent=1))
    return cached[key]
