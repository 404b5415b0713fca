"""Versions and GPUs: the verdicts for each kind of machine, and a fake `nvidia-smi` on PATH
standing in for a GPU node (GPU list, driver and `topo -m`)."""

import importlib.machinery
import os
import stat
import sys
import types

import pytest

from dstrain.doctor import gpus
from dstrain.doctor.gpus import GPU, Platform, gpu_checks, version_checks
from dstrain.doctor.run import Options, run_doctor
from tests.conftest import REPO

H100_TOPO = REPO / "tests" / "fixtures" / "doctor" / "topo" / "02_dgx_h100_nv18_8nic_sglang_env.txt"


def _by_name(checks):
    return {c.name: c for c in checks}


def test_cpu_only_torch_warns_and_no_gpu_warns():
    found = Platform(python="3.11.9", torch="2.6.0+cpu")
    versions = _by_name(version_checks(found))
    assert versions["torch"].status == "ok"
    assert versions["cuda"].status == "warn" and "CPU-only" in versions["cuda"].detail
    (check,) = gpu_checks(found)
    assert check.status == "warn" and "no NVIDIA GPU" in check.detail


def test_cuda_build_without_a_driver_warns():
    found = Platform(python="3.11.9", torch="2.6.0", cuda="12.4", cuda_available=False)
    cuda = _by_name(version_checks(found))["cuda"]
    assert cuda.status == "warn" and "12.4" in cuda.detail and "driver not found" in cuda.detail


def test_missing_torch_fails():
    assert _by_name(version_checks(Platform(python="3.11.9")))["torch"].status == "fail"


def test_gpu_node_versions_and_mixed_models():
    found = Platform(
        python="3.11.9",
        torch="2.6.0",
        cuda="12.4",
        cuda_available=True,
        nccl="2.21.5",
        driver="550.54",
        gpus=[GPU(0, "NVIDIA H100 80GB HBM3", 79.6), GPU(1, "NVIDIA A100-SXM4-80GB", 79.1)],
        gpu_source="nvml",
    )
    versions = _by_name(version_checks(found))
    assert versions["nccl"].detail == "NCCL 2.21.5"
    assert "driver 550.54" in versions["cuda"].detail
    (check,) = gpu_checks(found)
    assert check.status == "warn" and "2 x NVIDIA A100-SXM4-80GB / NVIDIA H100" in check.detail


@pytest.fixture
def fake_smi(tmp_path, monkeypatch):
    """An `nvidia-smi` that answers the two queries doctor makes."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "nvidia-smi"
    script.write_text(
        f"#!{sys.executable}\n"
        "import sys\n"
        "if sys.argv[1:3] == ['topo', '-m']:\n"
        f"    sys.stdout.write(open({str(H100_TOPO)!r}).read())\n"
        "else:\n"
        "    for i in range(8):\n"
        "        print(f'{i}, NVIDIA H100 80GB HBM3, 81559, 550.54.15')\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(gpus, "_nvml", lambda: None)  # as if nvidia-ml-py were not installed
    return script


def test_gpus_and_topology_from_nvidia_smi(fake_smi, tmp_path):
    found = gpus.probe()
    assert found.driver == "550.54.15"
    assert len(found.gpus) == 8 and found.gpus[7] == GPU(7, "NVIDIA H100 80GB HBM3", 81559 / 1024)
    opts = Options(data_dir=tmp_path, read_test_mib=0, env={}, tp=8, ib_root=tmp_path / "no")
    report = run_doctor(opts)
    assert report.topology is not None and report.topology.link("GPU3", "NIC3") == "PIX"
    checks = _by_name(report.checks)
    assert checks["gpus"].status == "ok" and "8 x NVIDIA H100" in checks["gpus"].detail
    assert checks["tp=8"].status == "ok"


def _fake_pynvml(names: list[str], fail_at: int | None = None) -> types.ModuleType:
    """nvidia-ml-py's API as doctor calls it; `fail_at`: the GPU index whose query errors."""
    nvml = types.ModuleType("pynvml")
    nvml.__spec__ = importlib.machinery.ModuleSpec("pynvml", None)
    nvml.NVMLError = type("NVMLError", (Exception,), {})
    nvml.calls = []

    def handle(index: int) -> int:
        if index == fail_at:
            raise nvml.NVMLError("GPU is lost")
        return index

    nvml.nvmlInit = lambda: nvml.calls.append("init")
    nvml.nvmlShutdown = lambda: nvml.calls.append("shutdown")
    nvml.nvmlSystemGetDriverVersion = lambda: b"570.86.15"  # older bindings return bytes
    nvml.nvmlDeviceGetCount = lambda: len(names)
    nvml.nvmlDeviceGetHandleByIndex = handle
    nvml.nvmlDeviceGetName = lambda h: names[h]
    nvml.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(total=80 * 1024**3)
    return nvml


def test_gpus_through_nvml_when_nvidia_ml_py_is_installed(monkeypatch):
    nvml = _fake_pynvml(["NVIDIA H200", "NVIDIA H200"])
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.setattr(gpus, "_torch_facts", lambda found: None)
    found = gpus.probe()
    assert found.gpu_source == "nvml" and found.driver == "570.86.15"
    assert found.gpus == [GPU(0, "NVIDIA H200", 80.0), GPU(1, "NVIDIA H200", 80.0)]
    (check,) = gpu_checks(found)
    assert check.status == "ok" and "2 x NVIDIA H200" in check.detail
    assert nvml.calls == ["init", "shutdown"]


def test_a_gpu_lost_mid_query_falls_back_and_nvml_is_shut_down(monkeypatch):
    nvml = _fake_pynvml(["NVIDIA H200", "NVIDIA H200"], fail_at=1)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.setattr(gpus, "_torch_facts", lambda found: None)
    monkeypatch.setattr(gpus, "_smi", lambda: None)
    found = gpus.probe()
    assert found.gpu_source == "none" and not found.gpus
    assert nvml.calls == ["init", "shutdown"]
