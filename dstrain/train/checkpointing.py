"""What a checkpoint of a training run holds, and loading it back under any layout.

State dicts come from `torch.distributed.checkpoint.state_dict` with one-process names
(`layers.3.attention.wq_a.weight`) whatever the layout: DTensor shards (FSDP, TP, EP) are saved as
shards of their global tensors, and the optimizer state is flattened per parameter name. So DCP
reshards on load: a checkpoint written under dp_shard2 x ep2 loads under tp2, pp2, dp4 or one
process. Two details keep that true:

- the MTP copy of the embedding that pipeline parallelism adds on the last stage
  (`mtp_embed.weight`, always equal to `embed.weight`) is never saved; on load, it is filled from
  the embedding's entries (weights and optimizer state);
- the data position is a global sample count, so it continues exactly when dp changes.

What cannot change across a resume: the model's architecture (checked first, naming the fields)
and the optimizer kind.
"""

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from dstrain.checkpoint import store
from dstrain.checkpoint.catalog import checkpoints, latest_valid, step_of
from dstrain.checkpoint.manifest import read_meta, verify
from dstrain.checkpoint.resume import architecture_changes
from dstrain.checkpoint.store import CheckpointSaveError, CheckpointWriter
from dstrain.config.schema import CheckpointConfig
from dstrain.errors import UserError
from dstrain.train.progress import bytes_under, log, waiting

# Optimizer state keyed per parameter name ("param_groups.layers.3.wq.weight.lr"): with nested
# param_groups, DCP keeps one rank's list, which under PP names only that rank's parameters.
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
COPY, ORIGINAL = "mtp_embed.", "embed."


def full_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, train: dict[str, Any]
) -> dict[str, Any]:
    """Model, optimizer and the trainer's own state, as saved (without the MTP copy)."""
    model_state, optim_state = get_state_dict(model, optimizer, options=FLAT)
    return {
        "model": _without_copy(model_state),
        "optim": _without_copy(optim_state),
        "train": train,
    }


def model_state(model: nn.Module) -> dict[str, Any]:
    """Weights only (model-only checkpoints), as saved."""
    return {"model": _without_copy(get_model_state_dict(model))}


def load_full(
    path: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    train: dict[str, Any],
    *,
    with_optimizer: bool = True,
) -> dict[str, Any]:
    """Load `path` into `model` and `optimizer` (resharding as needed) and return the trainer's
    state, shaped like `train` (a template with the same keys)."""
    model_sd, optim_sd = get_state_dict(model, optimizer, options=FLAT)
    request = {"model": _requested(model_sd), "train": train}
    if with_optimizer:
        request["optim"] = _requested(optim_sd)
    store.load(path, request)
    _fill(model_sd, request["model"])
    if with_optimizer:
        _fill(optim_sd, request["optim"])
    set_state_dict(
        model,
        optimizer,
        model_state_dict=model_sd,
        optim_state_dict=optim_sd if with_optimizer else {},
        options=FLAT,
    )
    return request["train"]


def check_architecture(saved: dict[str, Any] | None, current: dict[str, Any], path: Path) -> None:
    """A checkpoint loads only into the architecture that wrote it (loss weights, bias speed and
    context-extension fields may change: `resume.FREE_FIELDS`)."""
    if not saved:
        return
    changed = architecture_changes(saved, current)
    if changed:
        shown = ", ".join(f"{k}: {a!r} -> {b!r}" for k, a, b in changed[:6])
        raise UserError(
            f"{path} holds another model architecture ({shown}"
            f"{', ...' if len(changed) > 6 else ''}); its weights cannot load into this one",
            "resume with the checkpoint's model settings, or start a new run (--set "
            "run.name=NEW); `dstrain ckpt diff` says what a config changes",
            exit_code=1,
        )


def _without_copy(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in state.items() if COPY not in k}


