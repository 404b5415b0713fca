"""A training process's side of `dstrain train`: check the config and layout, train, report.

`dstrain train` runs it in its own process (cli/train.py); torchrun runs it in each worker
(`python -m dstrain.train CONFIG [--set ...]`, train/__main__.py) with no CLI beneath it.
"""

import argparse
import json
import os
import sys
from dataclasses import asdict
from pathlib import Path

from dstrain.config.flavors import resolve_model_args
from dstrain.config.load import LoadedConfig, load_config
from dstrain.config.validate import raise_if_errors
from dstrain.errors import UserError
from dstrain.preflight.preflight import preflight


def run_overrides(
    sets: list[str], resume: str | None, fresh: bool, profile_steps: str | None
) -> list[str]:
    """--set overrides, then what --resume / --fresh / --profile-steps stand for."""
    overrides = list(sets)
    if resume:
        overrides.append(f'checkpoint.resume="{resume}"')
    if fresh:
        overrides.append("checkpoint.resume=never")
    if profile_steps:
        overrides.append(f'metrics.profile_steps="{profile_steps}"')
    return overrides


def before_launch(loaded: LoadedConfig, world: int, worker: bool) -> None:
    """The check's rules and init_from's headers. Under torchrun every worker runs them on the
    same files before any process group exists, so they fail alike: rank 0 says why, the
    others exit with the same status and say nothing (one message, not one per rank)."""
    try:
        raise_if_errors(preflight(loaded, world_size=world))
        if loaded.config.model.init_from is not None:
            from dstrain.checkpoint.hf_check import refuse_bad_init_from

            refuse_bad_init_from(loaded.config, resolve_model_args(loaded.config.model))
    except UserError as exc:
        if worker and os.environ.get("RANK", "0") != "0":
            raise SystemExit(exc.exit_code) from None
        raise


def train(loaded: LoadedConfig, json_out: bool) -> int:
    """Train to the end (or resume to it); the main rank prints the summary."""
    from dstrain.train.trainer import Trainer  # torch loads only once the config is known good

    trainer = Trainer(loaded.config)
    if trainer.step >= loaded.config.train.steps:
        print(
            f"dstrain train: {trainer.run_dir} is already complete at step {trainer.step} "
            "(--fresh to start over, or raise train.steps)",
            file=sys.stderr,
        )
        if json_out and trainer.world.is_main:
            _print_json(_finished_summary(trainer.run_dir, trainer.step))
        return 0
    summary = trainer.train()
    if not trainer.world.is_main:
        return 0
    if json_out:
        _print_json(asdict(summary) | {"run_dir": str(trainer.run_dir)})
        return 0
    print(
        f"done: {summary.steps} steps, loss {summary.final_loss:.4f}, "
        f"{summary.tokens_per_s:,.0f} tokens/s, MFU {100 * summary.mfu:.1f}%, "
        f"{summary.wall_s:.0f} s -> {trainer.run_dir}"
    )
    return 0


def main(argv: list[str]) -> int:
    """A torchrun worker: CONFIG [--set k=v ...] [--resume PATH | --fresh] [--profile-steps A:B]
    [--json]; the world size comes from torchrun's environment."""
    parser = argparse.ArgumentParser(
        prog="python -m dstrain.train",
        description="One training worker under torchrun (`dstrain train --help` for the flags).",
    )
    parser.add_argument("config", nargs="?", type=Path)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="K=V")
    parser.add_argument("--resume", metavar="PATH")
    parser.add_argument("--fresh", action="store_true")
    parser.add_argument("--profile-steps", metavar="A:B")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    try:
        overrides = run_overrides(args.overrides, args.resume, args.fresh, args.profile_steps)
        loaded = load_config(args.config, overrides)
        from dstrain.parallel.distributed import env_int  # imports torch

        world = env_int("WORLD_SIZE", 1)
        before_launch(loaded, world, worker="LOCAL_RANK" in os.environ)
        return train(loaded, args.json)
    except UserError as exc:
        print(f"dstrain train: error: {exc.message}", file=sys.stderr)
        if exc.fix:
            print(f"  fix: {exc.fix}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def _finished_summary(run_dir: Path, step: int) -> dict:
    """What a script asking for JSON gets from a run that is already complete: the summary the
    run wrote when it finished (none if it was cut short before writing one)."""
    path = run_dir / "summary.json"
    try:
        written = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        written = {}
    return written | {"run_dir": str(run_dir), "already_complete": True, "step": step}


def _print_json(data: dict) -> None:
    print(json.dumps(data, indent=2, default=str))
