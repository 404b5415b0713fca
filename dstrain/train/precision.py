"""What the run's precision means on its device, decided once before the first step: the checks
a device can fail, TF32 for fp32 on Ampere or newer GPUs, and the peak MFU is counted against.

- bf16 needs tensor cores that have it: compute capability 8.0 (Ampere) or newer on CUDA.
- fp16 on a CPU: its matmuls run at a fraction of a GFLOP/s on most CPUs (TORCH-CPU-NOTES:
  ~0.3 GFLOP/s even with AVX512-BF16), so only tiny models (test-sized) are allowed there.
- fp32 on Ampere or newer runs its matmuls as TF32 unless `train.tf32 = false` (PyTorch's own
  default is off; Megatron and torchtitan turn it on): MFU then counts against the TF32 peak.
- A GPU run in fp32 gets a warning: bf16 is what large runs use.
- fp8 picks its GEMM backend (`model/fp8.py: choose_backend`): cuBLASLt's blockwise kernel on
  SM90, the emulation on a CPU (MFU then counts against the CPU's fp32 peak, what the emulation
  computes in), an error on other GPUs unless `train.fp8_backend = emulated` (then a warning).
"""

from dataclasses import dataclass

import torch

from dstrain.config.model_args import ModelArgs
from dstrain.errors import UserError
from dstrain.model.flops import param_counts
from dstrain.model.fp8 import choose_backend

# The largest model fp16 may train on a CPU: the test-sized ones (the debug flavor is 1.85M).
CPU_FP16_MAX_PARAMS = 5_000_000


@dataclass(frozen=True)
class PrecisionSetup:
    precision: str
    tf32: bool  # fp32 matmuls run as TF32
    peak_kind: str  # the hardware table's column MFU counts against: fp32, tf32, bf16, fp16
    warning: str | None  # logged at start-up
    fp8_backend: str | None = None  # fp8 only: "scaled_mm" or "emulated"

    def describe(self) -> str:
        if self.fp8_backend == "scaled_mm":
            return "fp8 (DeepSeek-V3 blockwise E4M3 through cuBLASLt scaled_mm; the rest bf16)"
        if self.fp8_backend == "emulated":
            return "fp8 (DeepSeek-V3 blockwise E4M3, emulated in plain torch; the rest bf16)"
        return f"{self.precision} with TF32 matmuls" if self.tf32 else self.precision


def configure_precision(
    precision: str,
    tf32: bool | None,
    device: torch.device,
    args: ModelArgs,
    fp8_backend: str = "auto",
) -> PrecisionSetup:
    """Check `precision` against `device` (a UserError before anything runs) and set TF32."""
    if precision == "fp8":
        return _fp8(tf32, device, fp8_backend)
    if device.type == "cuda":
        return _on_gpu(precision, tf32, device)
    if tf32:
        raise UserError(
            f"train.tf32 = true, but this run is on {device.type}: TF32 exists on CUDA tensor "
            "cores only",
            "leave train.tf32 unset (it turns on by itself on Ampere or newer GPUs)",
            exit_code=1,
        )
    params = param_counts(args).total
    if precision == "fp16" and device.type == "cpu" and params > CPU_FP16_MAX_PARAMS:
        raise UserError(
            f"fp16 on the CPU with {params / 1e6:.1f}M parameters: CPUs compute fp16 matmuls "
            "hundreds of times slower than fp32, and this would not finish",
            "use train.precision = bf16 (fast with AVX512-BF16 or AMX) or fp32 on CPUs; fp16 "
            f"runs only models up to {CPU_FP16_MAX_PARAMS / 1e6:.0f}M parameters there (tests)",
            exit_code=1,
        )
    return PrecisionSetup(precision, False, precision, None)


def _on_gpu(precision: str, tf32: bool | None, device: torch.device) -> PrecisionSetup:
    major, minor = torch.cuda.get_device_capability(device)
    ampere = major >= 8
    name = torch.cuda.get_device_name(device)
    if precision == "bf16" and not ampere:
        raise UserError(
            f"bf16 on {name} (compute capability {major}.{minor}): bf16 tensor cores start at "
            "8.0 (Ampere)",
            "use train.precision = fp16 (with loss scaling) on this GPU",
            exit_code=1,
        )
    if tf32 and not ampere:
        raise UserError(
            f"train.tf32 = true on {name} (compute capability {major}.{minor}): TF32 starts at "
            "8.0 (Ampere)",
            "leave train.tf32 unset",
            exit_code=1,
        )
    if precision != "fp32":
        return PrecisionSetup(precision, False, precision, None)
    use_tf32 = ampere if tf32 is None else tf32
    torch.backends.cuda.matmul.allow_tf32 = use_tf32
    torch.backends.cudnn.allow_tf32 = use_tf32
    warning = (
        "train.precision is fp32 on a GPU: large runs train in bf16 (about twice the matmul "
        "speed of TF32, half the activation memory); --set train.precision=bf16"
    )
    return PrecisionSetup(precision, use_tf32, "tf32" if use_tf32 else "fp32", warning)


def _fp8(tf32: bool | None, device: torch.device, requested: str) -> PrecisionSetup:
    if tf32:
        raise UserError(
            "train.tf32 = true with train.precision = fp8: fp8 runs its other matmuls in bf16",
            "leave train.tf32 unset",
            exit_code=1,
        )
    backend = choose_backend(requested, device)
    warning = None
    if backend == "emulated" and device.type == "cuda":
        warning = (
            "train.fp8_backend = emulated on a GPU: FP8 numerics by the exact plain-torch "
            "emulation, several times slower than bf16; for speed use an SM90 GPU or bf16"
        )
    peak = "fp8" if backend == "scaled_mm" else ("bf16" if device.type == "cuda" else "fp32")
    return PrecisionSetup("fp8", False, peak, warning, backend)
