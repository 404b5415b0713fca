"""DeepSpeed's own verdict on a config, when DeepSpeed is importable: its hjson read, its
`DeepSpeedConfig` at the file's world size (simulated), and the checks `deepspeed.initialize`
makes first, run with the engine's own methods on a stand-in (no process group, no model). The
offline rules (`ds_engine.py`, `ds_lint.py`) model one named release; this asks the installed
one, and reports its answer as the engine's, keyed `deepspeed engine`.
"""

import contextlib
import io
import logging
import os
from importlib.util import find_spec
from types import SimpleNamespace
from typing import Any
from unittest import mock

from dstrain.config.findings import Finding, error, info
from dstrain.interop import ds_initialize
from dstrain.interop.imported import AUTO

ENGINE_ENV = "DSTRAIN_DEEPSPEED_ENGINE"  # "0": judge by the offline rules alone
ENGINE_KEY = "deepspeed engine"
# What the HF Trainer writes over `auto` with its default TrainingArguments
# (transformers/integrations/deepspeed.py, trainer_config_process / trainer_config_finalize; a
# hidden size of 1024 for the ZeRO-3 buckets); any other `auto` is dropped (DeepSpeed's default).
_HF_FILLS = {
    "train_micro_batch_size_per_gpu": 8,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 1.0,
    "optimizer.params.lr": 5e-5,
    "optimizer.params.betas": [0.9, 0.999],
    "optimizer.params.eps": 1e-8,
    "optimizer.params.weight_decay": 0.0,
    "scheduler.params.warmup_min_lr": 0,
    "scheduler.params.warmup_max_lr": 5e-5,
    "scheduler.params.warmup_num_steps": 10,  # warmup_ratio x steps; 0.19 refuses 0
    "scheduler.params.total_num_steps": 1000,
    "fp16.enabled": False,
    "bf16.enabled": False,
    "zero_optimization.reduce_bucket_size": 1024 * 1024,
    "zero_optimization.stage3_prefetch_bucket_size": int(0.9 * 1024 * 1024),
    "zero_optimization.stage3_param_persistence_threshold": 10 * 1024,
}


def engine_verdict(
    raw: dict[str, Any],
    text: str | None = None,
    world_size: int | None = None,
    initialize: bool = False,
) -> list[Finding]:
    """DeepSpeed's own verdict, when DeepSpeed is importable: its hjson read of `text`, its
    config loader (`DeepSpeedConfig`) at `world_size` ranks (None: the world size the file's
    batch triple implies, else 1) with `auto` filled as the HF Trainer fills it, and the
    optimizer checks `deepspeed.initialize` runs on that config. With `initialize`, a config the
    loader accepts also goes through deepspeed.initialize and one step (ds_initialize.py).
    Findings keyed "deepspeed engine"; [] without DeepSpeed or with DSTRAIN_DEEPSPEED_ENGINE=0."""
    if os.environ.get(ENGINE_ENV, "1") == "0":
        return []
    if find_spec("deepspeed") is None:
        if not initialize:
            return []
        return [
            info(
                ENGINE_KEY,
                "--deepspeed-initialize asks DeepSpeed itself, which is not installed here",
                "DS_BUILD_OPS=0 pip install deepspeed (the release to judge by)",
            )
        ]
    filled = _fill_auto(raw)
    world = world_size or _implied_world(filled)
    quiet = contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO())
    with quiet[0], quiet[1]:
        try:
            import deepspeed
        except Exception as exc:  # a broken install must not stop check
            return [info(ENGINE_KEY, f"DeepSpeed is installed but does not import: {exc}")]
        try:
            _run_loader(filled, text, world)
            refusal = None
        except Exception as exc:  # the engine's refusal, whatever it raises
            refusal = f"{type(exc).__name__}: {' '.join(str(exc).split())[:400]}"
    auto = " (`auto` filled as the HF Trainer's defaults fill it)" if filled != raw else ""
    where = f"DeepSpeed {deepspeed.__version__}'s own config loader, at world size {world}{auto}"
    if refusal:
        return [
            error(
                ENGINE_KEY,
                f"the engine's own verdict: {where}, refuses it: {refusal}",
                "the findings beside this one name the key",
            )
        ]
    accepted = info(ENGINE_KEY, f"the engine's own verdict: {where}, accepts it")
    return [
        accepted,
        *(_initialize_verdict(filled, world, deepspeed.__version__) if initialize else []),
    ]


