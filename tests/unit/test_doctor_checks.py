"""What doctor concludes: TP/EP groups over PCIe-only pairs, far NICs, the NCCL environment lint
and the host limits, each naming the right device, variable or number."""

import os

import pytest

from dstrain.doctor import system
from dstrain.doctor.nccl_env import lint_nccl_env, match_ifname, socket_ifname_check
from dstrain.doctor.topology import parse_topology
from dstrain.doctor.topology_checks import largest_nvlinked_group, topology_checks
from tests.conftest import REPO, SHARED
from tests.unit.test_doctor_made_topologies import (
    DGX1_FOUR_HCAS_PROMPT_TEXT,
    DGX1_TEXT,
    DGX_A100_TEXT,
)

TOPO = REPO / "tests" / "fixtures" / "doctor" / "topo"
DGX1_SHARED = SHARED / "fixtures" / "topo" / "08_v100_sxm2_dgx1_hybrid_cube_mesh_dlperf.txt"
# DGX-1-class hybrid cube meshes, each with its first socket's CPU list: the one written down in
# test_doctor_made_topologies, a real (truncated) paste from nccl-tests#29, and, as extra
# coverage when ../shared is present, the shared fixture.
CUBE_MESHES = {
    "made": "0-19,40-59",
    "nccl-tests-29": "0-23,48-71",
    "shared": "0-11,24-35",
}


def _checks(path, **layout):
    return _checks_of(path.read_text(), **layout)


def _checks_of(text, **layout):
    return {c.name: c for c in topology_checks(parse_topology(text), **layout)}


@pytest.fixture(params=list(CUBE_MESHES))
def cube_mesh(request):
    """(text, CPUs of GPU0-GPU3) of an 8 x V100 hybrid cube mesh with one HCA under GPU2/GPU3."""
    if request.param == "made":
        text = DGX1_TEXT
    elif request.param == "nccl-tests-29":
        text = (TOPO / "07_v100_sxm2_8gpu_cube_mesh_mlx5_columns_truncated.txt").read_text()
    else:
        text = (request.getfixturevalue("shared") / DGX1_SHARED.relative_to(SHARED)).read_text()
    return text, CUBE_MESHES[request.param]


def test_tp8_on_a_dgx1_names_the_pairs_without_nvlink(cube_mesh):
    text, _ = cube_mesh
    checks = _checks_of(text, tp=8)
    tp = checks["tp=8"]
    assert tp.status == "warn"
    assert "GPU0-GPU5 (SYS)" in tp.detail and "GPU1-GPU4 (SYS)" in tp.detail
    assert "GPU0-GPU1" not in tp.detail  # NV1 (NV2 in nccl-tests#29): linked
    assert "and 6 more" in tp.detail  # 12 pairs without NVLink, 6 listed
    assert "tp <= 4" in tp.fix


def test_tp4_on_a_dgx1_is_fine_and_the_nvlink_counts_are_reported(cube_mesh):
    text, cpus = cube_mesh
    checks = _checks_of(text, tp=4)
    assert checks["tp=4"].status == "ok"
    assert "NV2 x8, NV1 x8, SYS x12" in checks["nvlink"].detail
    assert f"CPUs {cpus}: GPU0, GPU1, GPU2, GPU3" in checks["numa"].detail


def test_dgx1_gpus_without_a_near_nic_are_named(cube_mesh):
    text, _ = cube_mesh
    nic = _checks_of(text)["GPU-NIC"]
    assert nic.status == "warn"
    for gpu in ("GPU0 (nearest mlx5_0 at NODE)", "GPU4 (nearest mlx5_0 at SYS)"):
        assert gpu in nic.detail
    assert "GPU2" not in nic.detail and "GPU3" not in nic.detail  # PIX to mlx5_0


def test_ep_groups_are_consecutive_gpus_as_in_the_trainers_mesh(cube_mesh):
    text, _ = cube_mesh
    # parallel/mesh.py folds ep innermost: EP groups are {0..3} and {4..7} for ep=4.
    fine = _checks_of(text, tp=2, ep=4)
    assert fine["tp=2"].status == "ok"  # GPU0-1, 2-3, 4-5, 6-7 are all NV-linked
    assert fine["ep=4"].status == "ok" and "GPU0-GPU3" in fine["ep=4"].detail
    assert "GPU4-GPU7" in fine["ep=4"].detail
    ep = _checks_of(text, tp=2, ep=8)["ep=8"]
    # One group of all 8: GPU0-GPU5 is SYS on a DGX-1's hybrid cube mesh.
    assert ep.status == "warn" and "GPU0-GPU5 (SYS)" in ep.detail
    assert "use ep <= 4" in ep.fix


def test_ep2_groups_on_a_dgx1_are_nvlinked_pairs():
    # ep=2 pairs GPU0-1, GPU2-3, GPU4-5, GPU6-7: all NV-linked on the hybrid cube mesh.
    checks = _checks_of(DGX1_TEXT, tp=1, ep=2)
    assert checks["tp=1"].status == "ok" and checks["ep=2"].status == "ok"
    assert "GPU0-GPU1, GPU2-GPU3, GPU4-GPU5, GPU6-GPU7" in checks["ep=2"].detail


