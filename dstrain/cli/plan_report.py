"""What `dstrain plan` prints: one layout's estimate, or the search's ranked table with the
reasons the winner wins; as text or JSON; and the emitted config."""

import argparse
import time
from contextlib import nullcontext
from pathlib import Path

from rich.console import Console
from rich.table import Table

from dstrain.cli.common import print_json
from dstrain.config.load import to_toml
from dstrain.config.model_args import ModelArgs
from dstrain.errors import UserError
from dstrain.planner.advice import MemoryAdvice, advise
from dstrain.planner.comm import AXES
from dstrain.planner.estimate import Estimate, estimate
from dstrain.planner.layout import Cluster, Layout
from dstrain.planner.legal import to_config, trainer_errors
from dstrain.planner.memory import GiB
from dstrain.planner.published import attach_range
from dstrain.planner.search import search


def evaluate_command(
    model: ModelArgs, cluster: Cluster, layout: Layout, args: argparse.Namespace, out: Console
) -> int:
    refusals = trainer_errors(model, layout, cluster)
    reasons = _untileable(cluster, layout) or [
        f"{f.key}: {f.message}" for f in refusals if not f.trainer_limit
    ]
    if reasons:
        if args.json:
            print_json(
                {"legal": False, "fits": False, "reasons": reasons, "layout": layout.__dict__}
            )
        else:
            out.print(f"layout {layout.describe()} is not possible:", markup=False)
            for reason in reasons:
                out.print(f"  - {reason}", markup=False)
        return 1
    result = estimate(model, layout, cluster)
    # Another engine may run what dstrain's trainer refuses (plain DDP under TP, context
    # parallelism, ZeRO-3 with PP): the layout is still estimated, the refusal said beside it.
    result.illegal = [f"{f.key}: {f.message}" for f in refusals]
    attach_range(result, model, cluster)
    _emit(args, model, cluster, result)
    # Over the device by the estimate: the nearest layouts that fit, as dstrain train's
    # out-of-memory advice gives them (`planner/advice.py`).
    advice = None if result.fits else _advice(model, cluster, layout, args)
    if args.json:
        print_json(result.to_json() | ({"advice": advice.to_json()} if advice else {}))
    else:
        _print_estimate(result, out)
        for reason in result.illegal:
            out.print(f"dstrain train would refuse this layout: {reason}", markup=False)
        for line in advice.lines() if advice else []:
            out.print(line, markup=False)
    return 1 if result.memory_verdict == "does not fit" else 0


def _advice(
    model: ModelArgs, cluster: Cluster, layout: Layout, args: argparse.Namespace
) -> MemoryAdvice:
    """The advice for `layout`, its flags relative to the config --emit-config writes."""
    hf = hf_config_path(args.model)
    config = to_config(layout, cluster, flavor=None if hf else args.model, hf_config=hf)
    return advise(model, cluster, config, layout)


def search_command(
    model: ModelArgs,
    cluster: Cluster,
    base: Layout,
    fixed: set[str],
    args: argparse.Namespace,
    out: Console,
    started: float,
) -> int:
    with out.status("searching layouts...", spinner="dots") if out.is_terminal else nullcontext():
        found = search(model, cluster, base, fixed, top=args.top)
    seconds = time.perf_counter() - started
    if not found.ranked and found.closest is not None:
        return _closest_command(found.closest, model, cluster, args, out, found.evaluated)
    if not found.ranked:
        refused = found.refusals.most_common(1)
        why = f"; the trainer refused them, most often: {refused[0][0]}" if refused else ""
        raise UserError(
            f"no layout of the {found.evaluated} tried fits in {cluster.gpu.hbm_gb:g} GB and "
            f"passes the trainer's rules ({found.fitting} fit in memory{why})",
            "fix what the trainer refuses; else add GPUs, allow recompute/ZeRO-3 (drop the "
            "flags that fix them), shorten --seq-len, or lower --micro-batch",
            exit_code=1,
        )
    winner = found.ranked[0]
    attach_range(winner, model, cluster)
    _emit(args, model, cluster, winner)
    if args.json:
        print_json(
            {
                **winner.to_json(),
                "ranked": [e.to_json() for e in found.ranked],
                "alternatives": [
                    {"knob": knob, "layout": e.layout.__dict__, "why": why}
                    for knob, e, why in found.alternatives
                ],
                "evaluated": found.evaluated,
                "fitting": found.fitting,
                "search_seconds": seconds,
            }
        )
        return 0
    out.print(
        f"{found.evaluated:,} layouts of {cluster.num_gpus} x {cluster.gpu.name} tried in "
        f"{seconds:.1f} s: {found.fitting:,} fit in memory; the fastest legal ones:",
        markup=False,
    )
    out.print(_table(found.ranked))
    out.print(f"winner: {winner.layout.describe()}", markup=False)
    out.print(f"  {_why_it_wins(winner)}", markup=False)
    for knob, rival, why in found.alternatives:
        out.print(f"  {knob} -> {_knob(rival.layout, knob)}: {why}", markup=False)
    return 0


