"""Run every doctor check and collect one report.

Two modes. Local (the default): versions, GPUs, `nvidia-smi topo -m`, /sys/class/infiniband, the
NCCL environment and the host limits of this machine. Files (`--topology-from` / `--ib-from`):
only the saved outputs, pasted from a cluster that support cannot log into; `--all` adds the
local checks too (a saved topology then replaces the local one)."""

import os
import shutil
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dstrain.doctor import gpus, system
from dstrain.doctor.findings import Check, summarize, warn
from dstrain.doctor.ibstat import IbstatParseError, parse_ibstat
from dstrain.doctor.infiniband import SYSFS, IBPort, ib_checks, read_sysfs
from dstrain.doctor.nccl_env import NET_SYSFS, lint_nccl_env
from dstrain.doctor.topology import Topology, TopologyParseError, parse_topology
from dstrain.doctor.topology_checks import topology_checks
from dstrain.errors import UserError


@dataclass
class Options:
    """Inputs of one doctor run; the sysfs/proc paths are parameters so tests can fake them."""

    topology_from: Path | None = None
    ib_from: Path | None = None
    all: bool = False
    tp: int | None = None
    ep: int | None = None
    data_dir: Path = Path(".")
    read_test_mib: int = 256
    num_workers: int = 0
    env: Mapping[str, str] | None = None
    ib_root: Path = SYSFS
    net_root: Path = NET_SYSFS
    shm_path: Path = Path("/dev/shm")
    progress: Callable[[float], None] | None = None
    smi_topology: Callable[[], str | None] | None = None  # None: run `nvidia-smi topo -m`

    @property
    def local(self) -> bool:
        return self.all or (self.topology_from is None and self.ib_from is None)


@dataclass
class Report:
    checks: list[Check] = field(default_factory=list)
    topology: Topology | None = None
    ports: list[IBPort] = field(default_factory=list)
    mode: str = "local"

    @property
    def exit_code(self) -> int:
        return 1 if any(c.status == "fail" for c in self.checks) else 0

    def to_json(self) -> dict[str, Any]:
        return {
            "checks": [c.to_json() for c in self.checks],
            "topology": self.topology.to_json() if self.topology else None,
            "infiniband": [p.to_json() for p in self.ports],
            "summary": summarize(self.checks) | {"exit_code": self.exit_code, "mode": self.mode},
        }


def run_doctor(opts: Options) -> Report:
    """Every applicable check, in display order. Unreadable input files raise UserError."""
    report = Report(mode="local" if not (opts.topology_from or opts.ib_from) else "files")
    if opts.topology_from:
        report.topology = load_topology(opts.topology_from)
    if opts.ib_from:
        report.ports = load_ibstat(opts.ib_from)
    found = None
    if opts.local:
        report.mode = "files+local" if report.mode == "files" else "local"
        found = gpus.probe()
        report.checks += gpus.version_checks(found) + gpus.gpu_checks(found)
        if report.topology is None and found.gpus:
            report.topology, problem = _local_topology(opts)
            report.checks += problem
    if report.topology is not None:
        report.checks += topology_checks(report.topology, opts.tp, opts.ep)
    if opts.local and not opts.ib_from:
        report.ports = read_sysfs(opts.ib_root)
    if opts.local or opts.ib_from:
        source = str(opts.ib_from) if opts.ib_from else str(opts.ib_root)
        report.checks += ib_checks(report.ports, source)
    if opts.local:
        report.checks += _local_host(opts, report.ports)
    return report


def _local_host(opts: Options, ports: list[IBPort]) -> list[Check]:
    env = os.environ if opts.env is None else opts.env
    ib_active = any(p.active and (p.link_layer or "").lower() == "infiniband" for p in ports)
    checks = lint_nccl_env(env, opts.net_root, ib_active)
    checks += [
        system.shm_check(opts.shm_path, opts.num_workers),
        system.nofile_check(),
        system.disk_check(opts.data_dir),
    ]
    if opts.read_test_mib > 0:
        checks.append(system.read_speed_check(opts.data_dir, opts.read_test_mib, opts.progress))
    return checks


def _local_topology(opts: Options) -> tuple[Topology | None, list[Check]]:
    text = (opts.smi_topology or smi_topology)()
    if text is None:
        return None, [
            warn(
                "topology",
                "nvidia-smi",
                "`nvidia-smi topo -m` did not run: topology not checked",
                "install the NVIDIA driver utilities, or pass a saved output with --topology-from",
            )
        ]
    try:
        return parse_topology(text), []
    except TopologyParseError as exc:
        return None, [warn("topology", "nvidia-smi", str(exc), "report this output to dstrain")]


def smi_topology() -> str | None:
    """`nvidia-smi topo -m` of this machine, or None when it cannot run."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def load_topology(path: Path) -> Topology:
    """A saved `nvidia-smi topo -m` output; UserError (exit 2) when unreadable or not one."""
    try:
        return parse_topology(_read(path, "--topology-from"))
    except TopologyParseError as exc:
        raise UserError(
            f"{path}: {exc}",
            "save the output of `nvidia-smi topo -m` (the matrix with GPU0 GPU1 ... columns)",
        ) from None


def load_ibstat(path: Path) -> list[IBPort]:
    """A saved `ibstat` output; UserError (exit 2) when unreadable or not one."""
    try:
        return parse_ibstat(_read(path, "--ib-from"))
    except IbstatParseError as exc:
        raise UserError(
            f"{path}: {exc}", "save the output of `ibstat` (blocks starting CA 'mlx5_0')"
        ) from None


def _read(path: Path, flag: str) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        raise UserError(
            f"{flag} {path}: no such file", "give the path of the saved output"
        ) from None
    except OSError as exc:
        raise UserError(f"{flag} {path}: {exc.strerror}", "give a readable file") from None
