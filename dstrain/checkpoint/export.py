"""Export a run's newest checkpoint as a Hugging Face model folder (safetensors + config.json)."""

from pathlib import Path

import torch

from dstrain.checkpoint import store
from dstrain.config.flavors import resolve_model_args
from dstrain.config.load import load_config
from dstrain.config.validate import raise_if_errors
from dstrain.errors import UserError
from dstrain.model.hf_adapter import check_exportable, save_hf_checkpoint
from dstrain.model.transformer import build_model


def export_hf(source: Path, out_dir: Path) -> Path:
    """`source` is a run directory (its newest valid checkpoint is used: full, else model-only)
    or a step-N folder of either kind."""
    run_dir, ckpt = _locate(source)
    loaded = load_config(run_dir / "config.toml")
    raise_if_errors(loaded.findings)
    args = resolve_model_args(loaded.config.model)
    check_exportable(args)
    model = build_model(args, "cpu")
    state = {"model": model.state_dict()}
    store.load(ckpt, state)
    with torch.no_grad():
        save_hf_checkpoint(state["model"], args, out_dir)
    return ckpt


def _locate(source: Path) -> tuple[Path, Path]:
    if (source / ".metadata").exists():  # runs/<name>/checkpoints/[model/]step-N
        run_dir = next((p for p in source.parents if (p / "config.toml").exists()), None)
        if run_dir is None:
            raise UserError(
                f"{source} is a checkpoint outside a run directory (no config.toml above it)",
                "pass it inside its runs/<name> folder, which holds the model's config.toml",
                exit_code=1,
            )
        return run_dir, source
    if not (source / "config.toml").exists():
        raise UserError(
            f"{source} is neither a run directory nor a checkpoint",
            "pass runs/<name> or runs/<name>/checkpoints/step-N",
            exit_code=1,
        )
    folder = source / "checkpoints"
    ckpt = store.latest(folder) or store.latest_valid(folder, kind="model")
    if ckpt is None:
        raise UserError(f"{source} has no checkpoint yet", "train it first", exit_code=1)
    return source, ckpt
