"""The CPU a benchmark ran on, printed at the top of its output: speed figures on these machines
mean nothing without it (bf16 and fp16 matmuls are ~45x slower than fp32 without AVX512-BF16)."""

import platform
from pathlib import Path

FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


def cpu_label() -> str:
    """`lscpu`'s model name and the vector flags that decide matmul speed, e.g. 'AMD EPYC
    (family 25 model 17), 2 cores, flags avx2 avx512f avx512_bf16'."""
    info = Path("/proc/cpuinfo")
    if not info.exists():
        return platform.processor() or platform.machine()
    fields: dict[str, str] = {}
    cores = 0
    for line in info.read_text().splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "processor":
            cores += 1
        fields.setdefault(key, value.strip())
    flags = set(fields.get("flags", "").split())
    shown = " ".join(f for f in FLAGS if f in flags) or "no AVX2"
    model = fields.get("model name", platform.machine())
    family = f"family {fields.get('cpu family', '?')} model {fields.get('model', '?')}"
    return f"{model} ({family}), {cores} cores, flags {shown}"


if __name__ == "__main__":
    print(cpu_label())
