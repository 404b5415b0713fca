"""`train.compile = true` against eager, side by side in one process: two Trainers on the same
config (the debug flavor by default), compiled and not, warmed up (the compile happens there),
then alternating blocks of N steps through `trainer._one_step()`, R rounds, per precision.
Reports the median ms per step of each and the ratio (median of the paired blocks too, which
cancels slow drift on a noisy machine).

Usage: python benchmarks/compile_speed.py [--rounds R] [--block N] [--precisions fp32,bf16]
           [--threads T] [--set k=v ...]
"""

import argparse
import contextlib
import os
import statistics
import tempfile
import time

import torch
from cpu import cpu_label  # noqa: E402  (benchmarks/cpu.py)

from dstrain.config.load import load_config
from dstrain.train.trainer import Trainer


def block_seconds(trainer: Trainer, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        trainer._one_step()
    return (time.perf_counter() - start) / steps


def measure(precision: str, args: argparse.Namespace, tmp: str) -> tuple[list, list, float]:
    overrides = [
        f"run.root={tmp}/runs",
        f"data.cache_dir={tmp}/cache",
        "checkpoint.enable=false",
        f"train.precision={precision}",
        f"train.steps={(args.rounds + 2) * args.block}",
        *args.set,
    ]
    trainers = {}
    began = time.perf_counter()
    for compiled in (False, True):
        config = load_config(None, [*overrides, f"train.compile={str(compiled).lower()}"]).config
        config.run.name = f"{precision}-{'compiled' if compiled else 'eager'}"
        with open(os.devnull, "w") as null, contextlib.redirect_stderr(null):
            trainers[compiled] = Trainer(config)
    for trainer in trainers.values():  # warm-up: the compiled one compiles here
        block_seconds(trainer, args.block)
    warm = time.perf_counter() - began
    eager, compiled = [], []
    for round_ in range(args.rounds):
        order = (False, True) if round_ % 2 == 0 else (True, False)
        for which in order:
            (compiled if which else eager).append(block_seconds(trainers[which], args.block))
    return eager, compiled, warm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--block", type=int, default=5)
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--set", action="append", default=[])
    args = parser.parse_args()
    print(f"CPU: {cpu_label()}")
    torch.set_num_threads(args.threads)
    print(
        f"{args.rounds} alternating blocks of {args.block} steps, {args.threads} thread(s); "
        "median ms per step"
    )
    print(f"{'precision':10} {'eager':>8} {'compiled':>9} {'compiled/eager':>15} {'paired':>7}")
    with tempfile.TemporaryDirectory() as tmp:
        for precision in args.precisions.split(","):
            eager, compiled, warm = measure(precision, args, tmp)
            e, c = statistics.median(eager), statistics.median(compiled)
            paired = statistics.median(b / a for a, b in zip(eager, compiled, strict=True))
            print(
                f"{precision:10} {1000 * e:>8.1f} {1000 * c:>9.1f} {c / e:>15.3f} {paired:>7.3f}"
                f"   (build + warm-up incl. compile {warm:.0f} s)"
            )


if __name__ == "__main__":
    main()
