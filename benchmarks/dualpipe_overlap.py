"""DualPipeV with and without the overlapped pairs (`parallel.pp_overlap`), side by side.

DeepSeek-V3's layout in small on 4 gloo ranks: pp2 x dp2 with ep2 folded over dp, dualpipev,
ZeRO-1, the debug model (4 MoE layers), seq_len 128, micro-batches of 2, global batch 16 (4
micro-batches per pipeline step: DualPipeV's minimum at pp2). Each round trains the same run twice
through `dstrain train --nproc 4`, overlap off then on, and reads the trainer's own metrics:
step time, exposed communication (all axes, and ep alone) and the measured bubble, as medians
over the steps after the first `--warmup`. Rounds repeat and the medians of the per-round on/off
ratios are reported.

What this CPU can and cannot show: 4 ranks share 2 cores, and gloo runs each collective on a
thread of its own on those cores; the overlap hides a chunk's all-to-all behind the other chunk's
compute only as far as a core is free for the collective's thread. On GPUs NCCL runs on its own
stream and the overlap is what DualPipe was built for; nothing here measures that.

Usage: python benchmarks/dualpipe_overlap.py [--steps N] [--warmup W] [--rounds R]
(about 4 minutes with the defaults)
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from cpu import cpu_label
from parallel_layouts import make_corpus

LAYOUT = [
    "parallel.pp=2",
    "parallel.dp_shard=2",
    "parallel.ep=2",
    "parallel.zero_stage=1",
    "parallel.pp_schedule=dualpipev",
    "parallel.num_virtual_stages=2",
    "train.seq_len=128",
    "train.micro_batch_size=2",
    "train.global_batch_size=16",
    "metrics.log_interval=1",
    "metrics.tensorboard=false",
    "checkpoint.enable=false",
    "eval.fraction=0",
]
FIGURES = {
    "step s": "time/step_s",
    "comm exposed": "comm/exposed_fraction",
    "ep exposed": "comm/ep/exposed_fraction",
    "bubble": "pipeline/bubble_fraction",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12, help="steps per run")
    parser.add_argument("--warmup", type=int, default=3, help="first steps left out")
    parser.add_argument("--rounds", type=int, default=3, help="off/on pairs")
    a = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        corpus = make_corpus(root)
        rows = {"off": [], "on": []}
        print(f"4 ranks on {cpu_label()}", flush=True)
        for round_ in range(a.rounds):
            for state in ("off", "on"):
                name = f"{state}{round_}"
                overrides = [
                    *LAYOUT,
                    f"parallel.pp_overlap={'true' if state == 'on' else 'false'}",
                    f"train.steps={a.steps}",
                    f"data.source={corpus}",
                    f"data.cache_dir={root / 'cache'}",
                    f"run.root={root / 'runs'}",
                    f"run.name={name}",
                ]
                print(f"round {round_ + 1}/{a.rounds}: overlap {state} ...", flush=True)
                _train(overrides)
                rows[state].append(_medians(root / "runs" / name / "metrics.jsonl", a.warmup))
    _report(rows)


def _train(overrides: list[str]) -> None:
    command = [sys.executable, "-m", "dstrain", "train", "--nproc", "4", "--fresh"]
    for item in overrides:
        command += ["--set", item]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"training failed:\n{done.stderr[-3000:]}")


def _medians(metrics: Path, warmup: int) -> dict[str, float]:
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = [line for line in lines if line.get("step", 0) > warmup and "time/step_s" in line]
    return {
        label: statistics.median(line.get(key, 0.0) for line in steps)
        for label, key in FIGURES.items()
    }


def _report(rows: dict[str, list[dict[str, float]]]) -> None:
    print(f"\n{'':14}" + "".join(f"{label:>14}" for label in FIGURES))
    for state in ("off", "on"):
        medians = {k: statistics.median(r[k] for r in rows[state]) for k in FIGURES}
        print(f"overlap {state:6}" + "".join(f"{medians[k]:14.3f}" for k in FIGURES))
    ratios = {
        k: statistics.median(
            on[k] / off[k] for off, on in zip(rows["off"], rows["on"], strict=True) if off[k]
        )
        for k in FIGURES
    }
    print(f"{'on / off':14}" + "".join(f"{ratios[k]:13.2f}x" for k in FIGURES))


if __name__ == "__main__":
    main()