def _closest_command(
    e: Estimate,
    model: ModelArgs,
    cluster: Cluster,
    args: argparse.Namespace,
    out: Console,
    evaluated: int,
) -> int:
    """No layout both fits by the estimate and passes the trainer's rules, but one is only tight
    or refused only for a limit of dstrain's own: it is estimated and shown with its verdict."""
    note = (
        f"none of the {evaluated:,} layouts tried both fits by the estimate and passes dstrain's "
        "trainer; the fastest that another engine could run:"
    )
    attach_range(e, model, cluster)
    _emit(args, model, cluster, e)
    if args.json:
        print_json({**e.to_json(), "ranked": [], "closest": True, "note": note})
        return 0
    out.print(note, markup=False)
    _print_estimate(e, out)
    for reason in e.illegal:
        out.print(f"dstrain train would refuse this layout: {reason}", markup=False)
    return 0


def calibrate_command(paths: list[Path], args: argparse.Namespace, out: Console) -> int:
    from dstrain.planner.calibrate import (
        COMM_FIT,
        COMPUTE_FIT,
        compare,
        fit,
        read_run,
        run_summary,
    )
    from dstrain.report.run_data import load_run

    runs = []
    for path in paths:
        summary = run_summary(path)
        runs.append(read_run(path, summary, load_run(path).series))
    consts = fit(runs)
    rows = compare(runs, consts)
    values = {**consts.compute.__dict__, **consts.comm.__dict__}
    fitted = {name: values[name] for name in (*COMPUTE_FIT, *COMM_FIT)}
    if args.json:
        print_json({"constants": fitted, "runs": [row.to_json() for row in rows]})
        return 0
    out.print("fitted: " + ", ".join(f"{k} {v:.3g}" for k, v in fitted.items()), markup=False)
    table = Table(show_edge=False)
    for column in (
        "run",
        "layout",
        "states GiB meas/pred",
        "step s meas",
        "default",
        "calibrated",
        "comm s meas/pred",
    ):
        table.add_column(column, justify="left" if column in ("run", "layout") else "right")
    for r in rows:
        table.add_row(
            r.run,
            r.layout,
            f"{r.states_measured_gib:.4f}/{r.states_predicted_gib:.4f} "
            f"({100 * r.states_error:+.0f}%)",
            f"{r.step_measured_s:.3f}",
            f"{r.step_default_s:.3f}",
            f"{r.step_calibrated_s:.3f} ({100 * r.step_error:+.0f}%)",
            f"{r.comm_measured_s:.3f}/{r.comm_calibrated_s:.3f}",
        )
    out.print(table)
    return 0


def _untileable(cluster: Cluster, layout: Layout) -> list[str]:
    reasons = []
    if layout.world != cluster.num_gpus:
        reasons.append(
            f"dp {layout.dp} x tp {layout.tp} x pp {layout.pp} x cp {layout.cp} = "
            f"{layout.world} ranks, not the {cluster.num_gpus} GPUs"
        )
    if layout.global_batch % (layout.dp * layout.micro_batch):
        reasons.append(
            f"global batch {layout.global_batch} is not a multiple of dp {layout.dp} x "
            f"micro-batch {layout.micro_batch}"
        )
    return reasons


def _emit(args: argparse.Namespace, model: ModelArgs, cluster: Cluster, result: Estimate) -> None:
    if args.emit_config is None:
        return
    name = args.model
    hf = hf_config_path(name)
    config = to_config(result.layout, cluster, flavor=None if hf else name, hf_config=hf)
    try:
        args.emit_config.write_text(to_toml(config))
    except OSError as exc:
        raise UserError(f"cannot write {args.emit_config}: {exc}", "pass a writable path") from None


