"""How fast is `dstrain check`? Side by side in one run, on the same machine:

- the whole command (`python -m dstrain check CONFIG --json`) vs a bare interpreter start
  (`python -c pass`), so the ratio shows what dstrain adds on top of Python itself;
- the pre-flight alone, in-process (load + every rule), in milliseconds.

Usage: python benchmarks/check_latency.py [CONFIG] [--world-size N] [--repeats R]
"""

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

from cpu import cpu_label  # noqa: E402  (benchmarks/cpu.py)

from dstrain.interop.load import load_any
from dstrain.preflight.preflight import preflight

REPO = Path(__file__).resolve().parents[1]
DEFAULT = REPO / "examples" / "deepseek-v3-h800x2048.toml"


def wall(cmd: list[str], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run(cmd, capture_output=True, check=False)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def in_process(config: Path, world: int, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        preflight(load_any(config), world)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", type=Path, default=DEFAULT)
    parser.add_argument("--world-size", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    print(f"CPU: {cpu_label()}")
    check = [
        sys.executable,
        "-m",
        "dstrain",
        "check",
        str(args.config),
        "--world-size",
        str(args.world_size),
        "--json",
    ]
    bare = wall([sys.executable, "-c", "pass"], args.repeats)
    full = wall(check, args.repeats)
    inner = in_process(args.config, args.world_size, args.repeats)
    print(f"config: {args.config.name}, world size {args.world_size}, median of {args.repeats}")
    print(f"  python -c pass           {bare * 1000:8.1f} ms")
    ratio = full / bare
    print(f"  dstrain check (process)  {full * 1000:8.1f} ms   ratio to bare python {ratio:5.2f}x")
    print(f"  pre-flight in-process    {inner * 1000:8.2f} ms")


if __name__ == "__main__":
    main()
