"""`dstrain check CONFIG`: the pre-flight, in milliseconds, with no GPU and no process group."""

import argparse
import contextlib

from dstrain.cli.common import add_config_args, add_json_flag, console, positive_int, print_json
from dstrain.config.findings import SEVERITIES, Finding, has_errors, has_unsupported
from dstrain.config.load import LoadedConfig
from dstrain.errors import UserError
from dstrain.interop.ds_keys import NEWEST_RELEASE
from dstrain.interop.ds_lint import IMPORT_RULES
from dstrain.interop.imported import Judges
from dstrain.interop.load import load_any
from dstrain.preflight.preflight import preflight
from dstrain.preflight.rules import RULES

_EPILOG = """\
An imported config (DeepSpeed JSON, a Megatron-LM / Megatron-DeepSpeed launch script) answers
two questions apart. First: would its own engine accept it, and what would it build? Then: can
dstrain run it, and how does it map? Each finding has one level:

  ERROR        the file's own engine refuses it (for a dstrain config: dstrain does); the fix
               is named
  UNSUPPORTED  the engine runs it, dstrain cannot yet ("runs under Megatron-LM; dstrain cannot
               yet: ..."); `dstrain convert` still writes the mapping
  WARNING      worth reading: likely a mistake, or a value the engine ignores or coerces
  INFO         what was inferred or mapped, and what could not be resolved (a script's
               variables set elsewhere are named, never guessed)

`--json` prints the findings as a list of {severity, key, message, fix}; severity is the level.

exit status:
  0  accepted: warnings, notes and (unless --for dstrain) UNSUPPORTED findings only
  1  errors: the engine (or dstrain, for its own config) would refuse it
  2  the input cannot be read (a missing file, invalid JSON/TOML)
  3  with --for dstrain: no errors, but dstrain cannot run it (UNSUPPORTED findings)

The world size comes from --world-size, else --nodes x --gpus-per-node, else the config's
cluster.nodes x cluster.gpus_per_node when set (#SBATCH / torchrun flags in a script), else the
product of explicit parallel degrees. `dstrain check --rules` lists the rules.

With model.init_from set, its Hugging Face folder is checked too, from the safetensors headers
and the index alone (seconds for DeepSeek-V3's 163 files), and the bytes the first and the last
rank will read are planned on their real runtimes (`dstrain ckpt verify-hf` covers every
pipeline position).

examples:
  dstrain check run.toml --world-size 16
  dstrain check ds_config.json --nodes 4 --gpus-per-node 8 --set model.flavor=deepseek-v3
  dstrain check pretrain_gpt.sh --for dstrain      # exit 3 if only dstrain could not run it
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
    add_config_args(parser, foreign=True)
    parser.add_argument("--world-size", type=positive_int, metavar="N", help="total ranks (GPUs)")
    parser.add_argument(
        "--nodes", type=positive_int, metavar="N", help="nodes (with --gpus-per-node)"
    )
    parser.add_argument("--gpus-per-node", type=positive_int, metavar="G", help="ranks per node")
    parser.add_argument(
        "--for",
        dest="judge",
        choices=("engine", "dstrain"),
        default="engine",
        help="whose verdict sets the exit status for an imported file: `engine` (default: its "
        "own engine's; what dstrain cannot run is reported, exit 0) or `dstrain` (exit 3 when "
        "dstrain cannot run it)",
    )
    parser.add_argument(
        "--deepspeed-release",
        metavar="X.Y.Z",
        help=f"judge a DeepSpeed file by this release's rules (default {NEWEST_RELEASE}, the "
        "newest modelled; 0.18.9 keeps the features 0.19 removed, 0.16.9 reads fp16/bf16 "
        "loosely). With DeepSpeed installed, the engine's own loader also judges the file",
    )
    parser.add_argument(
        "--deepspeed-initialize",
        action="store_true",
        help="with DeepSpeed installed, also run deepspeed.initialize and one optimizer step "
        "with the file on a tiny model (1 rank, gloo, DeepSpeed's CPU accelerator, in a child "
        "process): catches what only the engine's first step refuses. An Adam optimizer section "
        "compiles DeepSpeed's CPU op for it on first use (about a minute; cached after)",
    )
    parser.add_argument("--rules", action="store_true", help="list the rules and exit")
    add_json_flag(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.rules:
        return _list_rules(args.json)
    if args.config is None and not args.overrides:
        raise UserError("no config given", "dstrain check CONFIG [--world-size N]")
    return _check(args)


def _initialize_status(judges: Judges) -> contextlib.AbstractContextManager:
    """A live line while deepspeed.initialize runs (its first use compiles ops for a minute)."""
    if not judges.deepspeed_initialize:
        return contextlib.nullcontext()
    return console(stderr=True).status(
        "dstrain check: deepspeed.initialize and one step on a tiny model (an Adam section "
        "compiles DeepSpeed's CPU op on first use: about a minute) ..."
    )


def _check(args: argparse.Namespace) -> int:
    try:
        judges = Judges(args.deepspeed_release, args.deepspeed_initialize)
        with _initialize_status(judges):
            loaded = load_any(args.config, args.overrides, judges)
    except UserError as exc:
        if not args.json:
            raise
        # Scripts asked for JSON: the unreadable input is one finding, with the same exit code.
        print_json(
            [{"severity": "error", "key": str(args.config), "message": exc.message, "fix": exc.fix}]
        )
        return exc.exit_code
    world = world_size(args, loaded.config, imported=loaded.engine is not None)
    findings = preflight(loaded, world)
    findings += _init_from_findings(loaded, world, findings)
    if args.json:
        print_json([f.as_dict() for f in findings])
    else:
        what = {
            "deepspeed": "DeepSpeed/Megatron config",
            "dstrain": "dstrain config",
            "script": "launch script",
        }.get(loaded.source, "defaults")
        where = f"world size {world}" if world else "world size unknown"
        judged = f", judged as {loaded.engine} would" if loaded.engine else ""
        print_findings(f"{args.config or 'defaults'} ({what}{judged}, {where})", findings)
    return exit_status(findings, args.judge)


def _init_from_findings(
    loaded: LoadedConfig, world: int | None, findings: list[Finding]
) -> list[Finding]:
    """model.init_from's checkpoint from its headers; with a sound config and a world size, what
    the first and the last rank will read."""
    config = loaded.config
    if config.model.init_from is None or has_errors(findings):
        return []
    from dstrain.checkpoint.hf_check import init_from_findings
    from dstrain.config.flavors import resolve_model_args

    return init_from_findings(config, resolve_model_args(config.model), world)


def exit_status(findings: list[Finding], judge: str = "engine") -> int:
    """0 accepted, 1 errors, 3 only dstrain cannot run it (asked with --for dstrain)."""
    if has_errors(findings):
        return 1
    return 3 if judge == "dstrain" and has_unsupported(findings) else 0


def world_size(args: argparse.Namespace, config, imported: bool = False) -> int | None:
    """--world-size, else --nodes x --gpus-per-node, else the config's cluster section. An
    imported file must give both halves itself (a script's `--nnodes 2` with a GPU count from
    `$(nvidia-smi ...)` has no world size; dstrain's default of 8 per node would be a guess)."""
    if args.world_size:
        return args.world_size
    if args.nodes or args.gpus_per_node:
        return (args.nodes or 1) * (args.gpus_per_node or config.cluster.gpus_per_node)
    cluster = config.cluster
    given = {"nodes", "gpus_per_node"} & cluster.model_fields_set
    if given == {"nodes", "gpus_per_node"} or (given and not imported):
        return cluster.nodes * cluster.gpus_per_node
    return None


_STYLE = {"error": "bold red", "unsupported": "magenta", "warning": "yellow", "info": "cyan"}


def print_findings(title: str, findings: list[Finding]) -> None:
    out = console()
    out.print(f"dstrain check: {title}", markup=False)
    for f in sorted(findings, key=lambda f: SEVERITIES.index(f.severity)):
        out.print(f"  {f.severity.upper():11} ", style=_STYLE[f.severity], end="")
        out.print(f"{f.key}: {f.message}", markup=False)
        if f.fix:
            out.print(f"              fix: {f.fix}", markup=False, style="dim")
    counts = {s: sum(f.severity == s for f in findings) for s in SEVERITIES}
    verdict = "FAIL" if counts["error"] else "OK"
    cannot = f", {counts['unsupported']} dstrain cannot run yet" if counts["unsupported"] else ""
    out.print(
        f"{verdict}: {counts['error']} error(s){cannot}, {counts['warning']} warning(s), "
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
