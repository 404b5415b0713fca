"""`dstrain status RUN_DIR`: what every rank of a run is doing, from its heartbeat."""

import argparse
import time
from pathlib import Path

from dstrain.cli.common import add_json_flag, console, print_json
from dstrain.errors import UserError


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "status",
        help="show each rank's last heartbeat (step, phase, age) of a run",
        description="Every rank of a run writes a heartbeat at each phase of a step (data, "
        "compute, checkpoint): the step it is on, what it is doing, and when it said so. A rank "
        "far behind the others, or silent for long, is the one holding the job up.",
        epilog="example: dstrain status runs/default",
    )
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="runs/<name>")
    add_json_flag(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dstrain.train.heartbeat import laggards, read_heartbeats

    if not (args.run_dir / "heartbeat").is_dir():
        raise UserError(
            f"{args.run_dir} has no heartbeats (no heartbeat/ folder)",
            "pass the runs/<name> folder of a run that has started",
            exit_code=2,
        )
    beats = read_heartbeats(args.run_dir)
    now = time.time()
    late = {b["rank"] for b in laggards(beats, me=-1)}
    for beat in beats:
        beat["age_s"] = round(now - beat["time"], 1)
        beat["behind"] = beat["rank"] in late
    if args.json:
        print_json(beats)
        return 0
    out = console()
    out.print(f"{args.run_dir}: {len(beats)} rank(s)", markup=False)
    for b in beats:
        flag = "  <- behind the others" if b["behind"] else ""
        out.print(
            f"  rank {b['rank']:>4}  {b['step']:>6} steps done  {b['phase']:<10}  "
            f"{b['age_s']:>8.1f} s ago  attempt {b['attempt']}{flag}",
            markup=False,
        )
    return 0
