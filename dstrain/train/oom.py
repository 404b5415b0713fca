"""A training step that runs out of memory ends with advice, not a traceback: what the rank
measured, part by part as the dry run counts it, the planner's estimate of the same layout beside
it, and the nearest layouts that fit as `--set` flags (`planner/advice.py`); then the run exits
with its own code, `errors.OUT_OF_MEMORY` (3).

What counts as out of memory (`is_out_of_memory`): `torch.OutOfMemoryError` (a device
allocation, or the `oom` fault of `faults.py`), Python's `MemoryError`, and the RuntimeError of
torch's CPU allocator ("DefaultCPUAllocator: can't allocate memory", "not enough memory").

What is measured, on the rank that failed. Weights, gradients and optimizer state are counted
from its runtime by the dry run's own code (`parallel/state_bytes.py`). The rest is read off the
memory that ran out:
  - a GPU: activations = the allocator's peak (`max_memory_allocated`) less the model states;
    other = what the device has in use less both (the allocator's cache and fragmentation, the
    CUDA context, NCCL); the capacity is the device's;
  - the host: activations = what the process let go once the failed step's frames were dropped
    (resident memory before and after, with glibc's free memory handed back); other = the rest
    of what the limit counts: the address space under RLIMIT_AS, else resident memory (Python,
    libraries, data, the allocator). The capacity is RLIMIT_AS, else the cgroup's memory.max or
    the machine's memory, shared by the node's local ranks.
The allocation that failed comes from the allocator's message where it says.

The planner sees the rank's device as the hardware table has it (CPU: the measured matmul peak),
with the measured capacity; the search keeps the world size (`planner/nearest.py`).

Checkpoints: a synchronous save is never under way during a step, and publishing is atomic, so
the newest checkpoint stays valid. An async save in flight is finished on this rank alone (no
collective: the others may be blocked in one this rank will never join): rank 0 publishes it once
every rank's shards are written (a rank 0 that did not run out does the same once its own
collective fails: `Trainer._guarded_step`); what is not done within comm.timeout_s stays
unpublished (`.step-N.tmp`), as a failed save does (`checkpoint/store.py`).

Several ranks: the ranks that run out claim the run's record (`oom.json` in the run directory)
with an exclusive create; the first prints the advice, the others one line. The ranks that did
not run out find their next collective failing once this rank's process is gone (gloo: the
connection closed; NCCL: its watchdog), or torchrun's agent stops them (SIGTERM, whose watchdog
ends a rank stuck in a collective: `preemption.py`); `dstrain train --nproc` exits 3 too.
"""

import contextlib
import ctypes
import gc
import json
import os
import re
import resource
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from dstrain.errors import OUT_OF_MEMORY, UserError
from dstrain.hardware import GPUSpec, gpu_from_device_name, gpu_spec, network_gbps
from dstrain.parallel.state_bytes import state_bytes
from dstrain.planner.advice import Measured, MemoryAdvice, advise
from dstrain.planner.calibrate import CPU_LOOPBACK_GBPS, cpu_device
from dstrain.planner.layout import Cluster, layout_from_config

if TYPE_CHECKING:
    from dstrain.train.trainer import Trainer

HOST_SIGNS = ("DefaultCPUAllocator: can't allocate memory", "not enough memory")
RECORD = "oom.json"
_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


class OutOfMemory(UserError):
    """The advice, as the one message the CLI prints, with exit code 3."""

    def __init__(self, message: str, fix: str) -> None:
        super().__init__(message, fix, exit_code=OUT_OF_MEMORY)


def is_out_of_memory(exc: BaseException) -> bool:
    if isinstance(exc, torch.OutOfMemoryError | MemoryError):
        return True
    return isinstance(exc, RuntimeError) and any(sign in str(exc) for sign in HOST_SIGNS)


def out_of_memory(trainer: "Trainer", exc: BaseException) -> OutOfMemory:
    """What to raise in place of `exc`, which step `trainer.step + 1` raised on this rank.
    Drops `exc`'s traceback (the failed step's tensors) to measure what the step held."""
    trainer.heartbeat.beat(trainer.step, "out of memory")
    measured = measure(trainer, exc)
    trainer.checkpoints.writer.finish_alone(trainer.config.comm.timeout_s)
    head = (
        f"rank {measured.rank} ran out of {measured.where} in step {measured.step} "
        f"({measured.error})"
    )
    try:
        advice = _advice(trainer, measured)
    except Exception as err:  # the advice must not bury the out-of-memory under its own error
        return OutOfMemory(f"{head}; no advice: {type(err).__name__}: {err}", "")
    if not claim_record(trainer.run_dir, advice):
        return OutOfMemory(
            f"{head}; the advice is printed once, by the first rank that ran out (and in "
            f"{trainer.run_dir / RECORD})",
            "",
        )
    return OutOfMemory(
        "\n".join([head, *advice.lines()]),
        f"rerun with one line's flags (the run resumes from its newest checkpoint); "
        f"{trainer.run_dir / RECORD} holds this advice as JSON",
    )


def _advice(trainer: "Trainer", measured: Measured) -> MemoryAdvice:
    cluster = device_cluster(trainer, measured.capacity)
    layout = layout_from_config(trainer.config, trainer.world.world_size)
    return advise(trainer.model_args, cluster, trainer.config, layout, measured)


