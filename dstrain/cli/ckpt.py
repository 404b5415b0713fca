"""`dstrain ckpt ...`: inspect, diff and export checkpoints (`verify-hf`: ckpt_verify_hf.py).

`inspect` and `diff` read only the checkpoints' manifests (JSON) and the files' sizes or hashes:
no torch, so they answer in milliseconds on a laptop. `export-hf` imports torch when it runs.
"""

import argparse
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

from dstrain.checkpoint.catalog import KINDS, checkpoints, latest_valid, locate, step_of
from dstrain.checkpoint.manifest import Verdict, read_meta, verify
from dstrain.checkpoint.resume import ResumeDiff, compare
from dstrain.cli import ckpt_verify_hf
from dstrain.cli.common import (
    add_json_flag,
    add_set_arg,
    console,
    positive_int,
    print_json,
    size_text,
)
from dstrain.config.load import load_config
from dstrain.config.schema import DstrainConfig
from dstrain.config.validate import raise_if_errors
from dstrain.errors import UserError

_INSPECT_EPILOG = """\
Validity is what auto-resume checks: checkpoints under 2 GiB by the sha256 of every file, larger
ones by file sizes (which catch the missing and truncated files a crash or a full disk leaves);
--full hashes every file whatever its size. Exit status: 0 when listed, 2 when PATH cannot be read.

examples:
  dstrain ckpt inspect runs/default
  dstrain ckpt inspect runs/default/checkpoints/step-400 --full
  dstrain ckpt inspect runs/default --json | jq '.checkpoints[] | select(.valid | not)'
"""

_DIFF_EPILOG = """\
DCP reshards the model and optimizer state on load, so dp_replicate, dp_shard, tp, pp, ep, the
ZeRO stage and the pipeline schedule may change; the data continues from its global sample
position. What cannot change: the architecture (any model field), the optimizer kind, ZeRO-1
(not checkpointable yet), and a world size the new layout does not fit.

The new world size comes from --world-size, else the config's cluster section when set, else the
checkpoint's own. Exit status: 0 it can resume, 1 it cannot, 2 an input cannot be read.

example: dstrain ckpt diff runs/default --config bigger.toml --world-size 16
"""


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "ckpt", help="inspect, diff and export checkpoints; verify a Hugging Face one"
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    _register_inspect(actions)
    _register_diff(actions)
    ckpt_verify_hf.register(actions)
    export = actions.add_parser(
        "export-hf",
        help="write a run's newest checkpoint as a Hugging Face model folder",
        description="Write config.json, model-0000N-of-0000M.safetensors and "
        "model.safetensors.index.json in the DeepseekV3 (sigmoid routing) or DeepseekV2 "
        "(softmax) layout; `transformers` loads it with from_pretrained, and `model.init_from` "
        "trains from it. MTP modules are written as extra layers after the last one, as "
        "DeepSeek publishes them. Streamed: the host holds about one output file at a time.",
        epilog="example: dstrain ckpt export-hf runs/default -o hf-debug --dtype bf16",
    )
    export.add_argument("source", type=Path, metavar="RUN_DIR", help="runs/<name> or a step-N")
    export.add_argument("-o", "--output", type=Path, required=True, help="folder to write")
    export.add_argument(
        "--dtype",
        choices=("bf16", "fp16", "fp32", "fp8"),
        default="bf16",
        help="the weights' dtype (default bf16, as Hugging Face models ship; fp32 round-trips "
        "bit for bit; fp8 is DeepSeek-V3's release format: E4M3 projections with 128 x 128 "
        "block scales, the rest bf16)",
    )
    export.add_argument(
        "--shard-size",
        type=_size,
        default=2 * 2**30,
        metavar="BYTES",
        help="largest output file (K, M, G: powers of 1024; default 2G)",
    )
    add_json_flag(export)
    export.set_defaults(func=_export)


