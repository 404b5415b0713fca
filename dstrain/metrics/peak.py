"""The device's peak FLOP/s, the denominator of MFU, and where it came from.

GPUs: the dense peak of the shared hardware table (`dstrain/hardware.py`) for what the matmuls
run as (TF32 for fp32 on Ampere or newer, `train/precision.py`), by device name. CPUs have no
datasheet peak that means anything for PyTorch, so the peak is measured once per machine,
precision and thread count, and cached under ~/.cache/dstrain: a 2048^2 matmul in fp32 (1024^2
in bf16, 256^2 in fp16, whose matmuls are very slow on CPUs without AVX512-BF16), best of 7 tries
(fewer once they took 3 s). A peak measured while other work ran is too
low, and makes every run's MFU too high (one machine here cached 59 GFLOP/s for 2 threads and 80
for 1, and its runs logged 57-69 % "MFU"), so a measurement is re-taken, up to 3 rounds, while it
is implausible: more threads no faster than one. Each entry is stamped with when and how it was
taken; an entry without a stamp (an older dstrain's) is measured again; `forget` drops one that a
run proved wrong (an MFU above 100 %).
"""

import datetime
import json
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from dstrain.hardware import gpu_from_device_name

CACHE = Path(os.environ.get("DSTRAIN_CACHE", Path.home() / ".cache" / "dstrain"))
STAMP = 2  # the cache entry's format: entries of another (or none) are measured again
TRIES = 7
BUDGET_S = 3.0  # per measurement: at least 2 tries, then stop once this much time went by
ROUNDS = 3
PLAUSIBLE_SPEEDUP = 1.2  # t > 1 threads at least this much faster than one


@dataclass(frozen=True)
class Peak:
    flops: float  # FLOP/s per device; 0: unknown (no MFU is reported)
    source: str  # what MFU is counted against, for the summary and the log


def peak_flops(device: torch.device, kind: str) -> Peak:
    """The peak for what the matmuls run as: `kind` in fp32, tf32, bf16, fp16."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        spec = gpu_from_device_name(name)
        if spec is None:
            return Peak(0.0, f"{name} is not in the hardware table: no MFU")
        tflops = spec.peak_tflops(kind)
        return Peak(tflops * 1e12, f"{spec.name} dense {kind} peak, {tflops:g} TFLOP/s (datasheet)")
    entry = _cpu_entry(kind)
    flops = entry["flops"]
    doubt = "" if entry["plausible"] else "; implausible after 3 rounds (a busy machine?)"
    return Peak(
        flops,
        f"this CPU's measured {kind} matmul peak, {flops / 1e9:.0f} GFLOP/s ({entry['size']}^2, "
        f"best of {entry['tries']}, {entry['threads']} threads, {entry['measured_at']}{doubt})",
    )


def forget(kind: str) -> None:
    """Drop this machine's cached CPU peak for `kind` (a run measured more than it)."""
    path = CACHE / "cpu_peak.json"
    cached = _read(path)
    if cached.pop(_key(kind), None) is not None:
        path.write_text(json.dumps(cached, indent=1))


def _key(kind: str) -> str:
    return f"{platform.node()}-{platform.processor()}-{torch.get_num_threads()}t-{kind}"


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text()) if path.exists() else {}
    except (OSError, ValueError):
        return {}


def _cpu_entry(kind: str) -> dict:
    path = CACHE / "cpu_peak.json"
    cached = _read(path)
    entry = cached.get(_key(kind))
    if isinstance(entry, dict) and entry.get("stamp") == STAMP:
        return entry
    entry = _measure(kind)
    if entry["plausible"]:  # an implausible one is used this once, and measured again next run
        cached[_key(kind)] = entry
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(cached, indent=1))
    return entry


def _measure(kind: str) -> dict:
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[kind]
    size = {torch.float32: 2048, torch.bfloat16: 1024, torch.float16: 256}[dtype]
    threads = torch.get_num_threads()
    best, one, plausible = 0.0, 0.0, True
    for _ in range(ROUNDS):
        best = max(best, _best_of(size, dtype, threads))
        if threads == 1:
            break
        one = max(one, _best_of(size, dtype, 1))
        plausible = best >= PLAUSIBLE_SPEEDUP * one
        if plausible:
            break
        time.sleep(1.0)  # let whatever else runs finish, then try again
    return {
        "stamp": STAMP,
        "flops": best,
        "one_thread_flops": one or best,
        "plausible": plausible,
        "size": size,
        "tries": TRIES,
        "threads": threads,
        "torch": torch.__version__,
        "measured_at": datetime.datetime.now().isoformat(timespec="seconds"),
    }


def _best_of(size: int, dtype: torch.dtype, threads: int) -> float:
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
        a @ b  # warm
        fastest, began = float("inf"), time.perf_counter()
        for attempt in range(TRIES):
            start = time.perf_counter()
            a @ b
            fastest = min(fastest, time.perf_counter() - start)
            if attempt >= 1 and time.perf_counter() - began > BUDGET_S:
                break
        return 2 * size**3 / fastest
    finally:
        torch.set_num_threads(saved)
