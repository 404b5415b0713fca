"""`dstrain ckpt ...`: work with checkpoints. `export-hf` is built; `inspect` and `diff` arrive
with the fault-tolerance issue."""

import argparse
from pathlib import Path

from dstrain.cli.common import console, not_built


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("ckpt", help="export (and later inspect, diff) checkpoints")
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    export = actions.add_parser(
        "export-hf",
        help="write a run's newest checkpoint as a Hugging Face model folder",
        description="Write config.json + model.safetensors in the DeepseekV3 (sigmoid routing) "
        "or DeepseekV2 (softmax) layout; `transformers` loads it with from_pretrained. MTP "
        "modules are written as extra layers after the last one, as DeepSeek publishes them.",
        epilog="example: dstrain ckpt export-hf runs/default -o hf-debug",
    )
    export.add_argument("source", type=Path, metavar="RUN_DIR", help="runs/<name> or a step-N")
    export.add_argument("-o", "--output", type=Path, required=True, help="folder to write")
    export.set_defaults(func=_export)
    for name, what in (
        ("inspect", "print step, layout, tokens, size, validity"),
        ("diff", "say what a new config would reshard"),
    ):
        later = actions.add_parser(name, help=f"{what} (not built yet)")
        later.set_defaults(
            func=not_built(f"ckpt {name}", "the checkpoint issue"), accepts_anything=True
        )


def _export(args: argparse.Namespace) -> int:
    from dstrain.checkpoint.export import export_hf  # torch only when exporting

    ckpt = export_hf(args.source, args.output)
    console().print(f"exported {ckpt} -> {args.output}", markup=False)
    return 0
