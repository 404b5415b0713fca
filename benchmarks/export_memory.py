"""Peak host memory of `dstrain ckpt export-hf` against the model it exports: one checkpoint of a
~0.3B-parameter model (1.2 GB of fp32 weights, 3.6 GB with the optimizer state), exported to
bf16 safetensors with 100 MB and with 400 MB files, each in a fresh process, beside the RSS of the
same process doing nothing but its imports. Streaming means the peak follows the file size, not
the model.

    python benchmarks/export_memory.py [--dir /tmp/dstrain-export]
"""

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

from cpu import cpu_label

MODEL = [
    "model.dim=1024",
    "model.num_layers=8",
    "model.num_heads=8",
    "model.inter_dim=4096",
    "model.moe_inter_dim=512",
    "model.num_routed_experts=16",
    "model.vocab_size=32000",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path("/tmp/dstrain-export"))
    args = parser.parse_args()
    print(f"CPU: {cpu_label()}")
    root = args.dir
    shutil.rmtree(root, ignore_errors=True)
    run = [
        "train",
        "--fresh",
        *_sets(
            [
                *MODEL,
                f"run.root={root}",
                "run.name=big",
                "train.steps=1",
                "train.seq_len=64",
                "train.micro_batch_size=2",
                "train.global_batch_size=2",
                "data.tokenizer=bytes",
                f"data.cache_dir={root / 'cache'}",
                "metrics.tensorboard=false",
            ]
        ),
    ]
    done = subprocess.run([sys.executable, "-m", "dstrain", *run], capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(done.stderr[-2000:])
    ckpt_bytes = sum(p.stat().st_size for p in (root / "big" / "checkpoints").rglob("*.distcp"))
    idle = _peak_mb([sys.executable, "-c", "import torch, dstrain.cli, dstrain.checkpoint.export"])
    print(f"checkpoint: {ckpt_bytes / 1e9:.2f} GB on disk (weights + optimizer state)")
    print(f"imports alone: peak RSS {idle:,.0f} MB")
    print("file size   files   exported GB   peak RSS MB   above imports MB   / largest file")
    for size in ("100M", "400M"):
        out = root / f"hf-{size}"
        command = [sys.executable, "-m", "dstrain", "ckpt", "export-hf", str(root / "big")]
        command += ["-o", str(out), "--shard-size", size, "--json"]
        peak, result = _peak_mb(command, capture=True)
        largest = max(p.stat().st_size for p in out.glob("*.safetensors")) / 2**20
        print(
            f"{size:>9} {result['files']:7d} {result['bytes'] / 1e9:13.2f} {peak:13,.0f} "
            f"{peak - idle:18,.0f} {(peak - idle) / largest:14.2f}x"
        )
    shutil.rmtree(root, ignore_errors=True)


def _peak_mb(command: list[str], capture: bool = False):
    """Peak RSS in MB of `command`, run as the only child of a probe process (whose
    RUSAGE_CHILDREN is then that command's own peak)."""
    probe = (
        "import json, resource, subprocess, sys; "
        "done = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
        "print(json.dumps({'rc': done.returncode, 'out': done.stdout, 'err': done.stderr[-2000:], "
        "'peak_kb': resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}))"
    )
    done = subprocess.run([sys.executable, "-c", probe, *command], capture_output=True, text=True)
    report = json.loads(done.stdout)
    if report["rc"] != 0:
        sys.exit(f"{command} failed:\n{report['err']}")
    peak = report["peak_kb"] / 1024
    if capture:
        return peak, json.loads(report["out"])
    return peak


def _sets(overrides: list[str]) -> list[str]:
    return [arg for o in overrides for arg in ("--set", o)]


if __name__ == "__main__":
    main()
