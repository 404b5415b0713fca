"""`dstrain doctor` as a user runs it: text and JSON output, exit codes, unreadable input.

The command is registered into a bare parser here, so these tests do not depend on how
dstrain.cli wires its subcommands."""

import argparse
import io
import json
import os
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

from dstrain.cli.common import run_guarded
from dstrain.cli.doctor import register
from dstrain.doctor.run import Options, run_doctor
from tests.conftest import REPO, SHARED, CliResult
from tests.unit.test_doctor_made_topologies import DGX1_TEXT

TOPO = REPO / "tests" / "fixtures" / "doctor" / "topo"
IBSTAT = REPO / "tests" / "fixtures" / "doctor" / "ibstat"
# Extra coverage when the shared fixtures sit beside the repository (skipped otherwise).
DGX1_SHARED = SHARED / "fixtures" / "topo" / "08_v100_sxm2_dgx1_hybrid_cube_mesh_dlperf.txt"


@pytest.fixture
def dgx1(tmp_path) -> Path:
    """The DGX-1 hybrid cube mesh of test_doctor_made_topologies, saved as a user would."""
    path = tmp_path / "topo.txt"
    path.write_text(DGX1_TEXT)
    return path


def doctor(*argv: str) -> CliResult:
    parser = argparse.ArgumentParser(prog="dstrain")
    register(parser.add_subparsers(dest="command"))
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            args = parser.parse_args(["doctor", *map(str, argv)])
            code = run_guarded(args.func, args)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
    return CliResult(code, out.getvalue(), err.getvalue())


def test_saved_topology_json_gives_the_matrix_as_written(dgx1):
    result = doctor("--topology-from", dgx1, "--tp", "8", "--json")
    assert result.code == 0, result.text
    data = result.json()
    assert data["topology"]["matrix"]["GPU0"]["GPU3"] == "NV2"
    assert data["topology"]["matrix"]["mlx5_0"]["GPU2"] == "PIX"
    assert data["topology"]["affinity"]["GPU4"] == {"cpu": "20-39,60-79"}
    assert data["topology"]["nics"] == ["mlx5_0"] and data["topology"]["nic_legend"] == {}
    assert data["summary"]["mode"] == "files"
    tp = next(c for c in data["checks"] if c["name"] == "tp=8")
    assert tp["status"] == "warn" and "GPU0-GPU5 (SYS)" in tp["detail"] and tp["fix"]
    assert {c["section"] for c in data["checks"]} == {"topology"}  # files only: no local checks


def test_saved_truncated_paste_json_says_what_is_missing():
    path = TOPO / "07_v100_sxm2_8gpu_cube_mesh_mlx5_columns_truncated.txt"
    result = doctor("--topology-from", path, "--tp", "8", "--json")
    assert result.code == 0, result.text
    data = result.json()
    assert data["topology"]["matrix"]["GPU7"]["GPU3"] == "NV2"  # from GPU3's row
    paste = next(c for c in data["checks"] if c["name"] == "paste")
    assert paste["status"] == "warn" and "no row for GPU7, mlx5_0, mlx5_1" in paste["detail"]
    tp = next(c for c in data["checks"] if c["name"] == "tp=8")
    assert tp["status"] == "warn" and "GPU1-GPU4 (SYS)" in tp["detail"]


def test_saved_topology_json_on_the_shared_fixture(shared):
    result = doctor("--topology-from", DGX1_SHARED, "--tp", "8", "--json")
    assert result.code == 0, result.text
    data = result.json()
    assert data["topology"]["matrix"]["GPU0"]["GPU3"] == "NV2"
    assert data["topology"]["matrix"]["mlx5_0"]["GPU2"] == "PIX"
    assert data["topology"]["affinity"]["GPU4"] == {"cpu": "12-23,36-47"}
    assert data["summary"]["mode"] == "files"
    tp = next(c for c in data["checks"] if c["name"] == "tp=8")
    assert tp["status"] == "warn" and "GPU0-GPU5 (SYS)" in tp["detail"] and tp["fix"]
    assert {c["section"] for c in data["checks"]} == {"topology"}  # files only: no local checks


def test_saved_topology_and_ibstat_text_output():
    result = doctor(
        "--topology-from",
        TOPO / "01_h800_nv18_10nic_far_nic_sglang_env.txt",
        "--ib-from",
        IBSTAT / "03_connectx7_roce200_and_down_port_truncated.txt",
    )
    assert result.code == 0, result.text
    assert "WARN  far NICs" in result.out
    assert "fix: bring the link up" in result.out  # the fix is printed under a non-ok check
    assert "mlx5_10 port 1: Down" in result.out
    assert "NIC legend: NIC0=mlx5_0" in result.out
    assert "mlx5_0 (NIC0)" in result.out  # the far management NIC, by its legend name


