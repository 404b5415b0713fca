"""`dstrain schedule`: simulate a pipeline schedule as torch.distributed.pipelining runs it; print
its bubble, makespan and activations in flight, and draw it."""

import argparse
import json
import math
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dstrain.cli.common import add_json_flag, console, print_json
from dstrain.errors import UserError
from dstrain.planner.bubble import SCHEDULES, Costs, stages_per_rank, theoretical_bubble

if TYPE_CHECKING:
    from dstrain.parallel.pipeline_sim import Block, Timeline

_EPILOG = """\
Costs are per stage (model chunk) and micro-batch: F forward, B input-gradient backward, W
weight-gradient backward; a full backward costs B+W. 1,1,1 is the uniform case of the Zero Bubble
and DualPipe papers. The bubble is the idle share of pp ranks x the makespan, as in the closed
forms printed beside it. Orders are upstream's own (gpipe and 1f1b as their runtime executes them).

--from-run RUN_DIR fills what the command line leaves out from RUN_DIR/config.toml (pp,
pp_schedule, num_virtual_stages, num_microbatches or grad_accum_steps) and, without --costs,
takes the costs in ms from the last line of RUN_DIR/metrics.jsonl with pipeline/time_f_ms and
pipeline/time_b_ms (time_i_ms for split backwards) and pipeline/time_w_ms; runs with pp > 1 log
them. Without time_w_ms the backward was not split: B = the full backward, W = 0.

examples:
  dstrain schedule --schedule 1f1b --pp 4 --microbatches 8
  dstrain schedule --schedule all --pp 4 --microbatches 16 --png schedules.png
  dstrain schedule --schedule zbv --pp 4 --microbatches 16 --costs 1,1.2,0.8 --p2p 0.1 --json
  dstrain schedule --from-run runs/pp4 --schedule dualpipev --png dualpipev.png
"""
TEXT_WIDTH = 72  # characters of the text timeline


