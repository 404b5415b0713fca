"""`dstrain check CONFIG`: the pre-flight, in milliseconds, with no GPU and no process group."""

import argparse

from dstrain.cli.common import add_config_args, add_json_flag, console, positive_int, print_json
from dstrain.config.ds_lint import IMPORT_RULES
from dstrain.config.findings import Finding, has_errors
from dstrain.config.load import load_config
from dstrain.config.preflight import preflight
from dstrain.config.rules import RULES
from dstrain.errors import UserError

_EPILOG = """\
exit status: 0 clean or warnings only, 1 errors, 2 the input cannot be read.

The world size comes from --world-size, else --nodes x --gpus-per-node, else the config's
cluster.nodes x cluster.gpus_per_node when set, else the product of explicit parallel degrees.
DeepSpeed JSON configs (with Megatron keys such as tensor_model_parallel_size beside them) are
converted first; every key is mapped or reported. `dstrain check --rules` lists the rules.

examples:
  dstrain check run.toml --world-size 16
  dstrain check ds_config.json --nodes 4 --gpus-per-node 8 --set model.flavor=deepseek-v3
  dstrain check run.toml --json | jq '.[] | select(.severity == "error")'
"""


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "check",
        help="pre-flight a config (ours or DeepSpeed's) for a world size, in milliseconds",
        description="Report every problem in a config at once, each with its fix: parallel "
        "degrees vs world size, batch arithmetic, pipeline splits and schedules, expert and "
        "tensor divisibility, ZeRO/offload/compression combinations, precision vs hardware, "
        "unknown or misspelt keys.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_args(parser)
    parser.add_argument("--world-size", type=positive_int, metavar="N", help="total ranks (GPUs)")
    parser.add_argument(
        "--nodes", type=positive_int, metavar="N", help="nodes (with --gpus-per-node)"
    )
    parser.add_argument("--gpus-per-node", type=positive_int, metavar="G", help="ranks per node")
    parser.add_argument("--rules", action="store_true", help="list the rules and exit")
    add_json_flag(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.rules:
        return _list_rules(args.json)
    if args.config is None and not args.overrides:
        raise UserError("no config given", "dstrain check CONFIG [--world-size N]")
    try:
        loaded = load_config(args.config, args.overrides)
    except UserError as exc:
        if not args.json:
            raise
        # Scripts asked for JSON: the unreadable input is one finding, with the same exit code.
        print_json(
            [{"severity": "error", "key": str(args.config), "message": exc.message, "fix": exc.fix}]
        )
        return exc.exit_code
    world = world_size(args, loaded.config)
    findings = preflight(loaded, world)
    if args.json:
        print_json([f.as_dict() for f in findings])
    else:
        what = {
            "deepspeed": "DeepSpeed/Megatron config",
            "dstrain": "dstrain config",
            "script": "launch script",
        }.get(loaded.source, "defaults")
        where = f"world size {world}" if world else "world size unknown"
        print_findings(f"{args.config or 'defaults'} ({what}, {where})", findings)
    return 1 if has_errors(findings) else 0


def world_size(args: argparse.Namespace, config) -> int | None:
    """--world-size, else --nodes x --gpus-per-node, else the config's cluster section."""
    if args.world_size:
        return args.world_size
    if args.nodes or args.gpus_per_node:
        return (args.nodes or 1) * (args.gpus_per_node or config.cluster.gpus_per_node)
    cluster = config.cluster
    if {"nodes", "gpus_per_node"} & cluster.model_fields_set:
        return cluster.nodes * cluster.gpus_per_node
    return None


_STYLE = {"error": "bold red", "warning": "yellow", "info": "cyan"}


def print_findings(title: str, findings: list[Finding]) -> None:
    out = console()
    out.print(f"dstrain check: {title}", markup=False)
    order = {"error": 0, "warning": 1, "info": 2}
    for f in sorted(findings, key=lambda f: order[f.severity]):
        out.print(f"  {f.severity.upper():7} ", style=_STYLE[f.severity], end="")
        out.print(f"{f.key}: {f.message}", markup=False)
        if f.fix:
            out.print(f"          fix: {f.fix}", markup=False, style="dim")
    counts = {s: sum(f.severity == s for f in findings) for s in order}
    verdict = "FAIL" if counts["error"] else "OK"
    out.print(
        f"{verdict}: {counts['error']} error(s), {counts['warning']} warning(s), "
        f"{counts['info']} note(s)",
        style="bold red" if counts["error"] else "bold green",
    )


def _list_rules(as_json: bool) -> int:
    rules = [(r.__name__.removeprefix("rule_"), (r.__doc__ or "").strip()) for r in RULES]
    rules += list(IMPORT_RULES)
    if as_json:
        print_json([{"rule": name, "description": doc} for name, doc in rules])
    else:
        for name, doc in rules:
            console().print(f"{name:24} {doc}", markup=False)
    return 0
