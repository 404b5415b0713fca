"""`dstrain train [CONFIG]`: validate the config, then train (the trainer arrives with issue 3)."""

import argparse

from dstrain.cli.common import NOT_BUILT_EXIT, add_config_args, console
from dstrain.config.load import load_config
from dstrain.config.preflight import preflight
from dstrain.config.validate import raise_if_errors


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "train",
        help="train (no arguments: the debug model on the embedded corpus, on CPU)",
        description="Run the pre-flight checks on the config, then train.",
    )
    add_config_args(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    loaded = load_config(args.config, args.overrides)
    raise_if_errors(preflight(loaded, world_size=1))
    console(stderr=True).print(
        "dstrain train: the config passes the pre-flight; the trainer itself is not built yet "
        "(the model/training issue).",
        markup=False,
    )
    return NOT_BUILT_EXIT
