"""The `dstrain` command: one subcommand per file, registered in COMMANDS below."""

import argparse
import sys
from collections.abc import Sequence

from dstrain import __version__
from dstrain.cli import (
    bench,
    check,
    ckpt,
    config_cmd,
    convert,
    deploy,
    doctor,
    loss_compare,
    plan,
    report,
    schedule,
    status,
    train,
)
from dstrain.cli.common import run_guarded

# Each module has `register(subparsers)`, which adds its subcommand(s) and sets `func`.
COMMANDS = (
    check,
    convert,
    config_cmd,
    train,
    status,
    ckpt,
    loss_compare,
    schedule,
    report,
    plan,
    doctor,
    bench,
    deploy,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dstrain",
        description="Plan, check, launch, train and report distributed training of DeepSeek-style "
        "models (MLA, DeepSeekMoE, MTP) on PyTorch's own distributed engine.",
        epilog="Start with `dstrain train` (a tiny model on CPU) or `dstrain check CONFIG`. "
        "`dstrain COMMAND --help` explains each command.",
    )
    parser.add_argument("--version", action="version", version=f"dstrain {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in COMMANDS:
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return run_guarded(args.func, args)


if __name__ == "__main__":
    sys.exit(main())
