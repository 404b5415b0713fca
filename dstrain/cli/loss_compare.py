"""`dstrain loss-compare RUN_A RUN_B`: do two runs have the same per-step losses?"""

import argparse
from pathlib import Path

from dstrain.cli.common import add_json_flag, console, print_json
from dstrain.report.loss_compare import compare, read_losses

_EPILOG = """\
exit status: 0 the losses match within --rtol on every common step, 1 they diverge (or share no
step), 2 a run cannot be read.

Validating a new layout before a big run:
  dstrain train small.toml --set run.name=ref --nproc 2 --set parallel.dp_shard=2
  dstrain train small.toml --set run.name=new --nproc 4 --set parallel.ep=2
  dstrain loss-compare runs/ref runs/new --rtol 1e-5
Same config, seed and data, metrics.log_interval = 1; in fp32 a correct layout matches to ~1e-6.
"""


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "loss-compare",
        help="compare two runs' per-step losses; print the first divergence",
        description="Compare the per-step values of a metric (default loss/main) of two runs.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("run_a", type=Path, metavar="RUN_A", help="run directory")
    parser.add_argument("run_b", type=Path, metavar="RUN_B", help="run directory")
    parser.add_argument("--rtol", type=float, default=1e-5, help="relative tolerance (1e-5)")
    parser.add_argument("--key", default="loss/main", help="metric to compare (loss/main)")
    add_json_flag(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    a, b = read_losses(args.run_a, args.key), read_losses(args.run_b, args.key)
    result = compare(a, b, args.key, args.rtol)
    if args.json:
        print_json({**result.__dict__, "matches": result.matches, "rtol": args.rtol})
        return 0 if result.matches else 1
    out = console()
    out.print(
        f"{args.key}: {result.steps} common steps, max relative difference "
        f"{result.max_rel_diff:.2e} (rtol {args.rtol:g})",
        markup=False,
    )
    if result.only_in_a or result.only_in_b:
        out.print(
            f"steps only in {args.run_a}: {result.only_in_a}, only in {args.run_b}: "
            f"{result.only_in_b}",
            markup=False,
        )
    if result.first_divergence:
        step, x, y = result.first_divergence
        out.print(f"DIVERGED at step {step}: {x!r} vs {y!r}", markup=False, style="bold red")
    elif result.steps == 0:
        out.print("no common step to compare", markup=False, style="bold red")
    else:
        out.print("MATCH", markup=False, style="bold green")
    return 0 if result.matches else 1