def _requested(state: dict[str, Any]) -> dict[str, Any]:
    """The entries to read: the MTP copy's read from the embedding's names, unless this rank
    holds the embedding too (then the copy is filled from it afterwards)."""
    request = {k: v for k, v in state.items() if COPY not in k}
    for key, value in state.items():
        if COPY in key:
            request.setdefault(key.replace(COPY, ORIGINAL), value)
    return request


def _fill(state: dict[str, Any], loaded: dict[str, Any]) -> None:
    """Put what DCP read back into `state` (it replaces non-tensor values in the request)."""
    for key in state:
        if COPY not in key:
            state[key] = loaded[key]
            continue
        value = loaded[key.replace(COPY, ORIGINAL)]
        # Its own tensor: set_state_dict may adopt optimizer-state tensors as they are, and two
        # parameters sharing one exp_avg would each update it.
        state[key] = value.clone() if isinstance(value, torch.Tensor) else value


class TrainCheckpoints:
    """A run's checkpoints: saving (sync or async, full or model-only, per the failure policy),
    choosing the one to resume from, and loading it back. `stateful` names the objects whose
    `state_dict`/`load_state_dict` travel with the weights (schedule, data position, ...)."""

    def __init__(
        self,
        folder: Path,
        cfg: CheckpointConfig,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        stateful: dict[str, Any],
        is_main: bool,
    ) -> None:
        self.folder, self.cfg, self.is_main = folder, cfg, is_main
        self.model, self.optimizer, self.stateful = model, optimizer, stateful
        self.writer = CheckpointWriter(
            folder,
            keep_last_k=cfg.keep_last_k,
            async_save=cfg.async_mode == "async",
            is_main=is_main,
        )
        self.failures = 0

    def save(self, step: int, meta: dict[str, Any], kind: str = "full") -> None:
        """Collective. A failed save follows `checkpoint.on_save_error`."""
        state = (
            full_state(self.model, self.optimizer, self._train_state())
            if kind == "full"
            else model_state(self.model)
        )
        where = self.folder if kind == "full" else self.folder / "model"
        what = f"saving checkpoint step-{step}"
        if self.writer.async_save:
            what += " (staging; the write goes on in the background)"
        written = bytes_under(where, f".step-{step}.tmp", f"step-{step}")
        with waiting(what, written, show=self.is_main):
            self._guarded(lambda: self.writer.save(step, state, meta, kind))

    def poll(self) -> None:
        """Publish a finished async save (local, cheap: every step)."""
        self._guarded(self.writer.poll)

    def wait(self) -> None:
        """Collective: the save in flight is published (or its failure handled)."""
        self._guarded(self.writer.wait)

    def close(self) -> None:
        self._guarded(self.writer.close)

    def resume(
        self, how: str, model: dict[str, Any], optimizer_name: str
    ) -> tuple[Path, dict[str, Any]] | None:
        """Load the checkpoint `how` names (`checkpoint.resume`: auto, never, or a path) into
        everything; returns its path and the layout it was written under, or None for a fresh
        start. The architecture and the optimizer kind must match the checkpoint's."""
        path = self._resume_path(how)
        if path is None:
            return None
        meta = read_meta(path)
        check_architecture(meta.get("model"), model, path)
        if meta.get("optimizer", optimizer_name) != optimizer_name:
            raise UserError(
                f"{path} holds {meta['optimizer']} state; this run uses {optimizer_name}",
                f"set optim.name = {meta['optimizer']}, or start a new run (--set run.name=NEW)",
                exit_code=1,
            )
        self.load(path)
        if how != "auto":
            self._set_aside_newer(step_of(path))
        return path, meta.get("layout", {})

    def _set_aside_newer(self, step: int) -> None:
        """After resuming from an older checkpoint on purpose, the run's newer ones belong to the
        abandoned history: moved to checkpoints/abandoned/ (not deleted), so a later auto-resume
        cannot pick them."""
        if self.is_main:
            newer = [p for p in checkpoints(self.folder) if step_of(p) > step]
            for path in newer:
                target = self.folder / "abandoned" / path.name
                target.parent.mkdir(exist_ok=True)
                shutil.rmtree(target, ignore_errors=True)
                path.rename(target)
            if newer:
                log(f"set aside {len(newer)} newer checkpoint(s) in {self.folder / 'abandoned'}")
        if dist.is_initialized():
            dist.barrier()

    def _resume_path(self, how: str) -> Path | None:
        if how == "never":
            existing = checkpoints(self.folder)
            if existing:
                # Saving into it would interleave two runs' step-N folders and prune the new ones.
                raise UserError(
                    f"{self.folder.parent} already holds checkpoints of an earlier run (newest "
                    f"{existing[-1].name}); starting over there would mix the two",
                    f"give the new run its own --set run.name=NAME, or delete {self.folder}",
                    exit_code=1,
                )
            return None
        if how == "auto":
            return self.newest_valid()
        path = Path(how)
        verdict = verify(path, quick=None)
        if not verdict.ok:
            raise UserError(
                f"{path} is not a valid checkpoint: {verdict.reason}",
                "resume from another (`dstrain ckpt inspect RUN_DIR` lists them and their "
                "validity)",
                exit_code=1,
            )
        return path

    def newest_valid(self) -> Path | None:
        """The newest full checkpoint whose manifest verifies, chosen by rank 0 (which reports
        the ones it skips) and shared with the others (one verification, not one per rank)."""
        path = latest_valid(self.folder, report=log) if self.is_main else None
        return _from_rank0(path)

    def load(self, path: Path, restore: tuple[str, ...] | None = None) -> None:
        """Load `path` into the model, the optimizer and the stateful objects named in `restore`
        (all by default)."""
        read = bytes_under(path.parent, path.name)
        with waiting(f"loading checkpoint {path.name}", read, show=self.is_main):
            train = load_full(path, self.model, self.optimizer, self._train_state())
        for name in restore if restore is not None else tuple(self.stateful):
            self.stateful[name].load_state_dict(train[name])

    def _train_state(self) -> dict[str, Any]:
        return {name: obj.state_dict() for name, obj in self.stateful.items()}

    def _guarded(self, action: Callable[[], object]) -> None:
        try:
            action()
        except CheckpointSaveError as exc:
            if self.cfg.on_save_error == "stop":
                raise
            self.failures += 1
            if self.is_main:
                log(f"{exc.message}; training goes on (checkpoint.on_save_error = continue)")


