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
    """`source` is a run directory (its latest checkpoint is used) or a step-N folder."""
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
    if (source / ".metadata").exists():  # runs/<name>/checkpoints/step-N
        return source.parent.parent, source
    if not (source / "config.toml").exists():
        raise UserError(
            f"{source} is neither a run directory nor a checkpoint",
            "pass runs/<name> or runs/<name>/checkpoints/step-N",
            exit_code=1,
        )
    ckpt = store.latest(source / "checkpoints")
    if ckpt is None:
        raise UserError(f"{source} has no checkpoint yet", "train it first", exit_code=1)
    return source, ckpt
