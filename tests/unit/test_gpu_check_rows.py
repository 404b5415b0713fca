"""The prepared GPU check's kernel rows (`benchmarks/gpu_check_kernels.py`) on CPU: a kernel that
cannot run skips with its reason; one that runs is compared with a different path, so a kernel
that is off, or raises, fails its row. The kernels are stood in for on CPU by the reference
itself, perturbed or not: that is how a row that compared a path with itself would be caught."""

import sys
from collections.abc import Callable

import pytest
import torch

from dstrain.model import fp8, moe
from tests.conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import gpu_check  # noqa: E402
import gpu_check_kernels as rows  # noqa: E402

CPU = torch.device("cpu")
SMALL = ((2, 200, 300), 130)  # 128 divides neither the tokens nor K
F = torch.nn.functional


@pytest.fixture
def table() -> gpu_check.Table:
    return gpu_check.Table({"torch": "", "cuda": "", "gpu": "", "capability": "", "driver": ""})


@pytest.fixture(autouse=True)
def small(monkeypatch):
    monkeypatch.setattr(rows, "COUNTS", (0, 1, 3, 2))
    monkeypatch.setattr(rows, "MATMUL_SHAPES", [SMALL])
    monkeypatch.setattr(rows, "GROUPED_SHAPES", [(48, 64)])


def fake_kernels(
    monkeypatch, off: float = 1.0, raises: bool = False, falls_back: bool = False
) -> list[str]:
    """Pretend this CPU runs the kernels: each "kernel" is its reference times `off` (or raises);
    the FP8 one calls `scaled_mm` (a stub here) as the real one does, once in forward and twice
    in backward, unless it `falls_back`. Returns the backends the FP8 rows called, and
    "grouped_mm" for each grouped_mm call."""
    calls: list[str] = []
    fp8_matmul, fp8_grouped, grouped_mm = fp8.fp8_matmul, moe.fp8_grouped_matmul, F.grouped_mm

    def kernel(real: Callable, *args):
        calls.append(args[-1])
        if args[-1] != "scaled_mm":
            return real(*args)
        if raises:
            raise RuntimeError("scaled_mm failed")
        y = real(*args[:-1], "emulated") * off
        if not falls_back:
            F.scaled_mm()
            y.register_hook(backward_gemms)
        return y

    def backward_gemms(grad) -> None:  # dgrad and wgrad
        F.scaled_mm()
        F.scaled_mm()

    def grouped_kernel(x, w, offs):
        calls.append("grouped_mm")
        if raises:
            raise RuntimeError("grouped_mm failed")
        return grouped_mm(x, w, offs=offs) * off

    monkeypatch.setattr(fp8, "blockwise_kernel_reason", lambda device: None)
    monkeypatch.setattr(rows, "grouped_mm_reason", lambda device: None)
    monkeypatch.setattr(fp8, "fp8_matmul", lambda *args: kernel(fp8_matmul, *args))
    monkeypatch.setattr(moe, "fp8_grouped_matmul", lambda *args: kernel(fp8_grouped, *args))
    monkeypatch.setattr(F, "scaled_mm", lambda *args, **kwargs: None)
    monkeypatch.setattr(F, "grouped_mm", grouped_kernel)
    # blockwise_mm on fresh operands: not faked (its kernel is the one fp8_matmul calls)
    monkeypatch.setattr(rows, "compare_fp8_fresh", lambda device: (0.0, "not faked"))
    monkeypatch.setattr(rows, "_fp8_speed", lambda device: "not measured")
    return calls


def matmul_rows(table) -> list[gpu_check.Row]:
    return [
        r for r in table.rows if r.kernel in (rows.FP8, rows.GROUPED) and "fresh" not in r.check
    ]


def test_on_cpu_every_kernel_row_skips_with_its_reason(table):
    rows.check_kernels(table, CPU)
    kernel_rows = [r for r in table.rows if r.kernel]
    assert len(kernel_rows) == 1 + 1 + 2 * 1 + 1 + 1, [r.check for r in table.rows]
    for row in kernel_rows:
        assert row.verdict == "skip", row
        assert row.detail.startswith("cpu"), row
    assert not table.failed


def test_a_kernel_that_agrees_with_its_reference_passes(table, monkeypatch):
    calls = fake_kernels(monkeypatch)
    rows.check_kernels(table, CPU)
    checked = matmul_rows(table)
    assert [r.verdict for r in checked] == ["ok"] * 3, checked
    # Each row ran its kernel and a different reference: never one path twice.
    assert calls.count("scaled_mm") == calls.count("emulated") == 2
    assert calls.count("grouped_mm") == 1


@pytest.mark.parametrize("off", [1.05, 0.0])
def test_a_row_fails_when_its_kernel_differs_from_the_reference(table, monkeypatch, off):
    """Would pass, wrongly, if a row compared a path with itself (the fallback with the
    fallback, as the check did when the kernel could not run)."""
    fake_kernels(monkeypatch, off=off)
    rows.check_kernels(table, CPU)
    assert [r.verdict for r in matmul_rows(table)] == ["FAIL"] * 3
    assert table.failed


def test_a_kernel_path_that_falls_back_to_the_reference_fails(table, monkeypatch):
    """The "kernel" agrees exactly, but never called scaled_mm: it was the emulation (what the
    training falls back to, and what the check used to compare with itself)."""
    fake_kernels(monkeypatch, falls_back=True)
    rows.check_kernels(table, CPU)
    fp8_rows = [r for r in matmul_rows(table) if r.check.startswith("fp8")]
    assert len(fp8_rows) == 2
    for row in fp8_rows:
        assert row.verdict == "FAIL" and "fell back" in row.detail, row


def test_a_kernel_that_raises_fails_its_row(table, monkeypatch):
    fake_kernels(monkeypatch, raises=True)
    rows.check_kernels(table, CPU)
    for row in matmul_rows(table):
        assert row.verdict == "FAIL" and "RuntimeError" in row.detail, row


def test_the_bf16_grouped_row_passes_on_the_real_cpu_kernel(table, monkeypatch):
    """torch's own grouped_mm runs bf16 on CPU too: the row's tolerance holds for a real kernel
    against the fp32 loop, with an expert of no rows."""
    gap, detail = rows.compare_grouped_mm(CPU, 48, 64)
    assert gap <= rows.TOLERANCE, detail


def test_the_header_names_cuda_gpu_and_driver_on_cpu():
    facts = gpu_check.platform_facts()
    assert facts["torch"] == torch.__version__
    assert facts["cuda"] == (torch.version.cuda or "none")
    if not torch.cuda.is_available():
        assert facts["gpu"] == "none" and facts["capability"] == "none"
    assert facts["driver"]
