"""InfiniBand/RoCE: saved `ibstat` outputs of real machines, a fake /sys/class/infiniband tree,
and the port checks."""

from pathlib import Path

import pytest
import yaml

from dstrain.doctor.ibstat import IbstatParseError, parse_ibstat
from dstrain.doctor.infiniband import IBPort, ib_checks, read_sysfs
from tests.conftest import REPO

FIXTURES = REPO / "tests" / "fixtures" / "doctor" / "ibstat"
SAMPLES = yaml.safe_load((FIXTURES / "index.yaml").read_text())["samples"]


@pytest.mark.parametrize("sample", SAMPLES, ids=[s["file"][:2] for s in SAMPLES])
def test_recorded_ibstat_samples(sample):
    ports = parse_ibstat((FIXTURES / sample["file"]).read_text())
    assert [p.ca for p in ports] == sample["cas"]
    assert len(ports) == sample["ports"]
    first = ports[0]
    assert first.rate_gbps == sample["rate"]
    assert first.link_layer == sample["link_layer"]
    assert first.state == sample.get("state", "Active")
    assert first.physical_state == "LinkUp"


def test_truncated_block_keeps_its_state_and_leaves_the_rest_unknown():
    ports = parse_ibstat((FIXTURES / SAMPLES[2]["file"]).read_text())
    down = ports[-1]
    assert (down.ca, down.port, down.state, down.physical_state) == (
        "mlx5_10",
        1,
        "Down",
        "Disabled",
    )
    assert down.rate_gbps is None and down.link_layer is None
    assert down.ca_type == "MT4125"


def test_infiniband_and_roce_ports_of_one_host():
    """02: eight ConnectX-7 on InfiniBand NDR plus four Ethernet ports, two of them down."""
    sample = SAMPLES[1]
    ports = parse_ibstat((FIXTURES / sample["file"]).read_text())
    ib = [p for p in ports if p.link_layer == "InfiniBand"]
    assert len(ib) == 8 and {p.rate_gbps for p in ib} == {400.0} and all(p.active for p in ib)
    assert {p.ca_type for p in ib} == {"MT4129"}
    assert [p.ca for p in ports if not p.active] == sample["down"]
    checks = {c.name: c for c in ib_checks(ports, "ibstat")}
    assert checks["mlx5_0 port 1"].status == "ok" and "InfiniBand" in checks["mlx5_0 port 1"].detail
    down = checks["mlx5_1 port 1"]
    assert down.status == "warn" and "Down, Disabled" in down.detail
    assert "NCCL_IB_HCA=^=mlx5_1" in down.fix
    assert "RoCE" in checks["mlx5_7 port 1"].detail
    rates = checks["rates"]
    assert rates.status == "warn" and "(100, 400 Gb/s)" in rates.detail
    assert "slowest: mlx5_7 port 1, mlx5_8 port 1" in rates.detail


@pytest.mark.parametrize(
    "damage",
    [
        lambda t: t.replace("\n", "\r\n"),
        lambda t: t.expandtabs(8),
        lambda t: t.replace("        ", "\t"),
        lambda t: "$ ibstat\n```\n" + t + "```\n[root@node ~]# ",
        lambda t: "\n".join(line.strip() for line in t.split("\n")),  # indentation lost
    ],
)
def test_damaged_ibstat_parses_like_the_original(damage):
    for sample in SAMPLES:
        text = (FIXTURES / sample["file"]).read_text()
        assert parse_ibstat(damage(text)) == parse_ibstat(text)


def test_two_port_ca():
    text = "CA 'mlx4_0'\n\tPort 1:\n\t\tState: Down\n\t\tRate: 10\n\tPort 2:\n\t\tState: Active\n"
    ports = parse_ibstat(text + "\t\tRate: 56\n\t\tLink layer: InfiniBand\n")
    assert [(p.port, p.state, p.rate_gbps) for p in ports] == [(1, "Down", 10), (2, "Active", 56)]


def test_text_without_a_ca_is_an_error():
    with pytest.raises(IbstatParseError, match="no `ibstat` output"):
        parse_ibstat("\tGPU0\tGPU1\nGPU0\t X \tNV12\n")


def _fake_port(root: Path, ca: str, port: int, state: str, rate: str, layer: str) -> None:
    folder = root / ca / "ports" / str(port)
    folder.mkdir(parents=True)
    (folder / "state").write_text(f"{state}\n")
    (folder / "phys_state").write_text("5: LinkUp\n" if "ACTIVE" in state else "3: Disabled\n")
    (folder / "rate").write_text(f"{rate}\n")
    (folder / "link_layer").write_text(f"{layer}\n")


def test_sysfs_reader_on_a_fake_tree(tmp_path):
    _fake_port(tmp_path, "mlx5_0", 1, "4: ACTIVE", "400 Gb/sec (4X NDR)", "InfiniBand")
    _fake_port(tmp_path, "mlx5_1", 1, "1: DOWN", "10 Gb/sec (4X SDR)", "InfiniBand")
    _fake_port(tmp_path, "mlx5_2", 1, "4: ACTIVE", "200 Gb/sec (2X NDR)", "Ethernet")
    ports = read_sysfs(tmp_path)
    assert ports[0] == IBPort("mlx5_0", 1, "ACTIVE", "LinkUp", 400.0, "InfiniBand")
    assert [p.active for p in ports] == [True, False, True]
    checks = {c.name: c for c in ib_checks(ports, str(tmp_path))}
    assert checks["mlx5_0 port 1"].status == "ok"
    assert checks["mlx5_1 port 1"].status == "warn"
    assert "NCCL_IB_HCA=^=mlx5_1" in checks["mlx5_1 port 1"].fix
    assert "RoCE" in checks["mlx5_2 port 1"].detail
    assert checks["rates"].status == "warn" and "mlx5_2 port 1" in checks["rates"].detail


def test_no_sysfs_tree_means_no_devices(tmp_path):
    assert read_sysfs(tmp_path / "absent") == []
    (check,) = ib_checks([], "/sys/class/infiniband")
    assert check.status == "warn" and "TCP sockets" in check.detail
