"""How long `dstrain plan`'s full search takes: DeepSeek-V3 on 2048 H800 (the issue's case) and
two smaller ones, each the median of R fresh runs (caches cleared by a new process each time),
as the whole command a user runs, with the bare `python -c pass` start-up beside it.

Usage: python benchmarks/plan_search.py [--rounds R]
"""

import argparse
import statistics
import subprocess
import sys
import time

from cpu import cpu_label  # noqa: E402  (benchmarks/cpu.py)

CASES = {
    "deepseek-v3 on 2048 H800": ["--model", "deepseek-v3", "--gpu", "H800", "--num-gpus", "2048"],
    "deepseek-v2-lite on 64 H100": [
        "--model",
        "deepseek-v2-lite",
        "--gpu",
        "H100",
        "--num-gpus",
        "64",
    ],
    "deepseek-llm-7b on 16 A100-80GB": [
        "--model",
        "deepseek-llm-7b",
        "--gpu",
        "A100-80GB",
        "--num-gpus",
        "16",
    ],
}


def seconds(command: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run(command, check=True, capture_output=True)
    return time.perf_counter() - started


def main() -> None:
    print(f"CPU: {cpu_label()}")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    rounds = parser.parse_args().rounds
    bare = statistics.median(seconds([sys.executable, "-c", "pass"]) for _ in range(rounds))
    print(f"{'case':<34} {'plan, s':>8} {'python start-up, s':>19} {'ratio':>7}")
    for name, flags in CASES.items():
        command = [sys.executable, "-m", "dstrain", "plan", *flags, "--json"]
        took = statistics.median(seconds(command) for _ in range(rounds))
        print(f"{name:<34} {took:>8.2f} {bare:>19.3f} {took / bare:>7.0f}x")


if __name__ == "__main__":
    main()
