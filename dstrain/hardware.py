"""The accelerator and network table shared by `plan`, `check` and the MFU metric.

Peaks are dense (no sparsity) tensor-core figures from the vendors' datasheets; link bandwidths are
per GPU and per direction. Nothing else in dstrain may hard-code a peak.
"""

from dataclasses import dataclass

from dstrain.config.suggest import did_you_mean
from dstrain.errors import UserError


@dataclass(frozen=True)
class GPUSpec:
    """One accelerator. TFLOP/s are dense peaks; None means the format is not supported."""

    name: str
    bf16_tflops: float | None
    fp16_tflops: float
    fp8_tflops: float | None
    fp32_tflops: float
    tf32_tflops: float | None  # dense TF32 on tensor cores; None: no TF32 (pre-Ampere)
    hbm_gb: float
    hbm_tbps: float
    intra_node_gbps: float  # per GPU, one direction (NVLink / Infinity Fabric / PCIe)
    intra_node_link: str
    # the architecture whose kernel measurements apply (`planner/kernels.py`): volta, ampere,
    # hopper, blackwell, ada, cdna2, cdna3; "cpu" for a run's own CPU
    arch: str = "other"
    # the share of its architecture's measured kernel speed a power-capped part keeps (1 at the
    # rated power the measurements were taken at)
    power_share: float = 1.0

    @property
    def supports_bf16(self) -> bool:
        return self.bf16_tflops is not None

    def peak_tflops(self, precision: str) -> float:
        """Dense peak for a training precision (`bf16`, `fp16`, `fp8`, `fp32`, `tf32`)."""
        peak = {
            "bf16": self.bf16_tflops,
            "fp16": self.fp16_tflops,
            "fp8": self.fp8_tflops,
            "fp32": self.fp32_tflops,
            "tf32": self.tf32_tflops,
        }[precision]
        if peak is None:
            raise UserError(
                f"{self.name} has no {precision} tensor cores",
                "choose a precision it supports (fp16 on V100)",
                exit_code=1,
            )
        return peak


# The GPUs whose FP8 tensor cores run DeepSeek's blockwise recipe (1x128 x 128x128 scales)
# through torch's `scaled_mm`: SM90, with CUDA >= 12.9. Not SM100 (B200) in eager in torch 2.13,
# nor SM89 (RTX 4090), which have FP8 but not this kernel.
BLOCKWISE_FP8_GPUS = frozenset({"H100", "H100-96GB-500W", "H800", "H200"})

GPUS: dict[str, GPUSpec] = {
    spec.name.lower(): spec
    for spec in (
        GPUSpec("V100", None, 125.0, None, 15.7, None, 32, 0.90, 150, "NVLink2", "volta"),
        GPUSpec("A100-40GB", 312.0, 312.0, None, 19.5, 156.0, 40, 1.555, 300, "NVLink3", "ampere"),
        GPUSpec("A100-80GB", 312.0, 312.0, None, 19.5, 156.0, 80, 2.039, 300, "NVLink3", "ampere"),
        GPUSpec("H100", 989.0, 989.0, 1979.0, 67.0, 494.7, 80, 3.35, 450, "NVLink4", "hopper"),
        GPUSpec(
            "H800", 989.0, 989.0, 1979.0, 67.0, 494.7, 80, 3.35, 200, "NVLink4 (export)", "hopper"
        ),
        # Meta's Grand Teton H100 (torchtitan's benchmarks): 96 GB of HBM2e at 2.4 TB/s, capped
        # at 500 W. At that cap FBGEMM measured 585.2 TFLOP/s for a bf16 8192^3 GEMM
        # (pytorch/FBGEMM#2546) against 797.5 on a 700 W H100 SXM (0.73).
        GPUSpec(
            "H100-96GB-500W",
            989.0,
            989.0,
            1979.0,
            67.0,
            494.7,
            96,
            2.4,
            450,
            "NVLink4",
            "hopper",
            0.73,
        ),
        GPUSpec("H200", 989.0, 989.0, 1979.0, 67.0, 494.7, 141, 4.8, 450, "NVLink4", "hopper"),
        GPUSpec(
            "B200", 2250.0, 2250.0, 4500.0, 80.0, 1100.0, 180, 8.0, 900, "NVLink5", "blackwell"
        ),
        GPUSpec("RTX4090", 165.2, 165.2, 330.3, 82.6, 82.6, 24, 1.008, 32, "PCIe4 x16", "ada"),
        GPUSpec("L40S", 362.0, 362.0, 733.0, 91.6, 183.0, 48, 0.864, 32, "PCIe4 x16", "ada"),
        GPUSpec(
            "MI250X", 383.0, 383.0, None, 47.9, None, 128, 3.2, 200, "Infinity Fabric", "cdna2"
        ),
        GPUSpec(
            "MI300X",
            1307.0,
            1307.0,
            2615.0,
            163.4,
            653.7,
            192,
            5.3,
            448,
            "Infinity Fabric",
            "cdna3",
        ),
    )
}

_ALIASES = {
    "a100": "a100-80gb",
    "a100-40g": "a100-40gb",
    "a100-80g": "a100-80gb",
    "h100-sxm": "h100",
    "h100-80gb": "h100",
    "rtx-4090": "rtx4090",
    "4090": "rtx4090",
    "v100-32gb": "v100",
    "v100-sxm2": "v100",
}

# Inter-node presets: per-GPU bandwidth in GB/s, one direction, assuming one NIC per GPU.
NETWORKS: dict[str, float] = {
    "ib-hdr": 25.0,  # 200 Gb/s HDR InfiniBand
    "ib-ndr": 50.0,  # 400 Gb/s NDR InfiniBand
    "roce-200": 25.0,
    "roce-400": 50.0,
    "eth-100": 12.5,
}


def gpu_spec(name: str) -> GPUSpec:
    """Look a GPU up by name, case-insensitively; an unknown name lists the known ones."""
    key = name.strip().lower().replace("_", "-").replace(" ", "-")
    key = _ALIASES.get(key, key)
    if key in GPUS:
        return GPUS[key]
    names = [spec.name for spec in GPUS.values()]
    raise UserError(
        f"unknown GPU `{name}`{did_you_mean(name, names)}",
        f"use one of: {', '.join(names)}",
        exit_code=1,
    )


def gpu_from_device_name(device_name: str) -> GPUSpec | None:
    """The table entry for a name as the driver reports it ("NVIDIA A100-SXM4-40GB",
    "NVIDIA H100 80GB HBM3", "AMD Instinct MI250X"), or None when it is not in the table."""
    name = device_name.upper().replace(" ", "").replace("-", "")
    for family in ("H800", "H200", "H100", "B200", "V100", "L40S", "MI250X", "MI300X", "4090"):
        if family in name:
            return GPUS["rtx4090" if family == "4090" else family.lower()]
    if "A100" in name:
        return GPUS["a100-40gb" if "40G" in name else "a100-80gb"]
    return None


def network_gbps(preset: str) -> float:
    key = preset.strip().lower()
    if key in NETWORKS:
        return NETWORKS[key]
    raise UserError(
        f"unknown network preset `{preset}`{did_you_mean(preset, NETWORKS)}",
        f"use one of {', '.join(NETWORKS)}, or set cluster.inter_node_gbps",
        exit_code=1,
    )
