"""`dstrain bench comm`: collective bandwidth with nccl-tests semantics, per mesh axis, plus a
per-device GEMM check. `--nproc N` starts N local workers through torchrun's elastic agent, each
running `python -m dstrain.bench comm ...`; on a cluster run `torchrun ... -m dstrain.bench comm`
on every node instead (rank 0 prints the report)."""

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from dstrain.bench.sizes import parse_sizes
from dstrain.bench.spec import AXES, DTYPES, OP_NAMES, CommSpec, check_axis, parse_ops
from dstrain.cli.common import (
    add_json_flag,
    add_set_arg,
    console,
    non_negative_int,
    positive_int,
    run_guarded,
)
from dstrain.config.load import LoadedConfig, load_config
from dstrain.config.parallel_dims import ParallelDims
from dstrain.config.validate import raise_if_errors
from dstrain.errors import UserError

DEFAULT_SIZES = {"cpu": "1K:64M", "cuda": "1K:1G"}

_EPILOG = """\
Columns (nccl-tests): size (B) is the larger of the send and receive buffers (the whole n-rank
buffer for all_gather, reduce_scatter and all_to_all), count the elements of the call's count
argument, time the mean over ranks of each rank's time per call, algbw = size / time,
busbw = algbw x 2(n-1)/n (all_reduce), (n-1)/n (all_gather, reduce_scatter, all_to_all),
1 (broadcast, send_recv), with n the size of the group that ran. #wrong counts the elements that
differ from the expected result of one checked call. docs/bench.md has the details.

--axis runs every op on the groups of one mesh axis of the config's layout, all groups at once,
as the trainer would; pp runs send_recv between consecutive stages.

--min-busbw X fails (exit 1) when any op's busbw at its largest size is below X GB/s; wrong
results always fail.

examples:
  dstrain bench comm                                  # 2 ranks (all GPUs on a GPU host), every op
  dstrain bench comm --ops all_reduce --sizes 1M:256M --min-busbw 1
  dstrain bench comm --nproc 4 --axis tp --set parallel.tp=2
  dstrain bench comm --nproc 8 --axis ep --config run.toml --json > comm.json
  torchrun --nnodes 2 --nproc-per-node 8 ... -m dstrain.bench comm --axis dp --config run.toml
"""


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "bench",
        help="measure collective bandwidth with nccl-tests semantics, and GEMM speed per device",
        description="Benchmarks of this machine or cluster.",
    )
    bench_sub = parser.add_subparsers(dest="bench_command", metavar="BENCH")
    comm = bench_sub.add_parser(
        "comm",
        help="collective bandwidth (nccl-tests semantics), stragglers, GEMM per device",
        description="Time all_reduce, all_gather, reduce_scatter, all_to_all, broadcast and "
        "send_recv over a range of sizes on every rank, check their results, flag slow ranks, "
        "and time a matmul per device.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_comm_args(comm)
    comm.set_defaults(func=run)
    parser.set_defaults(func=lambda args: _usage(parser))


def _add_comm_args(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add(
        "--nproc",
        type=positive_int,
        metavar="N",
        help="local worker processes, started "
        "through torchrun's elastic agent (default: every GPU when there are 2 or more, else 2)",
    )
    add(
        "--ops",
        default="all",
        metavar="OP[,OP]",
        help=f"{', '.join(OP_NAMES)}, or `all` (default; on --axis pp only send_recv)",
    )
    add(
        "--sizes",
        metavar="MIN:MAX",
        help="bytes, K/M/G = 1024^1..3, like nccl-tests -b/-e "
        f"(default {DEFAULT_SIZES['cpu']} on CPU, {DEFAULT_SIZES['cuda']} on GPUs)",
    )
    add(
        "--step-factor",
        type=positive_int,
        default=2,
        metavar="F",
        help="multiply the size by F each step, like nccl-tests -f (default 2)",
    )
    add("--dtype", choices=DTYPES, default="float", help="element type (default float = fp32)")
    add(
        "--warmup",
        type=non_negative_int,
        metavar="W",
        help="untimed calls per size (default 5; on CPU fewer above 4M)",
    )
    add(
        "--iters",
        type=positive_int,
        metavar="N",
        help="timed calls per size (default 20; on CPU fewer above 4M, so that a size moves "
        "at most 128M)",
    )
    add(
        "--axis",
        choices=AXES,
        help="run on the groups of this mesh axis of the layout in "
        "--config/--set (dp = dp_replicate x dp_shard); default: the whole world",
    )
    add("--config", type=Path, metavar="C", help="config whose parallel section gives the layout")
    add_set_arg(parser)
    add(
        "--straggler-ratio",
        type=_ratio,
        default=1.2,
        metavar="R",
        help="flag a rank whose own time is above R x the median of the ranks (default 1.2)",
    )
    add(
        "--min-busbw",
        type=_non_negative_float,
        metavar="X",
        help="fail (exit 1) when an op's busbw (GB/s) at its largest size is below X",
    )
    add("--no-gemm", dest="gemm", action="store_false", help="skip the per-device GEMM check")
    add_json_flag(parser)
    add("--result", type=Path, help=argparse.SUPPRESS)  # the workers' report file for the CLI


def run(args: argparse.Namespace) -> int:
    parse_ops(args.ops, args.axis)  # bad flags fail here, before any worker starts
    if args.sizes:
        parse_sizes(args.sizes, args.step_factor)
    worker = "LOCAL_RANK" in os.environ  # started by torchrun
    if worker:
        from dstrain.parallel.distributed import env_int  # imports torch: workers only

        world = env_int("WORLD_SIZE", 1)
    else:
        world = args.nproc or _default_nproc()
    if world < 2:
        raise UserError(
            f"collectives need at least 2 ranks, and this run has {world}",
            "use --nproc 2 or more (on a 2-core laptop 2; 4 ranks are oversubscribed and get "
            "about half the bandwidth)",
        )
    loaded, dims = _layout(args, world)
    if not worker:
        return _launch(args, world)
    return _run_here(args, loaded, dims)


def _layout(args: argparse.Namespace, world: int) -> tuple[LoadedConfig, ParallelDims | None]:
    """The loaded config and, with --axis, the layout's dims for `world` ranks (checked)."""
    layout_given = args.config or any(o.startswith("parallel.") for o in args.overrides)
    if args.axis and not layout_given:
        raise UserError(
            f"--axis {args.axis} needs a layout to take the axis from",
            f"give --config C (its parallel section), or --set parallel.{args.axis}=2 "
            f"(dp: parallel.dp_shard=2)",
        )
    loaded = load_config(args.config, args.overrides)
    raise_if_errors(loaded.findings)
    if not args.axis:
        return loaded, None
    dims = ParallelDims.of(loaded.config.parallel, world)
    check_axis(dims, args.axis)
    return loaded, dims


def _launch(args: argparse.Namespace, world: int) -> int:
    from dstrain.cli.launch import launch_local

    with tempfile.TemporaryDirectory(prefix="dstrain-bench-") as tmp:
        result = Path(tmp) / "report.json"
        code = launch_local(world, _worker_argv(args, result), module="dstrain.bench")
        if code != 0:
            return code
        if not result.exists():
            raise UserError("the workers wrote no report", "rerun; see the workers' output above")
        report = json.loads(result.read_text())
    return _show(report, args.json)


def _run_here(args: argparse.Namespace, loaded: LoadedConfig, dims: ParallelDims | None) -> int:
    """This process is one rank: measure, rank 0 reports, then leave through `shutdown`."""
    from dstrain.bench.comm import run_comm
    from dstrain.parallel.distributed import init_distributed, shutdown

    world = init_distributed(loaded.config.comm)
    spec = CommSpec(
        ops=parse_ops(args.ops, args.axis),
        sizes=tuple(parse_sizes(args.sizes or DEFAULT_SIZES[world.device.type], args.step_factor)),
        dtype=args.dtype,
        warmup=args.warmup,
        iters=args.iters,
        axis=args.axis,
        dims=dims,
        straggler_ratio=args.straggler_ratio,
        min_busbw=args.min_busbw,
        gemm=args.gemm,
        progress=not args.json,
    )
    report = run_comm(spec, world)
    code = 0
    if report is not None and args.result:
        args.result.write_text(json.dumps(report))  # the CLI process renders it
    elif report is not None:
        code = _show(report, args.json)
    # os._exit after destroying the group: dodges gloo's exit-time abort (TORCH-CPU-NOTES).
    shutdown(code)
    return code


def _show(report: dict[str, Any], as_json: bool) -> int:
    from dstrain.bench.table import render

    if as_json:
        sys.stdout.write(json.dumps(report, indent=2) + "\n")
    else:
        sys.stdout.write(render(report))
    sys.stdout.flush()
    if not report["passed"]:
        err = console(stderr=True)
        err.print("dstrain bench: FAIL: " + "; ".join(report["failures"]), markup=False)
        err.print(f"  fix: {report['fix']}", markup=False)
        return 1
    return 0


def _worker_argv(args: argparse.Namespace, result: Path) -> list[str]:
    argv = ["comm", "--ops", args.ops, "--step-factor", str(args.step_factor)]
    argv += ["--dtype", args.dtype, "--straggler-ratio", str(args.straggler_ratio)]
    for flag, value in (
        ("--sizes", args.sizes),
        ("--warmup", args.warmup),
        ("--iters", args.iters),
        ("--axis", args.axis),
        ("--config", args.config),
        ("--min-busbw", args.min_busbw),
    ):
        if value is not None:
            argv += [flag, str(value)]
    for override in args.overrides:
        argv += ["--set", override]
    if not args.gemm:
        argv.append("--no-gemm")
    if args.json:
        argv.append("--json")
    return [*argv, "--result", str(result)]


def _default_nproc() -> int:
    import torch  # the launch imports it anyway

    gpus = torch.cuda.device_count()
    return gpus if gpus >= 2 else 2


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return 2


def _ratio(text: str) -> float:
    value = _non_negative_float(text)
    if value <= 1:
        raise argparse.ArgumentTypeError(f"must be above 1 (e.g. 1.2), got {text}")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number: {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def main(argv: list[str]) -> int:
    """`python -m dstrain.bench ARGS` = `dstrain bench ARGS` (the workers' entry point)."""
    parser = argparse.ArgumentParser(prog="dstrain")
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", *argv])
    return run_guarded(args.func, args)