@dataclass(frozen=True)
class Request:
    """What to simulate, after the command line and --from-run are merged."""

    schedule: str  # a name from SCHEDULES, or "all"
    pp: int
    microbatches: int
    virtual_stages: int | None  # as given (interleaved-1f1b only); None = its default, 2
    costs: Costs
    unit: str  # "ms" for measured costs


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "schedule",
        help="simulate and draw a pipeline schedule: bubble, makespan, activations in flight",
        description="Simulate one pipeline step of a schedule (or compare all of them) with "
        "per-action costs; print the bubble (simulated and closed-form), the makespan and the "
        "peak activations in flight per rank; optionally draw the timeline.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--schedule", metavar="S", help=f"{', '.join(SCHEDULES)}, or all")
    parser.add_argument("--pp", type=int, metavar="P", help="pipeline ranks")
    parser.add_argument("--microbatches", type=int, metavar="M", help="micro-batches per step")
    parser.add_argument(
        "--virtual-stages",
        type=int,
        metavar="V",
        help="stages per rank of interleaved-1f1b (default 2; zbv and dualpipev always hold 2)",
    )
    parser.add_argument(
        "--costs", metavar="F,B,W", help="time of forward, input-grad and weight-grad (1,1,1)"
    )
    parser.add_argument(
        "--p2p", type=float, default=0.0, metavar="X", help="latency of each hop between ranks"
    )
    parser.add_argument(
        "--from-run", type=Path, metavar="RUN_DIR", help="take the layout and costs from a run"
    )
    parser.add_argument("--png", type=Path, metavar="PATH", help="draw the timeline(s) here")
    add_json_flag(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    request = _request(args)
    results, skipped = _simulate_all(request, args.p2p)
    for name, reason in skipped:
        console(stderr=True).print(f"note: skipping {name}: {reason}", markup=False)
    if not results:
        raise UserError(
            f"upstream refuses every schedule for pp {request.pp} with {request.microbatches} "
            "micro-batches",
            "use more micro-batches (at least 2 x pp runs them all)",
        )
    if args.png:
        _draw(results, request, args.png)
    if args.json:
        print_json([_as_dict(r, request, args.p2p) for r in results])
    else:
        for r in results:
            _print_result(r, request)
    if args.png:
        console(stderr=args.json).print(f"wrote {args.png}", markup=False)
    return 0


def _request(args: argparse.Namespace) -> Request:
    """Command line first, then the run directory (--from-run), then the defaults."""
    from_run = _read_run(args.from_run, need_costs=not args.costs) if args.from_run else {}
    given = {
        "schedule": args.schedule,
        "pp": args.pp,
        "microbatches": args.microbatches,
        "virtual_stages": args.virtual_stages,
    }
    merged = {key: from_run.get(key) if value is None else value for key, value in given.items()}
    schedule = merged["schedule"]
    if schedule is None or merged["pp"] is None or merged["microbatches"] is None:
        raise UserError(
            "--schedule, --pp and --microbatches are needed",
            "give them, or --from-run RUN_DIR to read them from a run",
        )
    if schedule != "all" and schedule not in SCHEDULES:
        raise UserError(f"unknown schedule {schedule!r}", f"use one of {', '.join(SCHEDULES)}, all")
    for key in ("pp", "microbatches", "virtual_stages"):
        value = merged[key]
        if value is not None and (type(value) is not int or value < 1):
            flag = f"--{key.replace('_', '-')}"
            raise UserError(f"{flag} must be a whole number >= 1, got {value!r}", f"{flag} 4")
    if args.p2p < 0:
        raise UserError(f"--p2p must be >= 0, got {args.p2p}", "0 = free hops between ranks")
    _check_virtual_stages(schedule, args.virtual_stages)
    costs = _parse_costs(args.costs) if args.costs else from_run.get("costs", Costs())
    unit = "ms" if "costs" in from_run else "cost units"
    return Request(
        schedule, merged["pp"], merged["microbatches"], merged["virtual_stages"], costs, unit
    )


def _check_virtual_stages(schedule: str, given: int | None) -> None:
    """--virtual-stages only shapes interleaved-1f1b; say so rather than ignore it."""
    if given is None or schedule in ("all", "interleaved-1f1b"):
        return
    if given != stages_per_rank(schedule):
        raise UserError(
            f"{schedule} runs {stages_per_rank(schedule)} stage(s) per rank, not {given}",
            "drop --virtual-stages (only interleaved-1f1b takes it)",
        )


def _parse_costs(text: str) -> Costs:
    fix = "e.g. --costs 1,1,1: forward, input-grad backward, weight-grad backward (W 0 = no split)"
    try:
        values = [float(x) for x in text.split(",")]
    except ValueError:
        raise UserError(f"--costs {text!r} is not three numbers F,B,W", fix) from None
    if len(values) != 3:
        raise UserError(f"--costs {text!r} has {len(values)} number(s), not 3 (F,B,W)", fix)
    if not all(math.isfinite(x) for x in values) or min(values[:2]) <= 0 or values[2] < 0:
        raise UserError(f"--costs {text!r}: need F > 0, B > 0 and W >= 0", fix)
    return Costs(*values)


def _read_run(run_dir: Path, need_costs: bool) -> dict[str, Any]:
    """The pipeline layout of a run's config.toml and, if `need_costs`, its measured costs."""
    config_path = run_dir / "config.toml"
    if not config_path.is_file():
        raise UserError(f"no run at {run_dir} (no config.toml)", "pass runs/<name> of a PP run")
    try:
        config = tomllib.loads(config_path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"{config_path} is not TOML: {exc}", "is the file truncated?") from None
    parallel, train = (config.get(key) for key in ("parallel", "train"))
    parallel = parallel if isinstance(parallel, dict) else {}
    train = train if isinstance(train, dict) else {}
    virtual = parallel.get("num_virtual_stages")
    run = {
        "schedule": parallel.get("pp_schedule"),
        "pp": parallel.get("pp"),
        "microbatches": parallel.get("num_microbatches") or train.get("grad_accum_steps"),
        # 1 is gpipe/1f1b's value: it must not reach an interleaved-1f1b asked for on the CLI.
        "virtual_stages": virtual if isinstance(virtual, int) and virtual > 1 else None,
        "costs": _measured_costs(run_dir / "metrics.jsonl") if need_costs else None,
    }
    return {key: value for key, value in run.items() if value is not None}


F_KEY, B_KEY, I_KEY, W_KEY = (f"pipeline/time_{k}_ms" for k in "fbiw")


def _measured_costs(path: Path) -> Costs:
    """The last logged mean time per action. Split-backward schedules log the input-gradient
    half as time_i_ms (the trainer reads it the same way); without time_w_ms the backward was
    not split: B = the full backward, W = 0."""
    keys = f"{F_KEY} and {B_KEY} (or {I_KEY}, with {W_KEY})"
    fix = "the run must have pp > 1 (only pipelined runs log them); or give --costs F,B,W"
    if not path.is_file():
        raise UserError(f"no {path}, so no {keys}", fix)
    last = None
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a crash does not hide the ones before it
        if isinstance(row, dict) and F_KEY in row and (B_KEY in row or I_KEY in row):
            last = row
    if last is None:
        raise UserError(f"{path} has no {keys}", fix)
    try:
        return Costs(last[F_KEY], last.get(I_KEY) or last[B_KEY], last.get(W_KEY, 0.0))
    except (KeyError, TypeError, ValueError) as exc:
        raise UserError(f"{path}: unusable pipeline times: {exc}", "give --costs F,B,W") from None


@dataclass(frozen=True)
class Result:
    schedule: str
    virtual_stages: int
    timeline: "Timeline"
    theoretical: float


def _simulate_all(request: Request, p2p: float) -> tuple[list[Result], list[tuple[str, str]]]:
    """One result per schedule; in comparison mode a shape upstream refuses is skipped."""
    # Imported here: the simulator pulls in torch, which `dstrain --help` should not pay for.
    from dstrain.parallel.pipeline_sim import ShapeError, schedule_actions, simulate

    names = SCHEDULES if request.schedule == "all" else (request.schedule,)
    results, skipped = [], []
    for name in names:
        v = stages_per_rank(name, request.virtual_stages or 2)
        try:
            actions = schedule_actions(name, request.pp, request.microbatches, v)
        except ShapeError as exc:
            if request.schedule != "all":
                raise UserError(exc.message, exc.fix) from None
            skipped.append((name, str(exc)))
            continue
        timeline = simulate(actions, request.costs, p2p)
        bubble = theoretical_bubble(name, request.pp, request.microbatches, v, request.costs)
        results.append(Result(name, v, timeline, bubble))
    return results, skipped


def _as_dict(r: Result, request: Request, p2p: float) -> dict[str, Any]:
    t = r.timeline
    return {
        "schedule": r.schedule,
        "pp": request.pp,
        "microbatches": request.microbatches,
        "virtual_stages": r.virtual_stages,
        "costs": {**vars(request.costs), "unit": request.unit},
        "p2p": p2p,
        "bubble_fraction": t.bubble_fraction,
        "theoretical_bubble_fraction": r.theoretical,
        "makespan": t.makespan,
        "rank_bubble": t.rank_bubble,
        "peak_inflight": t.peak_inflight,
        "blocks": [
            [{"start": b.start, "end": b.end, **vars(b.action)} for b in rank] for rank in t.blocks
        ],
    }


def _print_result(r: Result, request: Request) -> None:
    t, c, out = r.timeline, request.costs, console()
    out.print(
        f"{r.schedule}: pp {request.pp}, {request.microbatches} micro-batches, "
        f"{r.virtual_stages} stage(s) per rank, costs F {c.forward:g} B {c.backward:g} "
        f"W {c.weight:g} ({request.unit})",
        markup=False,
        style="bold",
    )
    out.print(
        f"  bubble {t.bubble_fraction:.2%} simulated, {r.theoretical:.2%} closed form; "
        f"makespan {t.makespan:.4g} {request.unit}",
        markup=False,
    )
    if r.schedule == "interleaved-1f1b" and request.microbatches < request.pp:
        out.print("  (the closed form assumes micro-batches >= pp)", markup=False)
    out.print("  rank  bubble  peak in-flight  timeline (F B I W; lower case: later chunk)")
    for rank, blocks in enumerate(t.blocks):
        row = _text_row(blocks, t.stages[rank], t.makespan)
        out.print(
            f"  {rank:>4}  {t.rank_bubble[rank]:>6.1%}  {t.peak_inflight[rank]:>14}  {row}",
            markup=False,
        )


def _text_row(blocks: "list[Block]", stages: tuple[int, ...], makespan: float) -> str:
    """One character per 1/TEXT_WIDTH of the step: the action running then, `.` when idle."""
    chars, i = [], 0
    for col in range(TEXT_WIDTH):
        at = (col + 0.5) * makespan / TEXT_WIDTH
        while i < len(blocks) and blocks[i].end <= at:
            i += 1
        if i < len(blocks) and blocks[i].start <= at:
            kind = blocks[i].action.kind
            chars.append(kind.lower() if stages.index(blocks[i].action.stage) else kind)
        else:
            chars.append(".")
    return "".join(chars)


def _draw(results: list[Result], request: Request, path: Path) -> None:
    from dstrain.report.schedule_plot import draw_timelines  # matplotlib only when drawing

    title = f"pp {request.pp}, {request.microbatches} micro-batches"
    if len(results) == 1:
        title = f"{results[0].schedule}, {title}"
    try:
        draw_timelines({r.schedule: r.timeline for r in results}, path, title, request.unit)
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot write {path}: {exc}", "choose a writable .png path") from None
