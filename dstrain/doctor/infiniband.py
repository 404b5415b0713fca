"""InfiniBand/RoCE ports from sysfs (`/sys/class/infiniband/<ca>/ports/<n>/`), and their checks.

The sysfs root is a parameter so tests point it at a fake tree."""

import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dstrain.doctor.findings import Check, ok, warn

SECTION = "infiniband"
SYSFS = Path("/sys/class/infiniband")


@dataclass(frozen=True)
class IBPort:
    """One port of one host channel adapter; None where the source did not say."""

    ca: str
    port: int
    state: str | None
    physical_state: str | None
    rate_gbps: float | None
    link_layer: str | None
    ca_type: str | None = None

    @property
    def active(self) -> bool:
        return (self.state or "").upper() == "ACTIVE"

    @property
    def label(self) -> str:
        return f"{self.ca} port {self.port}"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def read_sysfs(root: Path = SYSFS) -> list[IBPort]:
    """Every port under `root`; an absent root (no RDMA driver loaded) is no ports."""
    if not root.is_dir():
        return []
    ports = []
    for ca in sorted(root.iterdir()):
        for port_dir in sorted((ca / "ports").glob("*")):
            if port_dir.name.isdigit():
                ports.append(_sysfs_port(ca.name, port_dir))
    return ports


def _sysfs_port(ca: str, port_dir: Path) -> IBPort:
    # sysfs writes `4: ACTIVE`, `5: LinkUp`, `400 Gb/sec (4X NDR)`, `InfiniBand`.
    state, phys, rate, layer = (
        _read(port_dir / name) for name in ("state", "phys_state", "rate", "link_layer")
    )
    return IBPort(
        ca, int(port_dir.name), _after_colon(state), _after_colon(phys), _rate(rate), layer
    )


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def _after_colon(text: str | None) -> str | None:
    return text.split(":", 1)[-1].strip() if text else None


def _rate(text: str | None) -> float | None:
    match = re.match(r"\s*([\d.]+)", text or "")
    return float(match.group(1)) if match else None


def ib_checks(ports: list[IBPort], source: str) -> list[Check]:
    """Port states, link layers and mixed rates. `source` says where the ports came from."""
    if not ports:
        return [
            warn(
                SECTION,
                "devices",
                f"no InfiniBand/RoCE device ({source}): multi-node NCCL traffic will use TCP "
                "sockets, typically 10x slower than RDMA",
                "single node: nothing to do. Multi-node: load the RDMA driver (MLNX_OFED/"
                "rdma-core), expose /dev/infiniband to the container, or check `ibstat`",
            )
        ]
    checks = [_port_check(port) for port in ports]
    return checks + _rate_check([p for p in ports if p.active])


def _port_check(port: IBPort) -> Check:
    layer = port.link_layer or "unknown link layer"
    kind = "RoCE" if (port.link_layer or "").lower() == "ethernet" else layer
    rate = f"{port.rate_gbps:g} Gb/s" if port.rate_gbps is not None else "rate unknown"
    detail = f"{port.state or 'state unknown'}, {port.physical_state or '?'}, {rate}, {kind}"
    if port.active:
        return ok(SECTION, port.label, detail)
    return warn(
        SECTION,
        port.label,
        detail,
        f"bring the link up (cable, switch port, subnet manager for InfiniBand: `ibstat "
        f"{port.ca}`), or keep NCCL off it with NCCL_IB_HCA=^={port.ca}",
    )


def _rate_check(active: list[IBPort]) -> list[Check]:
    rates = {p.rate_gbps for p in active if p.rate_gbps is not None}
    if len(rates) <= 1:
        return []
    slow = [p.label for p in active if p.rate_gbps == min(rates)]
    return [
        warn(
            SECTION,
            "rates",
            f"active ports run at different rates ({', '.join(f'{r:g}' for r in sorted(rates))}"
            f" Gb/s); slowest: {', '.join(slow)}",
            "a collective runs at the slowest rail's speed: reseat/replace the cable or keep "
            "NCCL off the slow ports (NCCL_IB_HCA) unless they are storage/management NICs",
        )
    ]