def _initialize_verdict(config: dict[str, Any], world: int, version: str) -> list[Finding]:
    (answer,) = ds_initialize.initialize([(config, world)])
    where = (
        f"DeepSpeed {version}'s deepspeed.initialize and one optimizer step on a tiny model "
        f"(1 rank of {world}, gloo, CPU accelerator)"
    )
    if answer.verdict == ds_initialize.ACCEPTS:
        return [info(ENGINE_KEY, f"the engine's own verdict: {where}, accepts it")]
    if answer.verdict == ds_initialize.REFUSES:
        return [
            error(
                ENGINE_KEY,
                f"the engine's own verdict: {where}, refuses it: {answer.message}",
                "the engine's message names the key; DeepSpeed's loader accepted the file, so "
                "this fails only once a job starts",
            )
        ]
    return [info(ENGINE_KEY, f"{where} could not run here: {answer.message}")]


def _run_loader(config: dict[str, Any], text: str | None, world: int) -> None:
    from deepspeed.runtime import config as ds_config
    from deepspeed.runtime.config_utils import dict_raise_error_on_duplicate_keys
    from deepspeed.runtime.engine import DeepSpeedEngine

    if text is not None:  # as DeepSpeedConfig reads a --deepspeed_config path
        import hjson

        hjson.loads(text, object_pairs_hook=dict_raise_error_on_duplicate_keys)
    # DeepSpeedConfig asks deepspeed.comm for the rank and world size; no process group here.
    fake = SimpleNamespace(get_rank=lambda: 0, get_world_size=lambda group=None: world)
    level = logging.getLogger("DeepSpeed").level
    logging.getLogger("DeepSpeed").setLevel(logging.CRITICAL)
    try:
        with mock.patch.object(ds_config, "dist", fake):
            loaded = ds_config.DeepSpeedConfig(config)
    finally:
        logging.getLogger("DeepSpeed").setLevel(level)
    _initialize_checks(DeepSpeedEngine, loaded)


def _initialize_checks(engine: Any, loaded: Any) -> None:
    """The checks deepspeed.initialize makes on the loaded config before it builds anything
    (engine.py, _do_sanity_check; zero/partition_parameters.py), run with the engine's own
    methods on a stand-in that holds only the config."""
    stub = SimpleNamespace(_config=loaded, client_optimizer=None)
    name = loaded.optimizer_name
    if name is not None and not engine._is_supported_optimizer(stub, name):
        raise AssertionError(f"{name} is not a supported DeepSpeed Optimizer")
    if name == "lamb" and not engine.dynamic_loss_scale(stub):
        raise AssertionError("DeepSpeed lamb optimizer requires dynamic loss scaling")
    zero = loaded.zero_config
    if loaded.zero_optimization_stage == 3:
        for part in (zero.offload_param, zero.offload_optimizer):
            if part is not None and part.device == "nvme" and part.nvme_path is None:
                raise AssertionError(
                    '"nvme_path" in DeepSpeed Config cannot be None if remote device is nvme'
                )


def _fill_auto(raw: dict[str, Any]) -> dict[str, Any]:
    """`raw` with each `auto` replaced as the HF Trainer replaces it (dropped when it has no
    default here), and train_batch_size = micro x accumulation (one rank)."""

    def walk(node: Any, prefix: str) -> Any:
        if not isinstance(node, dict):
            return node
        out = {}
        for key, value in node.items():
            dotted = f"{prefix}{key}"
            if value == AUTO and dotted != "train_batch_size":
                if dotted in _HF_FILLS:
                    out[key] = _HF_FILLS[dotted]
            else:
                out[key] = walk(value, f"{dotted}.")
        return out

    filled = walk(raw, "")
    if filled.get("train_batch_size") == AUTO:
        micro = filled.get("train_micro_batch_size_per_gpu", 8)
        steps = filled.get("gradient_accumulation_steps", 1)
        ok = all(isinstance(v, int) and not isinstance(v, bool) for v in (micro, steps))
        filled["train_batch_size"] = micro * steps if ok else 8
    return filled


def _implied_world(config: dict[str, Any]) -> int:
    """The world size the batch triple implies (train = micro x accumulation x world), else 1."""
    values = [config.get(k) for k in _TRIPLE]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values):
        return 1
    train, micro, steps = values
    world, rest = divmod(train, micro * steps)
    return world if world >= 1 and not rest else 1


_TRIPLE = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
