"""`dstrain config`: print the resolved config, or explain its keys."""

import argparse

from dstrain.cli.common import add_config_args, add_json_flag, console, print_json
from dstrain.config.load import load_config, to_toml
from dstrain.config.validate import raise_if_errors
from dstrain.preflight.explain import explain, flavor_summary, section_doc


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "config",
        help="print the resolved config (defaults < file < --set) or explain its keys",
        description="Without --explain: print the config that would run, as TOML (or JSON), "
        "after applying the file and --set overrides. With --explain [KEY]: describe every key "
        "under KEY (a section like `parallel`, or a key like `train.seq_len`).",
        epilog="examples:\n  dstrain config --explain parallel\n  dstrain config run.toml "
        "--set parallel.tp=2 > resolved.toml",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_args(parser)
    parser.add_argument(
        "--explain",
        nargs="?",
        const="",
        metavar="KEY",
        help="describe the keys under KEY (all keys when KEY is omitted)",
    )
    add_json_flag(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.explain is not None:
        return _explain(args.explain, args.json)
    loaded = load_config(args.config, args.overrides)
    raise_if_errors(loaded.findings)
    config = loaded.config
    if args.json:
        print_json(config.model_dump(mode="json"))
    else:
        console().print(to_toml(config), markup=False, end="")
    return 0


def _explain(prefix: str, as_json: bool) -> int:
    docs = explain(prefix or None)
    if as_json:
        print_json([d.__dict__ for d in docs])
        return 0
    out = console()
    section = None
    for doc in docs:
        head = doc.key.split(".")[0]
        if head != section:
            section = head
            out.print(f"\n[{head}]  {section_doc(head)}", markup=False, style="bold")
            if head == "model":
                for line in flavor_summary():
                    out.print(f"  flavor {line}", markup=False, style="dim")
        default = "None" if doc.default is None else repr(doc.default)
        out.print(f"  {doc.key} ({doc.type}, default {default})", markup=False, style="cyan")
        out.print(f"      {doc.description}", markup=False)
    return 0
