"""What metric collection costs a training step: metrics on vs off, side by side in one run.

One Trainer per layout (the debug flavor, seq_len 128, global batch 16) alternates blocks of 10
steps with metrics off, at the default (probes on every step, the processor and the JSONL and
TensorBoard sinks once per block, as with log_interval 10) and logging every step. The block
order rotates every round. Because this machine is noisy, a mode's cost is the median over rounds
of its time per step over the same round's "off" time (paired, so slow drifts of the machine
cancel). One log line (processor, its all-gather, the sinks) is also timed directly. Layouts: one
rank, and two ranks with dp_shard 2 x ep 2 under ZeRO-2 (FSDP's collectives and the expert
all-to-alls all go through the communication timer). `benchmarks/metrics_overhead_worker.py`
runs on each rank.

Usage: python benchmarks/metrics_overhead.py [--rounds R] [--block B]
"""

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from cpu import cpu_label  # noqa: E402  (benchmarks/cpu.py)
from launch_workers import REPO, torchrun_workers

LAYOUTS = {
    "1 rank": (1, []),
    "2 ranks, dp_shard 2 x ep 2, ZeRO-2": (
        2,
        ["parallel.dp_shard=2", "parallel.ep=2", "parallel.zero_stage=2"],
    ),
}


def run_layout(root: Path, nproc: int, overrides: list[str], args) -> dict[str, list[float]]:
    spec = {
        "overrides": [
            f"run.root={root}",
            f"run.name=bench-{nproc}",
            "train.steps=1000000",
            "train.seq_len=128",
            "train.micro_batch_size=8",
            "train.global_batch_size=16",
            "checkpoint.enable=false",
            *overrides,
        ],
        "block": args.block,
        "rounds": args.rounds,
        "warmup": 5,
    }
    out = root / f"result-{nproc}.json"
    worker = REPO / "benchmarks" / "metrics_overhead_worker.py"
    threads = max(1, 2 // nproc)
    torchrun_workers(
        nproc, worker, str(out), json.dumps(spec), threads=threads, what=f"{nproc} ranks"
    )
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--block", type=int, default=10)
    args = parser.parse_args()
    print(f"CPU: {cpu_label()}")
    with tempfile.TemporaryDirectory() as tmp:
        for layout, (nproc, overrides) in LAYOUTS.items():
            seconds = run_layout(Path(tmp), nproc, overrides, args)
            log_line = statistics.median(seconds.pop("log_line"))
            accounting = seconds.pop("accounting")
            off = seconds["off"]
            print(f"\n{layout}: {args.rounds} rounds of {args.block}-step blocks")
            print(f"{'mode':<12} {'ms/step':>9} {'vs off (paired median)':>24}")
            for mode, values in seconds.items():
                ratio = statistics.median(v / o for v, o in zip(values, off, strict=True))
                ms = 1000 * statistics.median(values)
                print(f"{mode:<12} {ms:>9.1f} {ratio:>15.3f} ({100 * (ratio - 1):+.1f}%)")
            step = statistics.median(off)
            _print_accounting(accounting, log_line, step, args.block)


def _print_accounting(a: dict, log_line: float, step: float, block: int) -> None:
    """The cost counted directly, which the noise of the side-by-side figures cannot hide."""
    probes = a["phase_spans"] * a["phase_s"] + a["comm_spans"] * a["wrapper_s"]
    print(
        f"accounting: {a['phase_spans']:.0f} phase spans x {1e6 * a['phase_s']:.1f} us + "
        f"{a['comm_spans']:.0f} timed collectives x {1e6 * a['wrapper_s']:.1f} us per step = "
        f"{1e3 * probes:.2f} ms ({100 * probes / step:.2f}% of a step); one log line "
        f"(processor + all-gather + JSONL + TensorBoard) {1e3 * log_line:.1f} ms = "
        f"{100 * log_line / (block * step):.2f}% of a {block}-step interval"
    )


if __name__ == "__main__":
    main()