def hf_config_path(model: str) -> Path | None:
    """--model names a Hugging Face config.json (a path), or else a flavor (None)."""
    path = Path(model)
    return path if model.endswith(".json") or path.is_file() else None


def _print_estimate(e: Estimate, out: Console) -> None:
    m = e.memory
    verdict = {
        "fits": f"fits, {e.memory_margin_gib:.1f} GiB to spare",
        "tight": f"TIGHT: margin {e.memory_margin_gib:+.1f} GiB, at least {m.floor / GiB:.1f} "
        "GiB with fused loss and balanced routing",
        "does not fit": f"DOES NOT FIT: at least {m.floor / GiB:.1f} GiB",
    }[e.memory_verdict]
    out.print(f"layout: {e.layout.describe()} on {e.layout.world} GPUs", markup=False)
    out.print(
        f"memory per GPU: {m.peak / GiB:.1f} GiB of {e.hbm_bytes / GiB:.1f} ({verdict}; "
        f"busiest pipeline rank {m.rank}): weights {m.weights / GiB:.1f}, gradients "
        f"{m.gradients / GiB:.1f}, optimizer {m.optimizer / GiB:.1f}, activations "
        f"{m.activations / GiB:.1f}, overhead {m.overhead / GiB:.1f}",
        markup=False,
    )
    bubble = f"bubble {100 * e.bubble_fraction:.1f}%"
    if e.layout.pp > 1:
        bubble += f" (busiest rank {100 * e.busiest_bubble:.1f}%)"
    out.print(
        f"step: {e.step_time_s:.2f} s ({e.compute_s:.2f} s compute, {bubble}, exposed comm "
        f"{100 * e.comm_exposed_fraction:.1f}%)",
        markup=False,
    )
    out.print(
        f"throughput: {e.tokens_per_s:,.0f} tokens/s ({e.tokens_per_s / e.layout.world:,.0f} per "
        f"GPU), {e.tflops_per_gpu:.0f} model TFLOP/s per GPU, MFU {100 * e.mfu:.1f}%",
        markup=False,
    )
    if e.throughput_range:
        low, high, runs = e.throughput_range
        out.print(
            f"  80 % range {low:,.0f}-{high:,.0f} tokens/s per GPU: how far the planner was "
            f"off on the {runs} most similar published runs (dstrain plan --validate)",
            markup=False,
        )
    if e.comm is not None:
        parts = [
            f"{axis} {c.exposed_seconds:.2f}/{c.seconds:.2f} s ({c.link}, {c.algorithm})"
            for axis, c in zip(AXES, e.comm.axes(), strict=True)
            if c.seconds
        ]
        if parts:
            out.print("comm exposed/total per axis: " + ", ".join(parts), markup=False)


def _table(ranked: list[Estimate]) -> Table:
    table = Table(show_edge=False)
    for column in ("#", "layout", "GiB/GPU", "step s", "tok/s/GPU", "MFU", "bubble", "comm"):
        table.add_column(
            column, justify="left" if column == "layout" else "right", no_wrap=column == "layout"
        )
    for i, e in enumerate(ranked, 1):
        table.add_row(
            str(i),
            e.layout.describe(),
            f"{e.memory.peak / GiB:.1f}",
            f"{e.step_time_s:.2f}",
            f"{e.tokens_per_s / e.layout.world:,.0f}",
            f"{100 * e.mfu:.1f}%",
            f"{100 * e.bubble_fraction:.1f}%",
            f"{100 * e.comm_exposed_fraction:.1f}%",
        )
    return table


def _why_it_wins(e: Estimate) -> str:
    return (
        f"fastest that fits: MFU {100 * e.mfu:.1f}%, bubble {100 * e.bubble_fraction:.1f}%, "
        f"exposed comm {100 * e.comm_exposed_fraction:.1f}%, "
        f"{(e.hbm_bytes - e.memory.peak) / GiB:.1f} GiB of memory to spare"
    )


def _knob(layout: Layout, knob: str) -> str:
    return f"{getattr(layout, knob)}"