def test_a_dgx1_with_one_hca_per_gpu_pair_has_no_nic_warnings():
    checks = _checks_of(DGX1_FOUR_HCAS_PROMPT_TEXT, tp=8)
    assert "far NICs" not in checks
    near = checks["GPU-NIC"]
    assert near.status == "ok"
    assert "GPU0->mlx5_0, GPU1->mlx5_0, GPU2->mlx5_1, GPU3->mlx5_1" in near.detail
    assert checks["tp=8"].status == "warn" and "GPU0-GPU5 (SYS)" in checks["tp=8"].detail


def test_a100_storage_nics_are_far_and_tp8_is_fine():
    checks = _checks_of(DGX_A100_TEXT, tp=8, ep=1)
    assert checks["tp=8"].status == "ok"
    far = checks["far NICs"]
    assert "mlx5_8 (NIC8)" in far.detail and "mlx5_9 (NIC9)" in far.detail
    assert "NIC7" not in far.detail
    assert "NCCL_IB_HCA=^=mlx5_8,mlx5_9" in far.fix
    assert "GPU-NIC" not in checks  # every GPU has a PXB NIC


def test_a_management_nic_sys_to_every_gpu_is_far_on_a_real_h800():
    checks = _checks(TOPO / "01_h800_nv18_10nic_far_nic_sglang_env.txt", tp=8, ep=8)
    assert checks["tp=8"].status == "ok" and checks["ep=8"].status == "ok"
    far = checks["far NICs"]
    assert far.status == "warn"
    assert far.detail == "far from every GPU: mlx5_0 (NIC0) (nearest GPU0 at SYS)"
    assert "NCCL_IB_HCA=^=mlx5_0 " in far.fix
    assert "mlx5_stor_0" not in far.detail  # NIC9: PXB to GPU0-GPU3
    assert "GPU-NIC" not in checks  # each GPU has its own mlx5_gdr_* at PIX


def test_h100_is_clean():
    checks = _checks(TOPO / "02_dgx_h100_nv18_8nic_sglang_env.txt", tp=8, ep=8)
    assert {c.status for c in checks.values()} == {"ok"}
    assert "GPU0->mlx5_0 (NIC0)" in checks["GPU-NIC"].detail
    assert "NUMA 0: GPU0, GPU1, GPU2, GPU3; NUMA 1: GPU4, GPU5, GPU6, GPU7" in checks["numa"].detail
    assert "GPU0-GPU7) is fully NVLinked" in checks["ep=8"].detail  # ep 8 = the node
    wide = _checks(TOPO / "02_dgx_h100_nv18_8nic_sglang_env.txt", tp=8, ep=16)
    assert "spans nodes" in wide["ep=16"].detail


def test_pcie_box_tp2_warns_and_suggests_tp1():
    topo = parse_topology((TOPO / "03_rtx4090_8gpu_2nic_pcie_tabs.txt").read_text())
    assert largest_nvlinked_group(topo) == 1
    checks = {c.name: c for c in topology_checks(topo, tp=2)}
    assert "GPU0-GPU1 (SYS)" in checks["tp=2"].detail and "tp <= 1" in checks["tp=2"].fix
    lonely = checks["GPU-NIC"].detail
    assert "GPU0 (nearest NIC0 at SYS)" in lonely and "GPU6" not in lonely


def test_tp_beyond_the_node_warns():
    checks = _checks(TOPO / "04_rtx5090_2gpu_phb_tabs.txt", tp=4)
    assert "tp=4 > 2 GPUs per node" in checks["tp across nodes"].detail
    assert "GPU0-GPU1 (PHB)" in checks["tp=4"].detail


def test_no_layout_no_tp_check():
    assert not any(n.startswith("tp=") for n in _checks(TOPO / "05_rtx5090_4090_5gpu_two_numa.txt"))


@pytest.fixture
def net(tmp_path):
    for name in ("lo", "eth0", "ib0", "docker0"):
        (tmp_path / name).mkdir()
    return tmp_path


def _lint(env, net, ib_active=False):
    return {c.name: c for c in lint_nccl_env(env, net, ib_active)}


def test_unknown_variable_gets_a_suggestion(net):
    check = _lint({"NCCL_SOCKET_IFNAM": "eth0", "NCCL_IB_HCA": "mlx5"}, net)["NCCL_SOCKET_IFNAM"]
    assert check.status == "warn" and "did you mean NCCL_SOCKET_IFNAME" in check.detail


def test_deprecated_torch_spellings(net):
    checks = _lint({"NCCL_ASYNC_ERROR_HANDLING": "1", "NCCL_BLOCKING_WAIT": "1"}, net)
    assert checks["NCCL_ASYNC_ERROR_HANDLING"].fix == "rename it to TORCH_NCCL_ASYNC_ERROR_HANDLING"
    assert checks["TORCH_NCCL_BLOCKING_WAIT"].status == "warn"


