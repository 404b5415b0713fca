"""Subcommands that later issues fill. Each says so and exits 2; when one is built it moves to a
file of its own and out of this table."""

import argparse

from dstrain.cli.common import not_built

# name, one-line help, the issue that builds it
PENDING = (
    (
        "bench",
        "measure collective bandwidth with nccl-tests semantics",
        "the cluster-tooling issue",
    ),
)


def register(sub: argparse._SubParsersAction) -> None:
    for name, help_text, issue in PENDING:
        parser = sub.add_parser(name, help=f"{help_text} (not built yet)", description=help_text)
        parser.set_defaults(func=not_built(name, issue), accepts_anything=True)