def _from_rank0(path: Path | None) -> Path | None:
    if not dist.is_initialized():
        return path
    box = [str(path) if path is not None else None]
    dist.broadcast_object_list(box, src=0)
    return Path(box[0]) if box[0] is not None else None


class CpuRng:
    """The CPU generator's state, as a checkpointed object."""

    def state_dict(self) -> dict[str, Any]:
        return {"cpu": torch.get_rng_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        torch.set_rng_state(state["cpu"])


class SchedulePosition:
    """The LR schedule as a checkpointed object: only its position. (LambdaLR's own state lists
    one base LR per parameter group, and the groups differ between layouts; the LRs come back
    from the schedule's function at that position.)"""

    def __init__(self, scheduler: torch.optim.lr_scheduler.LambdaLR) -> None:
        self.scheduler = scheduler

    def state_dict(self) -> dict[str, Any]:
        return {"last_epoch": self.scheduler.last_epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        s = self.scheduler
        s.last_epoch = int(state["last_epoch"])
        lrs = [base * fn(s.last_epoch) for base, fn in zip(s.base_lrs, s.lr_lambdas, strict=True)]
        for group, lr in zip(s.optimizer.param_groups, lrs, strict=True):
            group["lr"] = lr
        s._last_lr = lrs  # type: ignore[attr-defined]
