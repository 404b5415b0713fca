"""`dstrain plan --validate`: the planner against the published runs it ships with, per run and
in sum (`dstrain/planner/published.py`)."""

import argparse
import math
from contextlib import nullcontext

from rich.console import Console
from rich.table import Table

from dstrain.cli.common import print_json
from dstrain.planner.kernels import SUSTAINED_SHARE
from dstrain.planner.memory import GiB
from dstrain.planner.published import (
    WITHIN,
    Prediction,
    leave_one_source_out,
    leave_one_source_out_fit,
    load,
    predict,
    score,
)


def validate_command(args: argparse.Namespace, out: Console) -> int:
    runs = load(args.published) if args.published else load()
    with out.status("predicting the published runs...") if out.is_terminal else nullcontext():
        predictions = [predict(run) for run in runs]
        total = score(predictions)
        held_out = leave_one_source_out(predictions)
        refit = leave_one_source_out_fit(runs)
    if args.json:
        print_json(
            {
                "score": total.to_json(),
                "leave_one_source_out": held_out,
                "leave_one_source_out_fit": refit,
                "sustained_share": SUSTAINED_SHARE,
                "runs": [_row_json(p) for p in predictions],
            }
        )
        return 0
    out.print(_table(predictions))
    out.print(_sources(held_out, refit))
    out.print(
        f"each source predicted with the in-training share fitted on the others only: median "
        f"error {_pct(refit['median_error'])}, {_pct(refit['within'])} within {WITHIN:.0%} "
        f"({refit['runs']} runs); the share moves within {refit['sustained_range'][0]:.3f}-"
        f"{refit['sustained_range'][1]:.3f} (shipped: {SUSTAINED_SHARE})",
        markup=False,
    )
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


def _sources(held_out: dict, refit: dict) -> Table:
    table = Table(show_edge=False, title="by source (ranges and the share from the other sources)")
    columns = (
        "source",
        "runs",
        "median error",
        "within 25 %",
        "in its 80 % range",
        "share without it",
        "its median error then",
    )
    for column in columns:
        table.add_column(column, justify="left" if column == "source" else "right")
    for key, s in held_out["by_source"].items():
        alone = refit["by_source"].get(key, {})
        table.add_row(
            key,
            str(s["runs"]),
            _pct(s["median_error"]),
            _pct(s["within"]),
            _pct(s["range_coverage"]),
            f"{alone['sustained']:.3f}" if alone else "",
            _pct(alone["median_error"]) if alone else "",
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
        run = p.run
        throughput, memory, _ = p.cells()
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
