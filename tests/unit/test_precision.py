"""What a precision means on a device, decided before the first step, and the peak MFU counts
against: checks a device fails, TF32 for fp32 on Ampere or newer, the CPU peak's plausibility."""

import json

import pytest
import torch

from dstrain.config.flavors import flavor_args
from dstrain.errors import UserError
from dstrain.metrics import peak as peak_module
from dstrain.train.precision import configure_precision
from tests.unit.tiny import tiny_args

CPU, GPU = torch.device("cpu"), torch.device("cuda", 0)


def test_cpu_rules():
    assert configure_precision("fp32", None, CPU, tiny_args()).peak_kind == "fp32"
    assert configure_precision("fp16", None, CPU, tiny_args()).peak_kind == "fp16"  # tiny: fine
    with pytest.raises(UserError, match="hundreds of times slower"):
        configure_precision("fp16", None, CPU, flavor_args("deepseek-v2-lite"))
    with pytest.raises(UserError, match="TF32 exists on CUDA tensor cores only"):
        configure_precision("fp32", True, CPU, tiny_args())


@pytest.fixture
def gpu(monkeypatch):
    """A GPU of a given compute capability, without one (TF32 switches restored after)."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32

    def make(capability):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA Test GPU")

    yield make
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def test_fp32_on_ampere_runs_tf32_and_warns(gpu):
    gpu((8, 0))
    setup = configure_precision("fp32", None, GPU, tiny_args())
    assert setup.tf32 and setup.peak_kind == "tf32" and torch.backends.cuda.matmul.allow_tf32
    assert "bf16" in setup.warning
    off = configure_precision("fp32", False, GPU, tiny_args())
    assert not off.tf32 and off.peak_kind == "fp32" and not torch.backends.cuda.matmul.allow_tf32
    assert configure_precision("bf16", None, GPU, tiny_args()).warning is None


def test_pre_ampere_refuses_bf16_and_tf32(gpu):
    gpu((7, 0))
    with pytest.raises(UserError, match="bf16 tensor cores start at 8.0"):
        configure_precision("bf16", None, GPU, tiny_args())
    with pytest.raises(UserError, match="TF32 starts at 8.0"):
        configure_precision("fp32", True, GPU, tiny_args())
    assert configure_precision("fp32", None, GPU, tiny_args()).peak_kind == "fp32"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setattr(peak_module, "CACHE", tmp_path)
    monkeypatch.setattr(peak_module.time, "sleep", lambda s: None)
    return tmp_path / "cpu_peak.json"


def test_a_busy_measurement_is_retaken_and_not_cached(cache, monkeypatch):
    """More threads no faster than one: contention. Re-measured; never cached while so."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    speeds = iter([50e9, 50e9, 52e9, 50e9, 55e9, 50e9])  # 2 threads, 1 thread, per round
    monkeypatch.setattr(peak_module, "_best_of", lambda size, dtype, threads: next(speeds))
    peak = peak_module.peak_flops(CPU, "fp32")
    assert peak.flops == 55e9 and "implausible after 3 rounds" in peak.source
    assert not cache.exists()


def test_a_plausible_measurement_is_stamped_cached_and_forgettable(cache, monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    speeds = iter([60e9, 80e9, 150e9, 80e9])  # a busy first round, a good second
    monkeypatch.setattr(peak_module, "_best_of", lambda size, dtype, threads: next(speeds))
    peak = peak_module.peak_flops(CPU, "fp32")
    assert peak.flops == 150e9 and "150 GFLOP/s" in peak.source and "2048^2" in peak.source
    (entry,) = json.loads(cache.read_text()).values()
    assert entry["stamp"] == peak_module.STAMP and entry["plausible"] and entry["measured_at"]
    assert peak_module.peak_flops(CPU, "fp32").flops == 150e9  # from the cache, not measured
    peak_module.forget("fp32")
    assert json.loads(cache.read_text()) == {}


def test_an_unstamped_entry_of_an_older_version_is_measured_again(cache, monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    cache.write_text(json.dumps({peak_module._key("fp32"): 59e9}))  # the old format: a number
    monkeypatch.setattr(peak_module, "_best_of", lambda size, dtype, threads: 100e9)
    assert peak_module.peak_flops(CPU, "fp32").flops == 100e9
