"""Joining the process group that torchrun set up, and leaving it without the exit-time abort.

torchrun (or `dstrain train --nproc N`, which runs torchrun's elastic agent) exports RANK,
WORLD_SIZE, LOCAL_RANK and MASTER_ADDR/PORT; without them this is a one-process run and no
process group is created at all.
"""

import os
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from dstrain.config.schema import CommConfig
from dstrain.errors import UserError


@dataclass(frozen=True)
class World:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str | None  # None: one process, no process group

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(comm: CommConfig) -> World:
    """Read torchrun's environment, pick the device and backend, and init the default group."""
    world_size, rank, local_rank = (
        env_int("WORLD_SIZE", 1),
        env_int("RANK", 0),
        env_int("LOCAL_RANK", 0),
    )
    backend = _backend(comm.backend)
    device = _device(backend, local_rank)
    if world_size == 1 and "MASTER_ADDR" not in os.environ:
        return World(0, 1, 0, device, None)
    if not dist.is_initialized():
        dist.init_process_group(
            backend=backend,
            timeout=timedelta(seconds=comm.timeout_s),
            device_id=device if device.type == "cuda" else None,
        )
    return World(rank, world_size, local_rank, device, backend)


def shutdown(exit_code: int = 0) -> None:
    """Leave the process group and exit. os._exit skips interpreter teardown, during which a gloo
    worker thread can free Python-owned tensors and abort the process ("terminate called without
    an active exception", ~2% of runs; TORCH-CPU-NOTES)."""
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)


def _backend(choice: str) -> str:
    if choice == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if choice == "nccl" and not torch.cuda.is_available():
        raise UserError(
            "comm.backend = nccl needs CUDA GPUs, and none is visible",
            "use comm.backend = auto (gloo on CPU hosts)",
            exit_code=1,
        )
    return choice


def _device(backend: str, local_rank: int) -> torch.device:
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def env_int(name: str, default: int) -> int:
    """An integer environment variable (torchrun's RANK, WORLD_SIZE...), or a UserError."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise UserError(
            f"environment variable {name}={raw!r} is not a whole number",
            f"launch through torchrun or `dstrain train --nproc N`, or fix {name}",
            exit_code=2,
        ) from None
