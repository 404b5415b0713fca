"""`dstrain report RUN_DIR`: draw a run (or two, overlaid) as PNGs and one index.html."""

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from dstrain.cli.common import add_json_flag, console, print_json
from dstrain.errors import UserError

if TYPE_CHECKING:
    from dstrain.report.run_data import RunData

_EPILOG = """\
reads   RUN_DIR/metrics.jsonl (required; a last line cut short by a kill is skipped),
        RUN_DIR/summary.json and RUN_DIR/config.toml (each optional), the same of RUN_B.
writes  DIR/index.html and one PNG per figure with data: loss, lr, grad_norm,
        tokens_per_s, mfu, comm (exposed share, per axis, 15% target), bubble (measured and
        closed form, 5% target), memory, time (per phase), expert_load (heatmap: tokens per
        expert over the layer's mean, averaged over the logged steps). A figure the run(s) did
        not log is skipped, and its PNG from an earlier report in DIR removed.
--json  prints {"output", "index", "plots": [PNG file names], "skipped": [figure names]}.
exit status: 0 written, 2 a run cannot be read or DIR cannot be written.

examples:
  dstrain report runs/default
  dstrain report runs/ep2 --compare runs/ep1 -o reports/ep2-vs-ep1
  dstrain report runs/default --json | jq -r .index
"""


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "report",
        help="plot a run: loss, MFU, comm share, bubble, memory, expert load (PNGs + index.html)",
        description="Draw a run's metrics.jsonl as PNGs and gather them with summary.json and "
        "config.toml in one self-contained index.html; with --compare, overlay a second run.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="runs/<name>")
    parser.add_argument(
        "-o",
        "--output",
        type=Path,
        metavar="DIR",
        help="folder for index.html and the PNGs (default RUN_DIR/report, or "
        "RUN_DIR/report-vs-<RUN_B's name> with --compare)",
    )
    parser.add_argument(
        "--compare", type=Path, metavar="RUN_B", help="a second run to overlay (dashed)"
    )
    add_json_flag(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # Imported here: matplotlib is slow to import, and `dstrain --help` should not pay for it.
    from dstrain.report.html import write_index
    from dstrain.report.plots import draw_report
    from dstrain.report.run_data import load_run

    runs = [load_run(args.run_dir)]
    if args.compare is not None:
        runs.append(load_run(args.compare))
    _note_truncated(runs)
    labels = run_labels([run.name for run in runs], [run.path for run in runs])
    out = args.output or _default_output(args.run_dir, args.compare)
    try:
        out.mkdir(parents=True, exist_ok=True)
        plots, skipped = draw_report(runs, labels, out)
        index = write_index(out, runs, labels, plots, skipped)
    except OSError as exc:
        raise UserError(
            f"cannot write the report to {out}: {exc}", "pass a writable -o DIR"
        ) from None
    if args.json:
        files = [plot.file for plot in plots]
        print_json({"output": str(out), "index": str(index), "plots": files, "skipped": skipped})
        return 0
    _print_written(index, [out / plot.file for plot in plots], skipped)
    return 0


def _default_output(run_dir: Path, compare: Path | None) -> Path:
    """RUN_DIR/report, or RUN_DIR/report-vs-<B> (a comparison keeps the plain report)."""
    return run_dir / ("report" if compare is None else f"report-vs-{compare.resolve().name}")


def _note_truncated(runs: "list[RunData]") -> None:
    for run in runs:
        if run.truncated_tail:
            console(stderr=True).print(
                f"note: {run.path}/metrics.jsonl: last line cut short (killed mid-write), skipped",
                markup=False,
            )


def run_labels(names: list[str], paths: list[Path]) -> list[str]:
    """Run names, or their paths when two runs share a name (runs/a/x vs runs/b/x)."""
    return names if len(set(names)) == len(names) else [str(path) for path in paths]


def _print_written(index: Path, pngs: list[Path], skipped: list[str]) -> None:
    out = console()
    out.print(f"wrote {index}", markup=False)
    for png in pngs:
        out.print(f"  {png}", markup=False)
    if skipped:
        out.print(f"not logged, not drawn: {', '.join(skipped)}", markup=False)
