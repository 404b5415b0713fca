"""`dstrain plan --validate`: the planner against the published runs it ships with, per run and
in sum (`dstrain/planner/published.py`)."""

import argparse
import math

from rich.console import Console
from rich.table import Table

from dstrain.cli.common import print_json
from dstrain.planner.memory import GiB
from dstrain.planner.published import (
    WITHIN,
    Prediction,
    leave_one_source_out,
    load,
    predict,
    score,
)


def validate_command(args: argparse.Namespace, out: Console) -> int:
    predictions = [predict(run) for run in load()]
    total = score(predictions)
    held_out = leave_one_source_out(predictions)
    if args.json:
        print_json(
            {
                "score": total.to_json(),
                "leave_one_source_out": held_out,
                "runs": [_row_json(p) for p in predictions],
            }
        )
        return 0
    out.print(_table(predictions))
    out.print(_sources(held_out))
    n = total.count
    out.print(
        f"throughput: median error {_pct(total.throughput_median)}, "
        f"{_pct(total.throughput_within)} within {WITHIN:.0%} ({n['throughput']} runs); "
        f"peak memory: median error {_pct(total.memory_median)} ({n['memory']} runs); "
        f"bubble: mean error {total.bubble_mean:.3f} ({n['bubble']} runs); "
        f"called impossible: {total.impossible} of {n['runs']}; 80 % ranges drawn from the "
        f"other sources hold {_pct(held_out['range_coverage'])} of the runs",
        markup=False,
    )
    return 0


def _sources(held_out: dict) -> Table:
    table = Table(show_edge=False, title="by source (ranges drawn from the other sources)")
    for column in ("source", "runs", "median error", "within 25 %", "in its 80 % range"):
        table.add_column(column, justify="left" if column == "source" else "right")
    for key, s in held_out["by_source"].items():
        table.add_row(
            key,
            str(s["runs"]),
            _pct(s["median_error"]),
            _pct(s["within"]),
            _pct(s["range_coverage"]),
        )
    return table


def _row_json(p: Prediction) -> dict:
    run = p.run
    return {
        "id": run.id,
        "source": run.source,
        "url": run.url,
        "gpu": run.cluster.gpu.name,
        "num_gpus": run.cluster.num_gpus,
        "layout": run.layout.describe(),
        "measured": run.measured,
        "measured_tokens_per_s_per_gpu": run.tokens_per_s_per_gpu,
        "predicted_tokens_per_s_per_gpu": p.tokens_per_s_per_gpu,
        "predicted_peak_memory_gib": p.estimate.memory.peak / GiB,
        "memory_counts": run.memory_counts,
        "predicted_memory_as_counted_gib": p.estimate.memory.counted(run.memory_counts) / GiB,
        "predicted_bubble": p.predicted_bubble,
        "errors": p.errors(),
        "impossible": p.impossible,
        "dstrain_refuses": p.estimate.illegal,
    }


def _table(predictions: list[Prediction]) -> Table:
    table = Table(show_edge=False)
    for column in ("run", "GPUs", "layout", "tok/s/GPU pub/pred", "memory GiB pub/pred", "note"):
        table.add_column(column, justify="right" if column == "GPUs" else "left")
    for p in predictions:
        run, errors = p.run, p.errors()
        measured = run.tokens_per_s_per_gpu
        throughput = (
            f"{measured:,.0f}/{p.tokens_per_s_per_gpu:,.0f} ({errors['throughput']:+.0%})"
            if measured
            else ""
        )
        memory = (
            f"{run.measured['peak_memory_gib']:.1f}/"
            f"{p.estimate.memory.counted(run.memory_counts) / GiB:.1f} "
            f"({errors['memory']:+.0%})"
            if "memory" in errors
            else ""
        )
        table.add_row(
            run.id,
            f"{run.cluster.num_gpus} {run.cluster.gpu.name}",
            run.layout.describe(),
            throughput,
            memory,
            p.impossible[0] if p.impossible else "",
        )
    return table


def _pct(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{100 * value:.1f} %"
