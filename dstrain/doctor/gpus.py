"""Versions (Python, torch, CUDA, NCCL, driver) and the GPUs: count, model, memory.

The only doctor module that imports `torch`, and only inside a function, only when a CUDA build of
torch meets an NVIDIA driver: `dstrain doctor` starts without paying torch's import time, and a
CPU-only machine or `--topology-from` alone never imports it. GPUs come from
NVML (the `nvidia-ml-py` package) when present, else from torch, else from `nvidia-smi`."""

import importlib.metadata
import importlib.util
import platform
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from dstrain.doctor.findings import Check, fail, ok, warn

GIB = 1024**3


@dataclass(frozen=True)
class GPU:
    index: int
    name: str
    memory_gib: float


@dataclass
class Platform:
    """What this machine runs; None where a piece is absent."""

    python: str
    torch: str | None = None
    cuda: str | None = None  # the CUDA torch was built with
    cuda_available: bool = False
    nccl: str | None = None
    driver: str | None = None
    gpus: list[GPU] = field(default_factory=list)
    gpu_source: str = "none"


def probe() -> Platform:
    """Read versions and GPUs from this machine."""
    found = Platform(python=platform.python_version(), torch=_dist_version("torch"))
    nvml = _nvml()
    if nvml is not None:
        found.driver, found.gpus, found.gpu_source = nvml[0], nvml[1], "nvml"
    if found.torch is not None:
        _torch_facts(found)
    if found.driver is None and (smi := _smi()) is not None:
        found.driver = smi[0]
        if not found.gpus:
            found.gpus, found.gpu_source = smi[1], "nvidia-smi"
    return found


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _nvml() -> tuple[str, list[GPU]] | None:
    if importlib.util.find_spec("pynvml") is None:
        return None
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None  # no driver: the torch fallback says the rest
    try:
        driver = _text(pynvml.nvmlSystemGetDriverVersion())
        gpus = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle).total / GIB
            gpus.append(GPU(index, _text(pynvml.nvmlDeviceGetName(handle)), memory))
        return driver, gpus
    except pynvml.NVMLError:
        return None  # a GPU fell off the bus mid-query: let torch / nvidia-smi say what is left
    finally:
        pynvml.nvmlShutdown()


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _torch_facts(found: Platform) -> None:
    found.cuda = _built_cuda()
    if found.cuda is None or not _driver_present():
        return  # nothing torch could add: skip its import (seconds on a busy machine)
    import torch

    found.cuda_available = torch.cuda.is_available()
    if not found.cuda_available:
        return
    version = torch.cuda.nccl.version()
    found.nccl = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    if found.gpu_source == "none":
        found.gpus = [
            GPU(
                i,
                torch.cuda.get_device_name(i),
                torch.cuda.get_device_properties(i).total_memory / GIB,
            )
            for i in range(torch.cuda.device_count())
        ]
        found.gpu_source = "torch"


def _built_cuda() -> str | None:
    """The CUDA version torch was built with, read from torch/version.py without importing it."""
    spec = importlib.util.find_spec("torch")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        try:
            text = (Path(folder) / "version.py").read_text()
        except OSError:
            continue
        match = re.search(r"^cuda\b[^=\n]*=\s*['\"]([^'\"]+)['\"]", text, re.MULTILINE)
        return match.group(1) if match else None
    return None


def _driver_present() -> bool:
    return Path("/proc/driver/nvidia/version").exists() or shutil.which("nvidia-smi") is not None


def _smi() -> tuple[str, list[GPU]] | None:
    """(driver, GPUs) from `nvidia-smi --query-gpu`, when NVML's Python binding is absent."""
    if shutil.which("nvidia-smi") is None:
        return None
    query = "--query-gpu=index,name,memory.total,driver_version"
    try:
        out = subprocess.run(
            ["nvidia-smi", query, "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    rows = [[f.strip() for f in line.split(",")] for line in out.stdout.splitlines()]
    rows = [r for r in rows if len(r) == 4 and r[0].isdigit()]
    if out.returncode != 0 or not rows:
        return None
    return rows[0][3], [GPU(int(i), name, float(mib) / 1024) for i, name, mib, _ in rows]


def version_checks(found: Platform) -> list[Check]:
    section = "versions"
    checks = [ok(section, "python", found.python)]
    if found.torch is None:
        return checks + [
            fail(section, "torch", "torch is not installed", "pip install torch (see pytorch.org)")
        ]
    checks.append(ok(section, "torch", found.torch))
    if found.cuda is None:
        checks.append(
            warn(
                section,
                "cuda",
                "torch is a CPU-only build: no CUDA, no NCCL (gloo only)",
                "install a CUDA build of torch on GPU machines (pytorch.org, e.g. cu124 wheels)",
            )
        )
    elif not found.cuda_available:
        checks.append(
            warn(
                section,
                "cuda",
                f"torch built with CUDA {found.cuda}, but CUDA is not usable here "
                f"(driver {found.driver or 'not found'})",
                "install/upgrade the NVIDIA driver for this CUDA version; in a container use "
                "--gpus all (nvidia-container-toolkit)",
            )
        )
    else:
        checks.append(ok(section, "cuda", f"CUDA {found.cuda}, driver {found.driver or '?'}"))
        checks.append(ok(section, "nccl", f"NCCL {found.nccl}"))
    return checks


def gpu_checks(found: Platform) -> list[Check]:
    section = "gpus"
    if not found.gpus:
        return [
            warn(
                section,
                "gpus",
                "no NVIDIA GPU on this machine: GPU checks skipped, the rest still run",
                "run `dstrain doctor` on a GPU node (check `nvidia-smi` and "
                "CUDA_VISIBLE_DEVICES there), or check its saved `nvidia-smi topo -m` here "
                "with --topology-from",
            )
        ]
    models = sorted({g.name for g in found.gpus})
    memory = min(g.memory_gib for g in found.gpus)
    detail = (
        f"{len(found.gpus)} x {' / '.join(models)}, {memory:.1f} GiB each (via {found.gpu_source})"
    )
    if len(models) > 1:
        return [
            warn(
                section,
                "gpus",
                detail,
                "mixed GPU models: the slowest paces every collective; use CUDA_VISIBLE_DEVICES "
                "to train on one model",
            )
        ]
    return [ok(section, "gpus", detail)]