def test_async_error_handling_off_warns(net):
    check = _lint({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}, net)["TORCH_NCCL_ASYNC_ERROR_HANDLING"]
    assert check.status == "warn" and "wall-clock" in check.detail


@pytest.mark.parametrize(("level", "status"), [("INFO", "warn"), ("trace", "warn"), ("WARN", "ok")])
def test_debug_level(net, level, status):
    check = _lint({"NCCL_DEBUG": level}, net)["NCCL_DEBUG"]
    assert check.status == status
    if status == "warn":
        assert check.fix.startswith("NCCL_DEBUG=WARN")


def test_ib_disable_on_an_ib_host(net):
    assert "NCCL_IB_DISABLE" in _lint({"NCCL_IB_DISABLE": "1"}, net, ib_active=True)
    assert "NCCL_IB_DISABLE" not in _lint({"NCCL_IB_DISABLE": "1"}, net, ib_active=False)


@pytest.mark.parametrize(
    ("spec", "chosen"),
    [
        ("eth", ["eth0"]),
        ("=eth0", ["eth0"]),
        ("=eth", []),
        ("^docker,lo", ["eth0", "ib0"]),
        ("^=docker0", ["eth0", "ib0", "lo"]),
        ("ib,eth", ["eth0", "ib0"]),
        # The `=` (and `^`) apply to the whole list, as NCCL reads it.
        ("=eth0,ib0", ["eth0", "ib0"]),
        ("^=docker0,lo", ["eth0", "ib0"]),
        ("=eth0,ib", ["eth0"]),
    ],
)
def test_socket_ifname_follows_nccl_syntax(spec, chosen):
    assert match_ifname(spec, ["docker0", "eth0", "ib0", "lo"]) == chosen


def test_socket_ifname_verdicts(net):
    interfaces = sorted(p.name for p in net.iterdir())
    missing = socket_ifname_check("enp1s0", interfaces)
    assert missing.status == "fail" and "docker0, eth0, ib0, lo" in missing.detail
    partly = socket_ifname_check("eth,bond", interfaces)
    assert partly.status == "warn" and "bond match no interface" in partly.detail
    assert socket_ifname_check("^eth,ib,lo,docker", interfaces).status == "fail"
    assert socket_ifname_check("=ib0", interfaces).status == "ok"
    exact = socket_ifname_check("=eth0,bond0", interfaces)  # `=` covers bond0 too
    assert exact.status == "warn" and "bond0 match no interface" in exact.detail
    assert socket_ifname_check("eth0", None).status == "ok"  # cannot list: not checked
    assert _lint({"NCCL_SOCKET_IFNAME": "enp1s0"}, net)["NCCL_SOCKET_IFNAME"].status == "fail"


def test_clean_env_is_ok(net):
    (check,) = lint_nccl_env({"PATH": "/bin"}, net)
    assert check.status == "ok"


def test_shm_thresholds(tmp_path, monkeypatch):
    def statvfs(size):
        return os.statvfs_result(
            (4096, 4096, size // 4096, size // 4096, size // 4096, 0, 0, 0, 0, 255)
        )

    monkeypatch.setattr(os, "statvfs", lambda path: statvfs(64 * 1024**2))
    small = system.shm_check(tmp_path)
    assert small.status == "warn" and "Docker's 64 MiB default" in small.detail
    assert "--shm-size" in small.fix
    monkeypatch.setattr(os, "statvfs", lambda path: statvfs(8 * 1024**3))
    assert system.shm_check(tmp_path).status == "ok"
    assert system.shm_check(tmp_path, num_workers=64).status == "warn"  # 64 x 256 MiB > 8 GiB


def test_nofile_thresholds():
    low = system.nofile_check((1024, 4096))
    assert low.status == "warn" and "raise the hard limit first" in low.fix
    assert system.nofile_check((1048576, 1048576)).status == "ok"
    assert system.nofile_check((-1, -1)).status == "ok"


def test_disk_and_read_speed_on_a_tmp_dir(tmp_path):
    assert system.disk_check(tmp_path).status in ("ok", "warn")
    assert system.disk_check(tmp_path / "absent").status == "fail"
    seen = []
    check = system.read_speed_check(tmp_path, size_mib=2, progress=seen.append)
    assert "MB/s (2 MiB test file)" in check.detail
    assert seen[-1] == pytest.approx(1.0)
    assert list(tmp_path.iterdir()) == []  # the test file is gone


def test_a_cut_short_paste_judges_only_what_it_shows():
    """DGX A100 paste cut after GPU5's row: the missing pairs are unknown, not "no NVLink", and
    NICs whose nearest GPU is among the missing ones are not called far."""
    checks = _checks(TOPO / "08_dgx_a100_nv12_10nic_root_prompt_truncated.txt", tp=8)
    tp = checks["tp=8"]
    assert tp.status == "warn" and "no link for GPU6-GPU7" in tp.detail
    assert "tp <= 1" not in tp.fix
    assert "far NICs" not in checks
    assert "the paste places" in checks["GPU-NIC"].detail
