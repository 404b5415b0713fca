"""The timed loop: warm-up calls, a barrier, then back-to-back calls with nothing else in the loop.

Every rank times itself. On CPU the clock is `perf_counter` around the loop (gloo calls block
until done); on CUDA two events on the current stream around the loop (the collectives run on
NCCL's stream, which the current stream waits on), read after one synchronize.
"""

import time
from collections.abc import Callable

import torch
import torch.distributed as dist

WARMUP, ITERS = 5, 20  # nccl-tests' defaults (-w 5 -n 20)
# On CPU a big size gets fewer calls, so that its timed calls move at most this much per rank
# (its warm-up a quarter of it) and the default sweep (1K:64M, six ops) stays around 10-20 s on a
# laptop: 64M gets 2 timed calls and 1 warm-up, 8M 16 and 4, 4M and below 20 and 5.
CPU_BYTES_PER_SIZE = 128 * 1024**2


def iterations(
    requested: int | None, default: int, size: int, device_type: str, budget: int
) -> int:
    """`requested` as given; None: `default`, cut on CPU to `budget` bytes (at least 1 call)."""
    if requested is not None:
        return requested
    if device_type == "cuda":
        return default
    return max(1, min(default, budget // max(size, 1)))


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # host-device sync


def measure(call: Callable[[], object], *, warmup: int, iters: int, device: torch.device) -> float:
    """Seconds per call on this rank. The barrier (on the whole world) makes every rank, and every
    group of an axis, start the timed block together, as the trainer's groups run at once."""
    for _ in range(warmup):
        call()
    synchronize(device)
    dist.barrier()
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            call()
        end.record()
        end.synchronize()  # host-device sync, after the timed block
        return start.elapsed_time(end) / 1e3 / iters
    started = time.perf_counter()
    for _ in range(iters):
        call()
    return (time.perf_counter() - started) / iters
