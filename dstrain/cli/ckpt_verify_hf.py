"""`dstrain ckpt verify-hf DIR --config C [--rank R ...] [--world-size N] [--json]`: a Hugging
Face checkpoint folder against a config's model and layout, from headers alone
(`dstrain/checkpoint/hf_check.py`)."""

import argparse
from pathlib import Path
from typing import Any

from dstrain.cli.common import (
    add_json_flag,
    add_set_arg,
    console,
    positive_int,
    print_json,
    refuse_ranks_outside,
    size_text,
)
from dstrain.config.flavors import resolve_model_args
from dstrain.config.load import load_config
from dstrain.config.validate import raise_if_errors
from dstrain.errors import UserError
from dstrain.preflight.preflight import preflight

_EPILOG = """\
What it reads: config.json, model.safetensors.index.json and each file's header (a few MB for
DeepSeek-V3's 163 files), never tensor data. It reports every tensor that is missing, extra,
mis-shaped, of a dtype the loader does not read, or with a missing or mis-shaped FP8 block scale,
and every damaged file (cut short, a header length that lies, a shard the index names but the
folder lacks, an index placing a tensor in the wrong file). Then, for each rank asked, the bytes
and files its load will read, from that rank's real runtime built on torch's fake process group.

The architecture is the config's (model.flavor / hf_config / overrides), else DIR's config.json.
The ranks: --rank, else the first rank of each pipeline position and the last rank.
Exit status: 0 it fits, 1 it does not, 2 an input cannot be read.

examples:
  dstrain ckpt verify-hf /data/DeepSeek-V3 --config examples/deepseek-v3-h800x2048.toml
  dstrain ckpt verify-hf /data/DeepSeek-V3 --config run.toml --rank 0 2047 --json
"""


def register(actions: argparse._SubParsersAction) -> None:
    parser = actions.add_parser(
        "verify-hf",
        help="check a Hugging Face checkpoint against a config before launch, from headers alone",
        description="Check a Hugging Face DeepSeek checkpoint folder (DeepSeek-V3/R1/V3.1, "
        "V2, V2-Lite, or a dstrain export) against the model and layout of a config, and say "
        "what each rank will read, without reading tensor data.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("folder", type=Path, metavar="DIR", help="the checkpoint folder")
    parser.add_argument(
        "--config", type=Path, required=True, metavar="C", help="the run's config (its layout)"
    )
    add_set_arg(parser)
    parser.add_argument("--world-size", type=positive_int, metavar="N", help="total ranks")
    parser.add_argument(
        "--rank", dest="ranks", type=int, nargs="+", metavar="R", help="ranks to plan reads for"
    )
    add_json_flag(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dstrain.checkpoint.hf_check import default_ranks, verify_hf  # torch when planning

    if not (args.folder / "config.json").exists():
        raise UserError(
            f"{args.folder} is not a Hugging Face checkpoint folder (no config.json)",
            "give the folder holding config.json and the *.safetensors files",
        )
    overrides = [*args.overrides, f'model.init_from="{args.folder}"']
    loaded = load_config(args.config, overrides)
    world = _world(args, loaded.config)
    raise_if_errors([f for f in preflight(loaded, world) if f.key != "data.source"])
    ranks = args.ranks if args.ranks else default_ranks(loaded.config, world)
    refuse_ranks_outside(ranks, world)
    args_model = resolve_model_args(loaded.config.model)
    result = verify_hf(args.folder, loaded.config, args_model, world, ranks)
    if args.json:
        print_json(result.to_json() | {"world_size": world})
    else:
        _print(result, world)
    return 0 if result.ok else 1


def _world(args: argparse.Namespace, config: Any) -> int:
    if args.world_size:
        return args.world_size
    cluster = config.cluster
    if {"nodes", "gpus_per_node"} & cluster.model_fields_set:
        return cluster.nodes * cluster.gpus_per_node
    p = config.parallel
    return max(1, p.pp * p.dp_replicate * max(1, p.dp_shard) * p.tp)


def _print(result: Any, world: int) -> None:
    out = console()
    out.print(
        f"{result.folder}: {result.tensors:,} tensors in {result.files} file(s), "
        f"{size_text(result.checkpoint_bytes)}; headers checked in "
        f"{result.header_seconds:.2f} s",
        markup=False,
    )
    for note in result.notes:
        out.print(f"  note: {note}", markup=False)
    if result.problems:
        from dstrain.model.hf_verify import summary

        out.print(f"FAIL: {len(result.problems)} problem(s)", style="bold red")
        out.print(f"  {summary(result.problems)}", markup=False)
        return
    out.print(f"OK: the folder fits the model; reads per rank of {world}:", style="bold green")
    for r in result.ranks:
        share = r["share_bytes"]
        ratio = f"{r['bytes'] / share:.3f}x its shards" if share else "-"
        out.print(
            f"  rank {r['rank']:>5}: {size_text(r['bytes']):>10} from {r['files']:>3} file(s), "
            f"{r['tensors']:>6} slices ({ratio}; planned in {r['seconds']:.1f} s)",
            markup=False,
        )
