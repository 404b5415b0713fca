"""What `dstrain bench comm`'s timed loop costs over a bare torch.distributed loop, in one run.

One torchrun launch of 2 gloo ranks (`benchmarks/bench_comm_overhead_worker.py` on each)
alternates, per op and size, the harness's timed block (`dstrain.bench.timing.measure` around the
prepared call of `dstrain.bench.ops`), a bare loop written there with plain `dist.all_reduce` /
`dist.batch_isend_irecv` calls, and that bare loop again as a control: same sizes, same warm-up
and timed calls (the harness's own counts for each size), the order rotating every round. A
2-core machine is noisy (small gloo messages flip between ~0.2 and ~2 ms), so a size's figure is
the median over rounds of harness / bare time of the same round (paired, so drifts cancel), and
the ratio of the best rounds (best-of, as `timeit` reports: robust to the phases when other
processes take the cores); the control's ratios show the noise floor. "overall" is the geometric
mean of the sizes' ratios. The harness's own per-call cost is also timed around a
no-op collective, free of that noise.

Usage: python benchmarks/bench_comm_overhead.py [--rounds R] [--sizes 1K:64M] [--step-factor 16]
"""

import argparse
import json
import math
import statistics
import tempfile
from pathlib import Path

from cpu import cpu_label  # noqa: E402  (benchmarks/cpu.py)
from launch_workers import REPO, torchrun_workers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40, help="rounds below 16M")
    parser.add_argument("--big-rounds", type=int, default=8, help="rounds at 16M and above")
    parser.add_argument("--sizes", default="1K:64M")
    parser.add_argument("--step-factor", type=int, default=16)
    args = parser.parse_args()
    print(f"CPU: {cpu_label()}")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        spec = {
            "rounds": args.rounds,
            "big_rounds": args.big_rounds,
            "sizes": args.sizes,
            "factor": args.step_factor,
        }
        worker = REPO / "benchmarks" / "bench_comm_overhead_worker.py"
        torchrun_workers(2, worker, str(out), json.dumps(spec))
        seconds = json.loads(out.read_text())
    accounting = seconds.pop("accounting")
    print(f"2 gloo ranks; rounds: {args.rounds} below 16M, {args.big_rounds} above")
    print(
        f"{'':<27} {'median':>9} {'median':>10} {'paired median':>25} {'best of rounds':>24}\n"
        f"{'op':<11} {'size':>9} {'calls':>5} {'bare us':>9} {'harness us':>10} "
        f"{'harness/bare':>12} {'control':>8}    {'harness/bare':>12} {'control':>8}"
    )
    columns: list[list[float]] = [[], [], [], []]
    for key, runs in seconds.items():
        op, size, calls = key.split("/")
        figures = (
            _paired(runs["harness"], runs["bare"]),
            _paired(runs["bare again"], runs["bare"]),
            min(runs["harness"]) / min(runs["bare"]),
            min(runs["bare again"]) / min(runs["bare"]),
        )
        for column, figure in zip(columns, figures, strict=True):
            column.append(figure)
        bare, harness = statistics.median(runs["bare"]), statistics.median(runs["harness"])
        print(
            f"{op:<11} {size:>9} {calls:>5} {1e6 * bare:>9.1f} {1e6 * harness:>10.1f} "
            f"{figures[0]:>12.3f} {figures[1]:>8.3f}    {figures[2]:>12.3f} {figures[3]:>8.3f}"
        )
    overall = [_geomean(column) for column in columns]
    print(
        f"overall (geometric mean over sizes): paired median harness/bare {overall[0]:.3f} "
        f"({100 * (overall[0] - 1):+.1f}%, control {overall[1]:.3f}); best of rounds "
        f"{overall[2]:.3f} ({100 * (overall[2] - 1):+.1f}%, control {overall[3]:.3f})"
    )
    extra = accounting["partial_s"] - accounting["inline_s"]
    fastest = min(min(runs["bare"]) for runs in seconds.values())
    print(
        f"accounting: the harness's call wrapper costs {1e9 * extra:.0f} ns per call over an "
        f"inline call (timed around a no-op), {100 * extra / fastest:.3f}% of the fastest "
        f"bare call ({1e6 * fastest:.1f} us)"
    )


def _paired(values: list[float], reference: list[float]) -> float:
    return statistics.median(v / r for v, r in zip(values, reference, strict=True))


def _geomean(values: list[float]) -> float:
    return math.exp(statistics.fmean(math.log(v) for v in values))


if __name__ == "__main__":
    main()