# ---- measuring -------------------------------------------------------------------------------


def measure(trainer: "Trainer", exc: BaseException) -> Measured:
    """The failing rank's memory, by part (module docstring)."""
    states = state_bytes(trainer.model, trainer.config, trainer.dims.pp)
    weights, gradients, optimizer = (
        sum(part.values()) for part in (states.params, states.grads, states.optimizer)
    )
    held = weights + gradients + optimizer
    device = trainer.world.device
    if device.type == "cuda":
        free, capacity = torch.cuda.mem_get_info(device)
        activations = max(0.0, torch.cuda.max_memory_allocated(device) - held)
        other = max(0.0, capacity - free - held - activations)
        where = f"device memory ({device})"
    else:
        capacity, where, address_space = _host_limit()
        failing = _status_bytes("VmSize" if address_space else "VmRSS")
        before = _status_bytes("VmRSS")
        _let_go(exc)
        activations = max(0.0, before - _status_bytes("VmRSS"))
        other = max(0.0, failing - held - activations)
    first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[-1]
    return Measured(
        rank=trainer.world.rank,
        step=trainer.step + 1,
        where=where,
        error=first_line,
        weights=weights,
        gradients=gradients,
        optimizer=optimizer,
        activations=activations,
        other=other,
        capacity=float(capacity),
        requested=requested_bytes(str(exc)),
    )


def requested_bytes(message: str) -> float | None:
    """The failed allocation's size, from torch's CUDA ("Tried to allocate 2.00 GiB") or CPU
    ("you tried to allocate 1048576 bytes") message; None when it does not say."""
    cuda = re.search(r"Tried to allocate ([\d.]+) ?(B|KiB|MiB|GiB|TiB)", message)
    if cuda:
        return float(cuda.group(1)) * _UNITS[cuda.group(2)]
    cpu = re.search(r"allocate (\d+) bytes", message)
    return float(cpu.group(1)) if cpu else None


def _host_limit() -> tuple[float, str, bool]:
    """(bytes this rank may hold, what limits it, whether the limit counts address space)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        return float(soft), "host memory (RLIMIT_AS, address space)", True
    ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    shared = f", shared by {ranks} local ranks" if ranks > 1 else ""
    cgroup = _read(Path("/sys/fs/cgroup/memory.max"))
    if cgroup.isdigit():
        return int(cgroup) / ranks, f"host memory (cgroup memory.max{shared})", False
    total = _status_bytes("MemTotal", "/proc/meminfo")
    return total / ranks, f"host memory (the machine's{shared})", False


def _status_bytes(key: str, path: str = "/proc/self/status") -> float:
    """A `kB` figure of /proc/self/status (or /proc/meminfo) in bytes; 0 where unreadable."""
    for line in _read(Path(path)).splitlines():
        name, _, value = line.partition(":")
        if name == key and value.split():
            return float(value.split()[0]) * 1024
    return 0.0


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def _let_go(exc: BaseException) -> None:
    """Free the failed step's tensors: its frames hang off the traceback. glibc keeps freed heap
    memory for reuse; malloc_trim hands it back, so the resident size shows what was freed."""
    exc.__traceback__ = None
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


# ---- the planner's view of this rank's device ------------------------------------------------


def device_cluster(trainer: "Trainer", capacity: float) -> Cluster:
    """The run's GPUs (CPU: this host, at its measured matmul peak) with the measured capacity,
    at the run's world size and ranks per node."""
    world, c = trainer.world.world_size, trainer.config.cluster
    spec = _device_spec(trainer)
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", str(min(world, c.gpus_per_node))))
    if spec.arch == "cpu":
        return Cluster(replace(spec, hbm_gb=capacity / 1e9), world, world, CPU_LOOPBACK_GBPS)
    gbps = c.inter_node_gbps or network_gbps(c.network)
    return Cluster(replace(spec, hbm_gb=capacity / 1e9), world, max(1, per_node), gbps)


def _device_spec(trainer: "Trainer") -> GPUSpec:
    device = trainer.world.device
    if device.type == "cuda":
        named = gpu_from_device_name(torch.cuda.get_device_name(device))
        configured = trainer.config.cluster.gpu
        return named or (gpu_spec(configured) if configured else gpu_spec("H100"))
    peak = trainer.peak.flops / 1e12 or 0.1
    return cpu_device(peak, 0.0)


# ---- one rank speaks -------------------------------------------------------------------------


def claim_record(run_dir: Path, advice: MemoryAdvice) -> bool:
    """True for the first rank of this launch to run out: it writes the record. One process
    (no torchrun) always speaks; under torchrun the record is keyed by the launch and attempt."""
    launch = os.environ.get("TORCHELASTIC_RUN_ID")
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    record = run_dir / RECORD
    if launch is not None:
        claim = run_dir / f".oom-{launch}-{attempt}"
        try:
            os.close(os.open(claim, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        except FileExistsError:
            return False
        except OSError:
            pass  # an unwritable run directory: speak anyway
    data = advice.to_json() | {"exit_code": OUT_OF_MEMORY}
    with contextlib.suppress(OSError):
        run_dir.mkdir(parents=True, exist_ok=True)
        tmp = record.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=2) + "\n")
        tmp.replace(record)
    return True
