"""Measured pipeline bubble per schedule, next to the simulator and the closed form, on CPU.

For pp in {2, 4} (one torchrun launch each, running every case in turn) and every schedule, with
m in {2p, 4p, 8p} micro-batches: the debug flavor widened to 8 layers (pp4 x 2 stages per rank
needs 8), micro-batches of B sequences of seq_len 128, W warm-up steps then N timed steps. Each
row shows, side by side from the same run:

- measured: `pipeline/bubble_fraction` as the trainer logs it (1 - compute / (pp x busy
  interval), every F/B/I/W action and the loss timed on every rank, barriers around the step);
- simulated: `dstrain schedule`'s simulator on upstream's action order with the measured mean
  F, B (input-gradient half, or full backward), W costs and no p2p latency;
- theory: the closed form (`dstrain/planner/bubble.py`) with those costs;
- p2p wait: the share of pp x busy interval spent in upstream's p2p waits (part of the
  measured bubble; the rest is Python between actions and the barriers);
- imbalance: the busiest rank's compute over the mean (the last stage also runs the head, MTP
  and the loss: idle time on the others that no schedule removes);
- F/B/W: the measured mean ms per action.

The gap between measured and simulated is what the CPU adds: p2p over gloo, the schedule's
Python between actions, and (pp4) 4 ranks time-sharing 2 cores.

Usage: python benchmarks/pipeline_bubble.py [--pp 2,4] [--micro B] [--steps N] [--warmup W]
           [--schedules S,...] [--set k=v ...]
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

from launch_workers import REPO, torchrun_workers

sys.path.insert(0, str(REPO))

from cpu import cpu_label  # noqa: E402  (benchmarks/cpu.py)

from dstrain.parallel.pipeline_sim import schedule_actions, simulate  # noqa: E402
from dstrain.planner.bubble import SCHEDULES, Costs, theoretical_bubble  # noqa: E402


def launch(pp: int, spec: dict, out: Path) -> list[dict]:
    worker = REPO / "benchmarks" / "pipeline_bubble_worker.py"
    torchrun_workers(pp, worker, str(out), json.dumps(spec), what=f"pp{pp} launch")
    return json.loads(out.read_text())


def row(pp: int, figures: dict) -> str:
    f = figures["pipeline/time_f_ms"]
    b = figures.get("pipeline/time_i_ms") or figures.get("pipeline/time_b_ms", 0.0)
    w = figures.get("pipeline/time_w_ms", 0.0)
    costs = Costs(f, b, w)
    schedule, m, v = figures["schedule"], figures["m"], figures["v"]
    simulated = simulate(schedule_actions(schedule, pp, m, v), costs).bubble_fraction
    theory = theoretical_bubble(schedule, pp, m, v, costs)
    measured, wait = figures["pipeline/bubble_fraction"], figures["pipeline/p2p_wait_fraction"]
    return (
        f"| {pp} | {schedule} | {m} | {measured:.3f} | {simulated:.3f} | {theory:.3f} | "
        f"{wait:.3f} | {figures['pipeline/stage_imbalance']:.2f} | {f:.1f} / {b:.1f} / {w:.1f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pp", default="2,4")
    parser.add_argument("--micro", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--schedules", default=",".join(SCHEDULES))
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()
    print(f"CPU: {cpu_label()}")
    print(
        "| pp | schedule | m | measured | simulated | theory | p2p wait | imbalance "
        "| F / B / W ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for pp in (int(p) for p in args.pp.split(",")):
            common = [
                "data.source=embedded",
                f"run.root={tmp}/runs",
                "model.num_layers=8",
                "train.seq_len=128",
                f"train.micro_batch_size={args.micro}",
                f"train.steps={args.warmup + args.steps}",
                "checkpoint.enable=false",
                "metrics.tensorboard=false",
                "metrics.jsonl=false",
                f"parallel.pp={pp}",
                *args.overrides,
            ]
            runs = [[s, k * pp] for s in args.schedules.split(",") for k in (2, 4, 8)]
            spec = {"common": common, "runs": runs, "micro": args.micro}
            spec |= {"warmup": args.warmup, "steps": args.steps}
            for figures in launch(pp, spec, Path(tmp) / f"pp{pp}.json"):
                print(row(pp, figures), flush=True)


if __name__ == "__main__":
    main()
