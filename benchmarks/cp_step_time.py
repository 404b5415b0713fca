"""Context parallelism on the CPU: cp 2 against one process on a long sequence, side by side.

The same run (the debug flavor, `data.source=embedded`, one sequence of `--seq` tokens per
micro-batch, 2 micro-batches a step) three ways, one after the other: one process (cp 1, two
intra-op threads: the machine's two cores), cp 2 (two ranks, one thread each) and dp 2 for
comparison (two ranks, the same global batch split by sequence). From each run's metrics.jsonl
after `--warmup` steps: the median step time, tokens/s, the exposed communication share of the
step (`comm/exposed_fraction`, from the trainer's own comm timer), the bytes per step on the cp
axis (`comm/cp/bytes_per_step`: the latent gathers, their reduce-scatters and, with dp_shard 1,
the gradients' reduction over the same ranks) and the largest rank's peak RSS.

    python benchmarks/cp_step_time.py [--seq 4096] [--steps 4] [--warmup 2]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.cpu import cpu_label

MiB = 2**20


def run(name: str, root: Path, ranks: int, threads: int, seq: int, steps: int, extra: list[str]):
    overrides = [
        "data.source=embedded",
        f"data.cache_dir={root / 'cache'}",
        f"run.root={root / 'runs'}",
        f"run.name={name}",
        f"train.seq_len={seq}",
        f"model.max_seq_len={seq}",
        f"model.original_seq_len={seq}",
        "train.micro_batch_size=1",
        "train.global_batch_size=2",
        f"train.steps={steps}",
        "metrics.log_interval=1",
        "metrics.tensorboard=false",
        "checkpoint.enable=false",
        *extra,
    ]
    command = [sys.executable, "-m", "dstrain", "train", "--fresh", "--nproc", str(ranks)]
    for override in overrides:
        command += ["--set", override]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"{name} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    lines = (root / "runs" / name / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if '"time/step_s"' in line]


def summary(metrics: list[dict], warmup: int) -> dict[str, float]:
    timed = metrics[warmup:]
    return {
        "step_s": statistics.median(m["time/step_s"] for m in timed),
        "tokens_per_s": statistics.median(m["throughput/tokens_per_s"] for m in timed),
        "comm": statistics.median(m.get("comm/exposed_fraction", 0.0) for m in timed),
        "cp_bytes": statistics.median(m.get("comm/cp/bytes_per_step", 0.0) for m in timed),
        "rss_mb": max(m["memory/peak_rss_mb"] for m in timed),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    opts = parser.parse_args()
    print(f"CPU: {cpu_label()}")
    layouts = {
        "cp1": (1, 2, []),
        "cp2": (2, 1, ["parallel.cp=2"]),
        "dp2": (2, 1, ["parallel.dp_shard=2"]),
    }
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (ranks, threads, extra) in layouts.items():
            metrics = run(
                name, Path(tmp), ranks, threads, opts.seq, opts.warmup + opts.steps, extra
            )
            results[name] = summary(metrics, opts.warmup)
    base = results["cp1"]["step_s"]
    print(f"seq {opts.seq}, 2 sequences a step, median of {opts.steps} steps after {opts.warmup}")
    print("| layout | step s | vs cp1 | tok/s | exposed comm | cp bytes/step | peak RSS MB |")
    print("|---|---|---|---|---|---|---|")
    for name, r in results.items():
        print(
            f"| {name} | {r['step_s']:.2f} | {base / r['step_s']:.2f}x | {r['tokens_per_s']:,.0f} "
            f"| {r['comm']:.0%} | {r['cp_bytes'] / MiB:,.1f} MiB | {r['rss_mb']:,.0f} |"
        )


if __name__ == "__main__":
    main()