@pytest.mark.parametrize("source", ["made", "shared"])
def test_config_sets_the_layout(tmp_path, request, source):
    if source == "shared":
        request.getfixturevalue("shared")  # skips, with its reason, when ../shared is absent
    topo = request.getfixturevalue("dgx1") if source == "made" else DGX1_SHARED
    config = tmp_path / "run.toml"
    config.write_text("[parallel]\ntp = 8\nep = 1\n")
    result = doctor("--topology-from", topo, "--config", config, "--json")
    assert any(c["name"] == "tp=8" and c["status"] == "warn" for c in result.json()["checks"])
    result = doctor("--topology-from", topo, "--config", config, "--tp", "4", "--json")
    assert any(c["name"] == "tp=4" and c["status"] == "ok" for c in result.json()["checks"])


def test_missing_file_is_exit_2_with_one_message(tmp_path):
    result = doctor("--topology-from", tmp_path / "nope.txt")
    assert result.code == 2
    assert "no such file" in result.err and "Traceback" not in result.text


def test_a_file_that_is_not_a_topology_is_exit_2():
    result = doctor("--topology-from", IBSTAT / "01_connectx6dx_roce_100g_l2fwd.txt")
    assert result.code == 2
    assert "no `nvidia-smi topo -m` matrix" in result.err and "fix:" in result.err
    result = doctor("--ib-from", TOPO / "04_rtx5090_2gpu_phb_tabs.txt")
    assert result.code == 2 and "no `ibstat` output" in result.err


def test_local_run_without_gpus_warns_and_exits_0(tmp_path, monkeypatch):
    for name in [n for n in os.environ if n.startswith(("NCCL_", "TORCH_NCCL_"))]:
        monkeypatch.delenv(name)
    result = doctor("--data-dir", tmp_path, "--read-test-mib", "1", "--json")
    data = result.json()
    sections = {c["section"] for c in data["checks"]}
    assert {"versions", "gpus", "infiniband", "nccl env", "system"} <= sections
    if not data["topology"]:  # this machine has no GPU (CI): said so, and not a failure
        gpus = next(c for c in data["checks"] if c["section"] == "gpus")
        assert gpus["status"] == "warn" and "no NVIDIA GPU" in gpus["detail"]
    assert result.code == (1 if data["summary"]["fail"] else 0)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(not Path("/sys/class/net").is_dir(), reason="needs Linux /sys/class/net")
def test_a_failed_check_is_exit_1(tmp_path, monkeypatch):
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "=no-such-if0")
    result = doctor("--data-dir", tmp_path, "--read-test-mib", "0")
    assert result.code == 1
    assert "FAIL  NCCL_SOCKET_IFNAME" in result.out


def test_all_adds_local_checks_to_a_saved_file(tmp_path):
    opts = Options(
        topology_from=TOPO / "04_rtx5090_2gpu_phb_tabs.txt",
        all=True,
        data_dir=tmp_path,
        read_test_mib=0,
        env={"NCCL_DEBUG": "INFO"},
        ib_root=tmp_path / "no-ib",
        net_root=tmp_path,
    )
    report = run_doctor(opts)
    assert report.mode == "files+local"
    assert report.topology is not None and report.topology.link("GPU0", "GPU1") == "PHB"
    assert any(c.name == "NCCL_DEBUG" and c.status == "warn" for c in report.checks)
    assert json.loads(json.dumps(report.to_json()))["summary"]["warn"] >= 1


def test_local_topology_comes_from_nvidia_smi_when_gpus_exist(tmp_path, monkeypatch):
    from dstrain.doctor import gpus

    found = gpus.Platform(python="3.11", torch="2.6", gpus=[gpus.GPU(0, "NVIDIA H100", 79.6)])
    monkeypatch.setattr(gpus, "probe", lambda: found)
    text = (TOPO / "02_dgx_h100_nv18_8nic_sglang_env.txt").read_text()
    opts = Options(data_dir=tmp_path, read_test_mib=0, env={}, smi_topology=lambda: text, tp=8)
    report = run_doctor(opts)
    assert report.topology.link("GPU0", "GPU7") == "NV18"
    assert any(c.name == "tp=8" and c.status == "ok" for c in report.checks)
    assert any(c.name == "gpus" and "NVIDIA H100" in c.detail for c in report.checks)


def test_help_has_examples():
    result = doctor("--help")
    assert result.code == 0
    assert "dstrain doctor --topology-from topo.txt --tp 8" in result.out
