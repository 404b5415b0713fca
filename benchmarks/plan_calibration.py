"""`dstrain plan --calibrate` closing the loop on CPU: the parity-matrix layouts trained on this
machine (debug model, 30 steps each, 2 gloo ranks), then the planner's constants fitted to them,
and per layout the model-state memory and step time measured against predicted, with the
default constants and with the fitted ones.

Usage: python benchmarks/plan_calibration.py [--steps N] [--keep DIR]
"""

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from cpu import cpu_label  # noqa: E402  (benchmarks/cpu.py)

REPO = Path(__file__).resolve().parents[1]
LAYOUTS = {
    "one": (1, []),
    "ddp": (2, ["parallel.dp_replicate=2", "parallel.zero_stage=0"]),
    "zero1": (2, ["parallel.dp_shard=2", "parallel.zero_stage=1", "checkpoint.enable=false"]),
    "fsdp": (2, ["parallel.dp_shard=2", "parallel.zero_stage=2"]),
    "zero3": (2, ["parallel.dp_shard=2", "parallel.zero_stage=3"]),
    "tp2": (2, ["parallel.tp=2"]),
    "ep2": (2, ["parallel.dp_shard=2", "parallel.ep=2", "parallel.zero_stage=2"]),
    "pp2": (2, ["parallel.pp=2", "train.global_batch_size=32", "train.micro_batch_size=8"]),
}


def train(root: Path, name: str, nproc: int, sets: list[str], steps: int) -> Path:
    overrides = [
        f"run.root={root}",
        f"run.name={name}",
        f"train.steps={steps}",
        "metrics.log_interval=5",
        "checkpoint.enable=false",
        *sets,
    ]
    command = [sys.executable, "-m", "dstrain", "train", "--nproc", str(nproc)]
    command += [a for o in overrides for a in ("--set", o)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO)
    if done.returncode != 0:
        raise SystemExit(f"{name} failed:\n{done.stderr[-3000:]}")
    return root / name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--keep", type=Path, help="keep the run directories here")
    args = parser.parse_args()
    print(f"CPU: {cpu_label()}")
    with tempfile.TemporaryDirectory() as tmp:
        root = args.keep or Path(tmp)
        runs = [train(root, name, n, sets, args.steps) for name, (n, sets) in LAYOUTS.items()]
        command = [sys.executable, "-m", "dstrain", "plan", "--calibrate", *map(str, runs)]
        subprocess.run(command, check=True, cwd=REPO, env={**os.environ, "COLUMNS": "160"})


if __name__ == "__main__":
    main()
