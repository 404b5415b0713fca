"""Routed experts under TP, and the shared experts behind the EP dispatch: measured on 2 ranks.

One torchrun launch of `moe_parallel_worker.py` (2 gloo ranks, one thread each), one MoE layer
(dim 256, 8 experts of width 256, top-2, batch 4 x 256 tokens per micro-batch), everything side
by side in that launch:

1. `parallel.moe_tp` (part 4 of issue 19). Per rank and micro-batch: the routed rows its local
   experts compute (expert FLOPs are 18 x dim x width per row, forward and backward), the bytes
   autograd saves in the MoE, and the forward EP all-to-all payload it sends (its token copies,
   dispatched and combined; backward moves the same again), for
   - tp1_ep2: two ranks, each its own micro-batch, experts split over ep2 (the tp1 baseline);
   - tp2_ep2_repeat: two tp ranks on one micro-batch, each routing every token (the old way);
   - tp2_ep2_split: the same, each tp rank routing half of the tokens (the default).
   The ratios to tp1 are what the issue asks: split should be about 0.5, repeat 1.0.
2. `parallel.ep_overlap` (part 3). Two shared experts; forward + backward wall time and the
   seconds blocked on the ep axis (the trainer's communication timer), overlap off and on,
   three interleaved rounds; medians and the on/off ratios.

On this CPU gloo's all-to-all runs on a thread of the same 2 cores the ranks compute on, so
what overlap can hide is bounded by the spare core time; the figures are ratios from one run.

Usage: python benchmarks/moe_parallel.py [--iters N] [--warmup W]   (about a minute)
"""

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from cpu import cpu_label
from launch_workers import torchrun_workers

HERE = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=10, help="timed iterations per case")
    parser.add_argument("--warmup", type=int, default=3, help="untimed iterations first")
    a = parser.parse_args()
    with tempfile.TemporaryDirectory() as out:
        print(f"running 2 ranks on {cpu_label()} ...", flush=True)
        torchrun_workers(
            2, HERE / "moe_parallel_worker.py", out, str(a.iters), str(a.warmup), what="moe"
        )
        ranks = [json.loads((Path(out) / f"rank{r}.json").read_text()) for r in range(2)]
    report_tp(ranks)
    report_overlap(ranks)


def report_tp(ranks: list[dict]) -> None:
    print("\nrouted experts under TP: per rank, per micro-batch (largest rank)")
    print(
        f"{'case':18} {'rows':>6} {'x tp1':>6} {'saved MiB':>10} {'x tp1':>6} "
        f"{'EP MiB':>7} {'x tp1':>6}"
    )
    base = {k: max(r["tp1_ep2"][k] for r in ranks) for k in ("rows", "saved_bytes", "ep_bytes")}
    for case in ("tp1_ep2", "tp2_ep2_repeat", "tp2_ep2_split"):
        got = {k: max(r[case][k] for r in ranks) for k in base}
        print(
            f"{case:18} {got['rows']:6d} {got['rows'] / base['rows']:6.2f} "
            f"{got['saved_bytes'] / 2**20:10.2f} {got['saved_bytes'] / base['saved_bytes']:6.2f} "
            f"{got['ep_bytes'] / 2**20:7.2f} {got['ep_bytes'] / base['ep_bytes']:6.2f}"
        )


def report_overlap(ranks: list[dict]) -> None:
    print("\nshared experts behind the dispatch (ep2): medians over both ranks")
    figures = {}
    for state in ("off", "on"):
        case = f"ep2_shared_overlap_{state}"
        seconds = [s for r in ranks for s in r[case]["seconds"]]
        ep = [s for r in ranks for s in r[case]["ep_seconds"]]
        figures[state] = statistics.median(seconds), statistics.median(ep)
        step, exposed = figures[state]
        print(
            f"overlap {state:3}: step {step * 1e3:7.2f} ms, ep exposed {exposed * 1e3:6.2f} ms "
            f"({exposed / step:.1%} of the step)"
        )
    (off_step, off_ep), (on_step, on_ep) = figures["off"], figures["on"]
    print(f"on / off: step time {on_step / off_step:.2f}x, exposed EP {on_ep / off_ep:.2f}x")


if __name__ == "__main__":
    main()
