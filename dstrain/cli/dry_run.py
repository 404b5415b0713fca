"""`dstrain train CONFIG --dry-run --world-size N [--rank R ...] [--json]`: build the ranks' real
runtimes on torch's fake process group (`dstrain/train/dry_run.py`) and print what each holds."""

import argparse
from typing import Any

from dstrain.cli.common import console, print_json, refuse_ranks_outside, size_text
from dstrain.config.load import LoadedConfig
from dstrain.errors import UserError

GiB = 2**30


def add_dry_run_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "dry run (no GPU, no network: any rank of any world size, in this process)"
    )
    group.add_argument(
        "--dry-run",
        action="store_true",
        help="build the runtime of --rank on torch's fake process group with the model on meta "
        "(the training code path: meshes, parallelize_model, pipeline stages, optimizer), run "
        "one step under fake tensors where it can, and report each rank's memory",
    )
    group.add_argument(
        "--world-size",
        type=int,
        metavar="N",
        help="ranks to simulate (default: cluster.nodes x cluster.gpus_per_node, else --nproc)",
    )
    group.add_argument(
        "--rank",
        dest="ranks",
        type=int,
        nargs="+",
        metavar="R",
        help="ranks to build, one after the other (default: 0 and the last: first and last "
        "pipeline stage)",
    )
    group.add_argument(
        "--no-step", action="store_true", help="build only; skip the step under fake tensors"
    )


def dry_run_world(args: argparse.Namespace, loaded: LoadedConfig) -> int:
    """The world size a dry run simulates."""
    if args.world_size is not None:
        if args.world_size < 1:
            raise UserError(f"--world-size {args.world_size}", "give a world size >= 1")
        return args.world_size
    cluster = loaded.config.cluster
    if "nodes" in cluster.model_fields_set or "gpus_per_node" in cluster.model_fields_set:
        return cluster.nodes * cluster.gpus_per_node
    return args.nproc


def run_dry(args: argparse.Namespace, loaded: LoadedConfig, world: int) -> int:
    ranks = args.ranks if args.ranks else sorted({0, world - 1})
    refuse_ranks_outside(ranks, world, exit_code=1)
    from dstrain.train.dry_run import dry_run_rank  # torch loads only for a good config

    out = console(stderr=args.json)
    reports = []
    for rank in ranks:
        out.print(f"dry run: building rank {rank} of {world} ...", markup=False)
        report = dry_run_rank(loaded.config, world, rank, step=not args.no_step)
        reports.append(report.to_json())
        if not args.json:
            _print_rank(out, reports[-1])
    if args.json:
        print_json(reports if len(reports) > 1 else reports[0])
    return 0


def _print_rank(out: Any, r: dict[str, Any]) -> None:
    coords = " ".join(f"{a}{r['coords'][a]}/{r['groups'][a]}" for a in r["coords"])
    out.print(f"rank {r['rank']} of {r['world_size']}: {coords}", markup=False)
    for stage in r["stages"]:
        extras = [n for n in ("embed", "head", "mtp") if stage[n]]
        layers = _span(stage["layers"])
        out.print(
            f"  stage {stage['stage']}: layers {layers}"
            + (f" + {', '.join(extras)}" if extras else ""),
            markup=False,
        )
    rows = [("parameters", r["params_bytes"]), ("gradients", r["grads_bytes"])]
    rows.append(("optimizer", r["optimizer_bytes"]))
    out.print(f"  {'':12} {'dense GiB':>10} {'expert GiB':>11}", markup=False)
    for name, part in rows:
        out.print(
            f"  {name:12} {part['dense'] / GiB:>10.3f} {part['expert'] / GiB:>11.3f}", markup=False
        )
    out.print(f"  model states {r['model_states_bytes'] / GiB:.3f} GiB", markup=False)
    if r["host_bytes"]:
        out.print(f"  offloaded to the host {r['host_bytes'] / GiB:.3f} GiB", markup=False)
    out.print(
        f"  build peak {r['build_peak_bytes'] / GiB:.3f} GiB (the whole fp32 model, which "
        f"every rank built before: {r['full_model_bytes'] / GiB:.1f} GiB)",
        markup=False,
    )
    act = r["activation_peak_bytes"]
    shown = f"{act / GiB:.3f} GiB" if act is not None else "-"
    out.print(f"  activation peak {shown}; step {r['step']}", markup=False)
    if r["loss_peak_bytes"] is not None:
        out.print(
            f"  of which the loss: {r['loss_peak_bytes'] / GiB:.3f} GiB (this rank's logits, "
            "and the cross-entropy's peak over them)",
            markup=False,
        )
    if r["init_from"] is not None:
        _print_init_from(out, r["init_from"])
    if r["recompute_flops_per_step"]:
        out.print(
            f"  recomputed in backward: {r['recompute_flops_per_step'] / 1e12:.1f} TFLOP per step",
            markup=False,
        )
    secs = ", ".join(f"{k} {v:.1f} s" for k, v in r["seconds"].items())
    out.print(f"  time: {secs}", markup=False)


def _span(layers: list[int]) -> str:
    if not layers:
        return "none"
    if layers == list(range(layers[0], layers[-1] + 1)):
        return f"{layers[0]}-{layers[-1]}" if len(layers) > 1 else str(layers[0])
    return ", ".join(map(str, layers))


def _print_init_from(out: Any, reads: dict[str, Any]) -> None:
    verb = "read" if reads["read"] else "would read"
    share = reads["share_bytes"]
    ratio = f", {reads['bytes'] / share:.3f}x its share" if share else ""
    out.print(
        f"  init_from: {verb} {size_text(reads['bytes'])} from {reads['files']} file(s), "
        f"{reads['tensors']} slices (its shards: {size_text(share)}{ratio}; the checkpoint: "
        f"{size_text(reads['checkpoint_bytes'])})",
        markup=False,
    )
