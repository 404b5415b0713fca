"""What every subcommand shares: config arguments, JSON output, and turning bad input into one
clear message (never a traceback)."""

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console

from dstrain.errors import UserError


def console(stderr: bool = False) -> Console:
    return Console(stderr=stderr, highlight=False, soft_wrap=True)


def add_config_args(
    parser: argparse.ArgumentParser, required: bool = False, foreign: bool = False
) -> None:
    """CONFIG and repeatable --set overrides. `foreign`: the command also reads other engines'
    files (check, convert); the others take dstrain's own config."""
    what = (
        "dstrain TOML/YAML/JSON, a DeepSpeed JSON (Megatron keys allowed) or a Megatron / "
        "NeMo / ms-swift launch script"
        if foreign
        else "dstrain TOML/YAML/JSON (another engine's file: `dstrain convert` it first)"
    )
    parser.add_argument(
        "config",
        nargs=None if required else "?",
        type=Path,
        metavar="CONFIG",
        help=f"config file: {what}" + ("" if required else "; omitted = the built-in defaults"),
    )
    add_set_arg(
        parser,
        "override one config key, e.g. --set parallel.tp=2 (repeatable; beats the file, which "
        "beats the defaults)",
    )


def add_set_arg(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    help_text: str = "override a config key, e.g. --set parallel.tp=2 (repeatable)",
) -> None:
    """The repeatable `--set SECTION.KEY=VALUE` override, collected in `args.overrides`."""
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help=help_text,
    )


def _whole_number(minimum: int) -> Callable[[str], int]:
    """An argparse type for counts: a whole number >= minimum."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


positive_int = _whole_number(1)
non_negative_int = _whole_number(0)


def add_json_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON")


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


def run_guarded(func: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """Run a subcommand; bad input becomes one message on stderr and its exit code."""
    try:
        return func(args)
    except UserError as exc:
        err = console(stderr=True)
        err.print(f"dstrain {args.command}: error: {exc.message}", markup=False)
        if exc.fix:
            err.print(f"  fix: {exc.fix}", markup=False)
        return exc.exit_code
    except KeyboardInterrupt:
        console(stderr=True).print("interrupted", markup=False)
        return 130
    except BrokenPipeError:
        return 0


def size_text(n: float) -> str:
    """Bytes for people: `512 B`, `1.5 KiB` ... `3.2 TiB`."""
    if n < 1024:
        return f"{int(n)} B"
    for power, unit in ((4, "TiB"), (3, "GiB"), (2, "MiB"), (1, "KiB")):
        if n >= 1024**power:
            return f"{n / 1024**power:.1f} {unit}"
    raise AssertionError(n)


def refuse_ranks_outside(ranks: list[int], world: int, exit_code: int = 2) -> None:
    """`--rank R ...` must name ranks of the world of `world` ranks."""
    bad = [r for r in ranks if not 0 <= r < world]
    if bad:
        raise UserError(
            f"--rank {' '.join(map(str, bad))} outside the world of {world} ranks",
            f"give ranks in 0..{world - 1}",
            exit_code=exit_code,
        )
