"""Host limits a training job trips over: /dev/shm, open files, free disk, data read speed."""

import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from dstrain.doctor.findings import Check, fail, ok, warn

SECTION = "system"
GIB = 1024**3
MIB = 1024**2
# Docker's default /dev/shm is 64 MiB; DataLoader workers pass every batch through it, and NCCL's
# SHM transport needs a few MiB per peer pair, so 1 GiB is the floor, plus ~256 MiB per worker.
SHM_FLOOR = 1 * GIB
SHM_PER_WORKER = 256 * MIB
# Each DataLoader worker, NCCL socket and checkpoint shard holds descriptors; 1024 (the common
# soft default) runs out at scale. 65536 is what NVIDIA's and most cluster images set.
NOFILE_FLOOR = 65536
DISK_WARN = 100 * GIB  # one DeepSeek-V3 checkpoint with optimizer state is several TB in total
DISK_FAIL = 1 * GIB
READ_WARN_MBPS = 200.0
WRITE_BUDGET_S = 1.5  # writing the test file stops after this, so a slow filesystem stays quick


def shm_check(path: Path = Path("/dev/shm"), num_workers: int = 0) -> Check:
    """Size of the shared-memory mount against what DataLoader workers and NCCL need."""
    try:
        stats = os.statvfs(path)
    except OSError:
        return warn(SECTION, "/dev/shm", f"{path} is missing", "mount a tmpfs at /dev/shm")
    size = stats.f_frsize * stats.f_blocks
    need = max(SHM_FLOOR, num_workers * SHM_PER_WORKER)
    detail = f"{path} is {_gib(size)} ({_gib(stats.f_frsize * stats.f_bavail)} free)"
    if size >= need:
        return ok(SECTION, "/dev/shm", detail)
    return warn(
        SECTION,
        "/dev/shm",
        f"{detail}; want >= {_gib(need)}"
        + (" (Docker's 64 MiB default)" if size <= 64 * MIB else "")
        + ": DataLoader workers fail with `bus error`/`No space left on device`",
        "docker run --shm-size=16g (or --ipc=host); Kubernetes: mount an emptyDir with "
        "medium: Memory at /dev/shm",
    )


def nofile_check(limits: tuple[int, int] | None = None) -> Check:
    """The soft RLIMIT_NOFILE (what a process gets) and the hard one (how far it can raise)."""
    if limits is None:
        import resource

        limits = resource.getrlimit(resource.RLIMIT_NOFILE)
    soft, hard = limits
    detail = f"soft {_limit(soft)}, hard {_limit(hard)}"
    if soft == -1 or soft >= NOFILE_FLOOR:
        return ok(SECTION, "open files", detail)
    return warn(
        SECTION,
        "open files",
        f"{detail}; want >= {NOFILE_FLOOR}: DataLoader workers and many ranks hit "
        "`Too many open files`",
        f"ulimit -n {NOFILE_FLOOR}"
        + ("" if hard == -1 or hard >= NOFILE_FLOOR else " (raise the hard limit first: "
           "/etc/security/limits.conf, systemd LimitNOFILE=, docker --ulimit nofile=)"),
    )  # fmt: skip


def disk_check(path: Path) -> Check:
    """Free space where runs and data live."""
    try:
        usage = shutil.disk_usage(path)
    except OSError as exc:
        return fail(
            SECTION, "disk", f"cannot read {path}: {exc.strerror}", "create it or fix --data-dir"
        )
    detail = f"{path}: {_gib(usage.free)} free of {_gib(usage.total)}"
    if usage.free < DISK_FAIL:
        return fail(SECTION, "disk", detail, "free space: checkpoints cannot be written")
    if usage.free < DISK_WARN:
        return warn(
            SECTION,
            "disk",
            f"{detail}; under {_gib(DISK_WARN)}",
            "keep fewer checkpoints (checkpoint.keep_last_k) or point the run at a larger volume",
        )
    return ok(SECTION, "disk", detail)


def read_speed_check(
    path: Path, size_mib: int = 256, progress: Callable[[float], None] | None = None
) -> Check:
    """Write a `size_mib` temp file in `path`, drop it from the page cache, read it back."""
    try:
        mbps, size = measure_read(path, size_mib, progress)
    except OSError as exc:
        return warn(
            SECTION,
            "read speed",
            f"could not test {path}: {exc}",
            "check the directory is writable",
        )
    detail = f"{path}: sequential read {mbps:,.0f} MB/s ({_gib(size)} test file)"
    if mbps < READ_WARN_MBPS:
        return warn(
            SECTION,
            "read speed",
            f"{detail}; under {READ_WARN_MBPS:.0f} MB/s",
            "put the data on local NVMe or a parallel filesystem; pre-tokenize into shards",
        )
    return ok(SECTION, "read speed", detail)


def measure_read(
    path: Path, size_mib: int, progress: Callable[[float], None] | None = None
) -> tuple[float, int]:
    """(MB/s, bytes read) of one sequential read of up to `size_mib` (less if writing it takes over
    WRITE_BUDGET_S). The page cache is bypassed with fsync + POSIX_FADV_DONTNEED
    where the OS has it; elsewhere the figure is an upper bound (a cached read)."""
    block = os.urandom(MIB)  # incompressible, so a compressing filesystem cannot cheat
    fd, name = tempfile.mkstemp(prefix=".dstrain-doctor-", dir=path)
    try:
        deadline = time.perf_counter() + WRITE_BUDGET_S
        for i in range(size_mib):  # a slow (network) filesystem stops early: the test stays short
            os.write(fd, block)
            if progress:
                progress((i + 1) / (2 * size_mib))
            if time.perf_counter() > deadline:
                break
        os.fsync(fd)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.lseek(fd, 0, os.SEEK_SET)
        started, done = time.perf_counter(), 0
        while chunk := os.read(fd, 8 * MIB):
            done += len(chunk)
            if progress:
                progress(0.5 + done / (2 * size_mib * MIB))
        elapsed = max(time.perf_counter() - started, 1e-6)
    finally:
        os.close(fd)
        os.unlink(name)
    return done / elapsed / 1e6, done


def _gib(size: int) -> str:
    return f"{size / GIB:.1f} GiB" if size >= GIB else f"{size / MIB:.0f} MiB"


def _limit(value: int) -> str:
    return "unlimited" if value == -1 else str(value)
