"""`dstrain convert FILE -o run.toml`: a DeepSpeed/Megatron (or dstrain) config as dstrain TOML."""

import argparse
import os
import tempfile
from pathlib import Path

from dstrain.cli.check import print_findings
from dstrain.cli.common import add_config_args, add_json_flag, console, print_json
from dstrain.config.findings import has_errors
from dstrain.config.load import to_toml
from dstrain.errors import UserError
from dstrain.interop.load import load_any
from dstrain.preflight.preflight import preflight


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "convert",
        help="convert a DeepSpeed JSON (with Megatron keys) to a dstrain TOML config",
        description="Map every key of a DeepSpeed/Megatron config onto dstrain's config tree. "
        "Keys without an equivalent are reported (and listed as comments in the output); "
        "unknown or misspelt keys are errors and nothing is written.",
        epilog="example: dstrain convert ds_config.json -o run.toml --set model.flavor=debug",
    )
    add_config_args(parser, required=True, foreign=True)
    parser.add_argument("-o", "--output", type=Path, required=True, help="TOML file to write")
    add_json_flag(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    loaded = load_any(args.config, args.overrides)
    findings = preflight(loaded, None)
    load_errors = has_errors(loaded.findings)
    if not load_errors:
        header = [f"# converted from {args.config} by `dstrain convert`"]
        header += [f"# {f.severity}: {f.key}: {f.message}" for f in loaded.findings]
        _write_atomic(args.output, "\n".join(header) + "\n\n" + to_toml(loaded.config))
    if args.json:
        print_json(
            {
                "written": None if load_errors else str(args.output),
                "findings": [f.as_dict() for f in findings],
            }
        )
    else:
        print_findings(f"{args.config} -> {args.output}", findings)
        state = "not written (fix the errors first)" if load_errors else "written"
        console().print(f"{args.output}: {state}", markup=False)
    return 1 if load_errors else 0


def _write_atomic(path: Path, text: str) -> None:
    if path.is_dir():
        raise UserError(f"{path} is a directory", "give a file name, e.g. -o run.toml")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.exists():
        raise UserError(f"folder {parent} does not exist", "create it first")
    try:
        fd, tmp = tempfile.mkstemp(dir=parent, prefix=f".{path.name}.")
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.replace(tmp, path)
    except OSError as exc:
        raise UserError(
            f"cannot write {path}: {exc.strerror}", "check the folder's permissions"
        ) from None