def _register_inspect(actions: argparse._SubParsersAction) -> None:
    inspect = actions.add_parser(
        "inspect",
        help="list checkpoints: step, kind, layout, tokens, size, validity, the resume pick",
        description="One line per checkpoint (full and model-only): step, kind, parallel layout, "
        "tokens seen, size, and whether it is valid or why not; then the one auto-resume picks.",
        epilog=_INSPECT_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    inspect.add_argument("path", type=Path, metavar="PATH", help=_PATH_HELP)
    inspect.add_argument("--full", action="store_true", help="hash every file (sha256)")
    add_json_flag(inspect)
    inspect.set_defaults(func=_inspect)


def _register_diff(actions: argparse._SubParsersAction) -> None:
    diff = actions.add_parser(
        "diff",
        help="say what resuming a checkpoint under a new config reshards, and what blocks it",
        description="Compare a checkpoint (the one auto-resume picks, for a run directory) with "
        "a new config: per parallel axis `same` or `reshards: A -> B`, and every difference "
        "that makes the resume fail.",
        epilog=_DIFF_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    diff.add_argument("path", type=Path, metavar="PATH", help=_PATH_HELP)
    diff.add_argument(
        "--config", type=Path, required=True, metavar="NEW.toml", help="the config to resume with"
    )
    add_set_arg(diff, "override one key of the new config, e.g. --set parallel.tp=2 (repeatable)")
    diff.add_argument("--world-size", type=positive_int, metavar="N", help="ranks of the new run")
    add_json_flag(diff)
    diff.set_defaults(func=_diff)


_PATH_HELP = "runs/<name>, its checkpoints/ folder, or one step-N folder"


# ---- inspect ---------------------------------------------------------------------------------


def _inspect(args: argparse.Namespace) -> int:
    root, one = locate(args.path)
    quick = False if args.full else None  # None: as auto-resume (sha256 under 2 GiB, else sizes)
    paths = [one] if one else [p for kind in KINDS for p in checkpoints(root, kind)]
    entries = [_entry(root, path, verify(path, quick=quick)) for path in paths]
    pick = _resume_pick(root, entries, args.full or one is not None)
    for entry in entries:
        entry["auto_resume"] = entry["path"] == pick
    if args.json:
        print_json({"folder": str(root), "auto_resume": pick, "checkpoints": entries})
    else:
        _print_inspect(root, entries, pick)
    return 0


def _entry(root: Path, path: Path, verdict: Verdict) -> dict[str, Any]:
    try:
        meta = read_meta(path)
    except ValueError:
        meta = {}
    size = meta.get("total_bytes")
    return {
        "path": str(path),
        "name": path.relative_to(root).as_posix(),
        "step": meta.get("step", step_of(path)),
        "kind": meta.get("kind", "model" if path.parent.name == "model" else "full"),
        "valid": verdict.ok,
        "reason": verdict.reason,
        "size_bytes": size if isinstance(size, int) else _du(path),
        "tokens_seen": meta.get("tokens_seen"),
        "world_size": meta.get("world_size"),
        "layout": meta.get("layout"),
        "optimizer": meta.get("optimizer"),
    }


def _resume_pick(root: Path, entries: list[dict[str, Any]], recheck: bool) -> str | None:
    """The checkpoint auto-resume takes. Listed verdicts answer it when they were made the
    same way (every full checkpoint, auto mode); otherwise ask the catalog."""
    if recheck:
        found = latest_valid(root)
        return str(found) if found else None
    valid = [e for e in entries if e["kind"] == "full" and e["valid"]]
    return valid[-1]["path"] if valid else None


def _print_inspect(root: Path, entries: list[dict[str, Any]], pick: str | None) -> None:
    out = console()
    full = sum(e["kind"] == "full" for e in entries)
    out.print(f"{root}: {full} full, {len(entries) - full} model-only checkpoint(s)", markup=False)
    rows = [
        [
            e["name"],
            e["kind"],
            _layout(e["layout"], e["world_size"]),
            f"{_count(e['tokens_seen'])} tokens",
            size_text(e["size_bytes"]),
            _status(e),
        ]
        for e in entries
    ]
    for line in _table(rows):
        out.print(f"  {line}", markup=False)
    out.print(f"auto-resume would pick: {pick or 'none (no valid full checkpoint)'}", markup=False)


def _status(entry: dict[str, Any]) -> str:
    if not entry["valid"]:
        return f"INVALID: {entry['reason']}"
    return f"valid ({entry['reason']})" + ("  <- auto-resume" if entry["auto_resume"] else "")


# ---- diff ------------------------------------------------------------------------------------


def _diff(args: argparse.Namespace) -> int:
    path, meta = _diff_source(args.path)
    loaded = load_config(args.config, args.overrides)
    raise_if_errors(loaded.findings)
    world, source = _new_world_size(args, loaded.config, meta)
    diff = compare(meta, loaded.config, world)
    if args.json:
        print_json({"checkpoint": str(path), "world_size_from": source, **diff.as_dict()})
    else:
        _print_diff(path, args.config, diff, source)
    return 0 if diff.can_resume else 1


def _diff_source(path: Path) -> tuple[Path, dict[str, Any]]:
    """The checkpoint to compare (the auto-resume pick for a folder) and its meta."""
    root, one = locate(path)
    if one is None:
        one = latest_valid(root)
        if one is None:
            found = checkpoints(root)
            newest = f" (newest {found[-1].name}: {verify(found[-1], quick=None).reason})"
            raise UserError(
                f"{root} has no valid checkpoint to resume from{newest if found else ''}",
                "train first, or pass a step-N folder",
                exit_code=1,
            )
    verdict = verify(one, quick=None)
    if not verdict.ok:
        raise UserError(
            f"{one} cannot resume: {verdict.reason}",
            "pick another checkpoint (`dstrain ckpt inspect` lists the valid ones)",
            exit_code=1,
        )
    return one, read_meta(one)


def _new_world_size(
    args: argparse.Namespace, config: DstrainConfig, meta: dict[str, Any]
) -> tuple[int, str]:
    if args.world_size:
        return args.world_size, "--world-size"
    cluster = config.cluster
    if {"nodes", "gpus_per_node"} & cluster.model_fields_set:
        return cluster.nodes * cluster.gpus_per_node, "the config's cluster section"
    if isinstance(meta.get("world_size"), int):
        return meta["world_size"], "the checkpoint"
    raise UserError(
        "the new world size is unknown: neither --world-size, the config's cluster section nor "
        "the checkpoint gives it",
        "pass --world-size N",
        exit_code=2,
    )


def _print_diff(path: Path, config: Path, diff: ResumeDiff, source: str) -> None:
    out = console()
    old = f", {diff.old_world_size} ranks" if diff.old_world_size else ""
    out.print(
        f"dstrain ckpt diff: {path} (step {diff.step}{old}) -> {config} on "
        f"{diff.new_world_size} ranks (from {source})",
        markup=False,
    )
    rows = [[a.axis, a.describe()] for a in diff.axes] + [["data", diff.data]]
    for line in _table(rows):
        out.print(f"  {line}", markup=False)
    if diff.can_resume:
        reshards = any(a.status == "reshards" for a in diff.axes)
        how = "DCP reshards the model and optimizer state on load" if reshards else "same layout"
        out.print(f"CAN RESUME: {how}", style="green")
        return
    out.print(f"CANNOT RESUME ({len(diff.blockers)}):", style="bold red")
    for b in diff.blockers:
        out.print(f"  {b.key}: {b.message}", markup=False)


# ---- export-hf -------------------------------------------------------------------------------


def _export(args: argparse.Namespace) -> int:
    from dstrain.checkpoint.export import export_hf  # torch only when exporting

    with Progress(
        TextColumn("exporting"), BarColumn(), MofNCompleteColumn(), TextColumn("tensors"),
        console=console(stderr=True), transient=True,
    ) as bar:  # fmt: skip
        task = bar.add_task("export", total=None)
        done = export_hf(
            args.source,
            args.output,
            dtype=args.dtype,
            shard_bytes=args.shard_size,
            progress=lambda n, total: bar.update(task, completed=n, total=total),
        )
    if args.json:
        print_json(asdict(done) | {"checkpoint": str(done.checkpoint), "output": str(done.output)})
        return 0
    console().print(
        f"exported {done.checkpoint} -> {done.output}: {done.tensors} tensors in {done.files} "
        f"file(s), {done.bytes / 2**20:,.1f} MB of {done.dtype}",
        markup=False,
    )
    return 0


def _size(text: str) -> int:
    from dstrain.bench.sizes import parse_size

    try:
        return parse_size(text)
    except UserError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: give bytes, e.g. 512M or 2G") from exc


# ---- formatting ------------------------------------------------------------------------------


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))] if rows else []
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]


def _layout(layout: Any, world_size: Any) -> str:
    if not isinstance(layout, dict):
        return "layout unknown"
    axes = ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep")
    parts = [f"{a}={layout[a]}" for a in axes if layout.get(a, 1) != 1]
    parts.append(f"zero={layout.get('zero_stage', '?')}")
    if layout.get("pp", 1) > 1:
        virtual = layout.get("num_virtual_stages", 1)
        parts.append(f"{layout.get('pp_schedule')}" + (f"x{virtual}" if virtual > 1 else ""))
    ranks = f"{world_size} rank{'s' if world_size != 1 else ''}" if world_size else ""
    return " ".join(filter(None, [ranks, *parts]))


def _count(n: Any) -> str:
    if not isinstance(n, int):
        return "?"
    for scale, suffix in ((10**12, "T"), (10**9, "B"), (10**6, "M"), (10**3, "K")):
        if n >= scale:
            return f"{n / scale:.1f}{suffix}"
    return str(n)


def _du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
