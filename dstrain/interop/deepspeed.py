"""DeepSpeed JSON -> dstrain config. Every key is mapped, or reported as having no effect here.

Key validation against DeepSpeed's own key set (typos, misplaced keys) lives in `ds_lint.py`;
Megatron-style keys that people put beside DeepSpeed's are mapped by `megatron.py`.
"""

from typing import Any

from dstrain.config.findings import error, info, warning
from dstrain.interop import ds_lint, megatron
from dstrain.interop.ds_engine import ONE_BIT, deepspeed_true, uses_auto
from dstrain.interop.ds_keys import release
from dstrain.interop.ds_verdict import engine_verdict
from dstrain.interop.imported import (
    AUTO,
    DEFAULT_JUDGES,
    Imported,
    Judges,
    as_bool,
    as_float,
    as_int,
    lax_value,
)

# Keys DeepSpeed accepts that change nothing in dstrain, with the reason shown to the user.
_NO_EFFECT = {
    "prescale_gradients": "FSDP2/DDP average gradients in the reduction itself",
    "gradient_predivide_factor": "FSDP2/DDP average gradients in the reduction itself",
    "zero_allow_untested_optimizer": "dstrain's optimizers all work with every ZeRO stage",
    "zero_force_ds_cpu_optimizer": "dstrain offload steps torch's own optimizer on the CPU",
    "dump_state": "dstrain logs the resolved config at start-up",
    "memory_breakdown": "memory/* metrics are always logged",
    "sparse_gradients": "embeddings use dense gradients",
    "dataloader_drop_last": "the loader always drops the last partial batch",
    "zero_optimization.contiguous_gradients": "FSDP2 manages its own gradient buffers",
    "zero_optimization.overlap_comm": "FSDP2 always overlaps reduce-scatter with backward",
    "zero_optimization.reduce_scatter": "FSDP2 always reduce-scatters",
    "zero_optimization.reduce_bucket_size": "FSDP2 reduces per block, not per bucket",
    "zero_optimization.allgather_partitions": "FSDP2 always all-gathers per block",
    "zero_optimization.allgather_bucket_size": "FSDP2 all-gathers per block, not per bucket",
    "zero_optimization.sub_group_size": "the optimizer steps whole shards",
    "zero_optimization.stage3_max_live_parameters": "FSDP2 prefetches one block ahead",
    "zero_optimization.stage3_max_reuse_distance": "FSDP2 prefetches one block ahead",
    "zero_optimization.stage3_prefetch_bucket_size": "FSDP2 prefetches one block ahead",
    "zero_optimization.stage3_param_persistence_threshold": "FSDP2 shards every block's params",
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": "use dstrain ckpt export-hf",
    "zero_optimization.gather_16bit_weights_on_model_save": "use dstrain ckpt export-hf",
    "zero_optimization.round_robin_gradients": "FSDP2 reduces per block",
    "zero_optimization.elastic_checkpoint": "DCP checkpoints reshard on load",
    "zero_optimization.load_from_fp32_weights": "checkpoints hold fp32 master weights",
    "zero_optimization.ignore_unused_parameters": "every parameter is used",
}


def from_deepspeed(
    raw: dict[str, Any],
    engine: str = "DeepSpeed",
    text: str | None = None,
    judges: Judges = DEFAULT_JUDGES,
) -> Imported:
    """Map a DeepSpeed config dict (with any Megatron keys beside it) to a dstrain config dict,
    as `engine` would read it, by the rules of one DeepSpeed release (the newest, or
    $DSTRAIN_DEEPSPEED_RELEASE). `text` is the file's own text, when there is one: read as
    DeepSpeed's hjson loader reads it. With DeepSpeed importable, its own loader judges too."""
    rel = release(judges.deepspeed_release)
    out = Imported(engine=engine, release=rel)
    out.findings.append(
        info("deepspeed release", f"the offline rules model DeepSpeed {rel.name}", ds_lint.HINT)
    )
    if text is not None:
        out.findings.extend(ds_lint.read_hjson(text)[1])
    if engine == "DeepSpeed":
        out.findings.extend(engine_verdict(raw, text, initialize=judges.deepspeed_initialize))
    out.findings.extend(ds_lint.lint(raw, rel))
    foreign = {k: v for k, v in raw.items() if k not in ds_lint.top_level_keys()}
    megatron.map_keys({k: v for k, v in foreign.items() if megatron.is_megatron_key(k)}, out)
    for key, value in raw.items():
        out.current = key
        if key in _MAPPERS:
            _MAPPERS[key](value, out, raw)
        elif key in _NO_EFFECT:
            out.findings.append(info(key, f"no effect in dstrain: {_NO_EFFECT[key]}"))
        elif key in ds_lint.top_level_keys():
            out.findings.append(info(key, "DeepSpeed-only feature: not mapped, no effect here"))
    _batch_findings(raw, out)
    _precision_findings(raw, out)
    megatron.finish(out)
    return out


def _batch(value: Any, out: Imported, raw: dict[str, Any], key: str, target: str) -> None:
    if value == AUTO:
        out.findings.append(
            info(key, "`auto` (filled by the HF Trainer): dstrain infers it from the others")
        )
        return
    number = as_int(value, key, out.findings, minimum=1)
    if number is not None:
        out.set(target, number)


def _map_train_batch(value: Any, out: Imported, raw: dict[str, Any]) -> None:
    _batch(value, out, raw, "train_batch_size", "train.global_batch_size")


def _map_micro_batch(value: Any, out: Imported, raw: dict[str, Any]) -> None:
    _batch(value, out, raw, "train_micro_batch_size_per_gpu", "train.micro_batch_size")


def _map_grad_accum(value: Any, out: Imported, raw: dict[str, Any]) -> None:
    _batch(value, out, raw, "gradient_accumulation_steps", "train.grad_accum_steps")


def _map_clipping(value: Any, out: Imported, raw: dict[str, Any]) -> None:
    if value == AUTO:
        out.findings.append(
            info("gradient_clipping", "`auto`: dstrain's default grad_clip applies")
        )
        return
    if _number_as_text(
        value,
        "gradient_clipping",
        "compares it with 0.0 at the first optimizer step (runtime/engine.py, _take_model_step)",
        out,
    ):
        return
    number = as_float(value, "gradient_clipping", out.findings)
    if number is not None:
        out.set("train.grad_clip", number)


def _map_steps_per_print(value: Any, out: Imported, raw: dict[str, Any]) -> None:
    if _number_as_text(
        value,
        "steps_per_print",
        "takes global_steps modulo it at the first step (runtime/engine.py)",
        out,
    ):
        return
    number = as_int(value, "steps_per_print", out.findings, minimum=1)
    if number is not None:
        out.set("metrics.log_interval", number)


def _number_as_text(value: Any, key: str, where: str, out: Imported) -> bool:
    """A number written as a string in a key DeepSpeed reads with a plain `dict.get`: its loader
    and `deepspeed.initialize` accept the file, and the engine fails on it later (TypeError)."""
    if not isinstance(value, str) or lax_value(value, "float") is None:
        return False
    out.findings.append(
        error(
            key,
            f"{value!r} is a string: DeepSpeed's loader keeps it as one, and its engine {where}: "
            "a TypeError once training runs",
            f"write the number: {lax_value(value, 'float'):g}",
        )
    )
    return True


def _map_wall_clock(value: Any, out: Imported, raw: dict[str, Any]) -> None:
    if isinstance(value, str):  # ds_engine reports it, read as DeepSpeed reads it
        out.set("metrics.timers", deepspeed_true(value) or value.strip().lower() == "false")
        return
    flag = as_bool(value, "wall_clock_breakdown", out.findings)
    if flag is not None:
        out.set("metrics.timers", flag)


def _map_tensorboard(value: Any, out: Imported, raw: dict[str, Any]) -> None:
    if not isinstance(value, dict):
        return
    if (
        "enabled" in value
        and (flag := as_bool(value["enabled"], "tensorboard.enabled", out.findings)) is not None
    ):
        out.set("metrics.tensorboard", flag)
    if "job_name" in value:
        out.set("run.name", str(value["job_name"]))
    if "output_path" in value:
        out.findings.append(
            info("tensorboard.output_path", "dstrain writes events to runs/<name>/tb/ instead")
        )


def _map_wandb(value: Any, out: Imported, raw: dict[str, Any]) -> None:
    if isinstance(value, dict) and "enabled" in value:
        flag = as_bool(value["enabled"], "wandb.enabled", out.findings)
        if flag is not None:
            out.set("metrics.wandb", flag)


def _map_optimizer(value: Any, out: Imported, raw: dict[str, Any]) -> None:
    if not isinstance(value, dict):
        return
    kind = str(value.get("type", "adamw"))
    params = value.get("params") or {}
    lowered = kind.lower()
    if lowered in ("adam", "adamw"):
        plain_adam = lowered == "adam" and params.get("adam_w_mode") is False
        out.set("optim.name", "adam" if plain_adam else "adamw")
    elif lowered == "sgd":
        out.set("optim.name", "sgd")
    else:
        hint = (
            " (for compressed communication use comm.compression = powersgd)"
            if lowered in ONE_BIT
            else ""
        )
        out.findings.append(
            warning(
                "optimizer.type", f"dstrain has no {kind}; the converted config uses AdamW{hint}"
            )
        )
        out.set("optim.name", "adamw")
    if isinstance(params, dict):
        _map_optimizer_params(params, out)


def _map_optimizer_params(params: dict[str, Any], out: Imported) -> None:
    for name, value in params.items():
        key = f"optimizer.params.{name}"
        if value == AUTO:
            out.findings.append(info(key, "`auto`: dstrain's default applies"))
        elif name in ("lr", "eps", "weight_decay"):
            number = as_float(value, key, out.findings)
            if number is not None:
                out.set(f"optim.{name}", number, key)
        elif name == "betas":
            if isinstance(value, list) and len(value) == 2:
                out.set("optim.betas", [float(v) for v in value], key)
            else:
                out.findings.append(error(key, f"expected [beta1, beta2], got {value!r}"))
        elif name not in ds_lint.REJECTED_OPTIMIZER_PARAMS:
            out.findings.append(info(key, "no effect in dstrain's optimizer"))


def _map_scheduler(value: Any, out: Imported, raw: dict[str, Any]) -> None:
    if not isinstance(value, dict):
        return
    kind = str(value.get("type", ""))
    params = value.get("params") or {}
    if not isinstance(params, dict):
        return

    def number(name: str) -> float | None:
        v = params.get(name)
        return (
            None
            if v is None or v == AUTO
            else as_float(v, f"scheduler.params.{name}", out.findings)
        )

    warmup = number("warmup_num_steps")
    total = number("total_num_steps")
    peak = number("warmup_max_lr")
    floor = number("warmup_min_lr")
    if warmup is not None:
        out.set("lr.warmup_steps", int(warmup))
    if total is not None:
        out.set("train.steps", int(total))
    if peak:
        out.set("optim.lr", peak)
        if floor is not None:
            out.set("lr.warmup_start_ratio", min(1.0, floor / peak))
    schedules = {"WarmupLR": "constant", "WarmupDecayLR": "linear", "WarmupCosineLR": "cosine"}
    if kind in schedules:
        out.set("lr.schedule", schedules[kind])
        if kind == "WarmupDecayLR":
            out.set("lr.min_lr_ratio", 0.0)
        if kind == "WarmupCosineLR" and (ratio := number("cos_min_ratio")) is not None:
            out.set("lr.min_lr_ratio", ratio)
    elif kind:
        out.findings.append(
            warning("scheduler.type", f"dstrain has no {kind}; cosine after warmup is used instead")
        )


def _map_fp16(value: Any, out: Imported, raw: dict[str, Any]) -> None:
    if isinstance(value, bool):  # Megatron's --fp16 flag
        megatron.map_key("fp16", value, out)
    if not isinstance(value, dict):
        return
    if value.get("enabled") is True:
        out.set("train.precision", "fp16", "fp16.enabled")
    lax = out.release is not None and out.release.pydantic_precision
    for name in ("initial_scale_power", "loss_scale_window", "hysteresis"):
        if name in value and value[name] != AUTO:
            n = _section_number(value[name], f"fp16.{name}", out, "int", lax)
            if n is not None:
                out.set(f"train.loss_scale.{name}", n, f"fp16.{name}")
    for name in ("loss_scale", "min_loss_scale"):
        if name in value and value[name] != AUTO:
            x = _section_number(value[name], f"fp16.{name}", out, "float", lax)
            if x is not None:
                out.set(f"train.loss_scale.{name}", x, f"fp16.{name}")


def _section_number(value: Any, key: str, out: Imported, kind: str, lax: bool) -> Any:
    """A number of a pydantic section: a string is coerced as DeepSpeed coerces it, or left to
    ds_engine's finding on it (one finding per key)."""
    if isinstance(value, str) and lax:
        return lax_value(value, kind)
    if kind == "int":
        return as_int(value, key, out.findings, minimum=0)
    return as_float(value, key, out.findings)


def _map_bf16(value: Any, out: Imported, raw: dict[str, Any]) -> None:
    if isinstance(value, bool):  # Megatron's --bf16 flag
        megatron.map_key("bf16", value, out)
    if isinstance(value, dict) and value.get("enabled") is True:
        out.set("train.precision", "bf16", "bf16.enabled")


def _map_zero(value: Any, out: Imported, raw: dict[str, Any]) -> None:
    if not isinstance(value, dict):
        return
    stage = value.get("stage", 0)
    stage = (
        _section_number(stage, "zero_optimization.stage", out, "int", lax=True)
        if stage != AUTO
        else None
    )
    if stage is not None and stage > 3:
        out.findings.append(error("zero_optimization.stage", f"stage {stage} does not exist (0-3)"))
        stage = None
    if stage is not None:
        out.set("parallel.zero_stage", stage, "zero_optimization.stage")
    for name in value:
        reason = _NO_EFFECT.get(f"zero_optimization.{name}")
        if reason:
            out.findings.append(
                info(f"zero_optimization.{name}", f"no effect in dstrain: {reason}")
            )
    _map_offload(value, stage or 0, out)


def _map_offload(zero: dict[str, Any], stage: int, out: Imported) -> None:
    optimizer = _offload_device(zero.get("offload_optimizer"))
    params = _offload_device(zero.get("offload_param"))
    if zero.get("cpu_offload") is True:
        optimizer = "cpu"
    if zero.get("cpu_offload_params") is True:
        params = "cpu"
    for key, device in (("offload_optimizer", optimizer), ("offload_param", params)):
        if device == "nvme":
            out.findings.append(
                warning(f"zero_optimization.{key}", "NVMe offload is not supported; using CPU")
            )
    if optimizer in ("cpu", "nvme"):
        out.set("parallel.offload_optimizer", True, "zero_optimization.offload_optimizer")
    # Below stage 3 DeepSpeed ignores offload_param (only stage 3 partitions parameters, so only
    # its partitions move: deepspeed/runtime/zero/stage3.py reads it, stage_1_and_2.py does
    # not): it maps to nothing, and the warning below says so.
    if params in ("cpu", "nvme") and stage == 3:
        out.set("parallel.offload_params", True, "zero_optimization.offload_param")
    if "offload_param" in zero and stage < 3:
        out.findings.append(
            warning(
                "zero_optimization.offload_param",
                f"offload_param has no effect at stage {stage}: parameters are only partitioned "
                "(and so offloadable) at stage 3",
                "remove offload_param, or use stage 3",
            )
        )


def _offload_device(section: Any) -> str | None:
    if isinstance(section, dict):
        return str(section.get("device", "none")).lower()
    return None


def _map_activation_checkpointing(value: Any, out: Imported, raw: dict[str, Any]) -> None:
    if not isinstance(value, dict):
        return
    out.set("train.activation_checkpoint", "full")
    out.findings.append(
        info(
            "activation_checkpointing",
            "mapped to train.activation_checkpoint = full (DeepSpeed's options tune its own "
            "checkpointing API; dstrain recomputes whole blocks)",
            "use `selective` to recompute only norms, activations and elementwise ops",
        )
    )
    if value.get("cpu_checkpointing") is True:
        out.findings.append(
            warning("activation_checkpointing.cpu_checkpointing", "not supported: kept on device")
        )


def _map_pipeline(value: Any, out: Imported, raw: dict[str, Any]) -> None:
    if isinstance(value, dict) and isinstance(value.get("stages"), int):
        out.set("parallel.pp", value["stages"], "pipeline.stages")


def _map_tensor_parallel(value: Any, out: Imported, raw: dict[str, Any]) -> None:
    if isinstance(value, dict) and "autotp_size" in value:
        size = as_int(value["autotp_size"], "tensor_parallel.autotp_size", out.findings, 1)
        if size is not None:
            out.set("parallel.tp", size, "tensor_parallel.autotp_size")


def _map_comm_dtype(value: Any, out: Imported, raw: dict[str, Any]) -> None:
    kinds = {"bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16"}
    if str(value).lower() in kinds:
        out.set("comm.compression", kinds[str(value).lower()])


_MAPPERS = {
    "train_batch_size": _map_train_batch,
    "train_micro_batch_size_per_gpu": _map_micro_batch,
    "gradient_accumulation_steps": _map_grad_accum,
    "gradient_clipping": _map_clipping,
    "steps_per_print": _map_steps_per_print,
    "wall_clock_breakdown": _map_wall_clock,
    "tensorboard": _map_tensorboard,
    "wandb": _map_wandb,
    "optimizer": _map_optimizer,
    "scheduler": _map_scheduler,
    "fp16": _map_fp16,
    "bf16": _map_bf16,
    "zero_optimization": _map_zero,
    "activation_checkpointing": _map_activation_checkpointing,
    "pipeline": _map_pipeline,
    "tensor_parallel": _map_tensor_parallel,
    "communication_data_type": _map_comm_dtype,
}


def _batch_findings(raw: dict[str, Any], out: Imported) -> None:
    """DeepSpeed needs a batch size; HF 'auto' only works when the whole triple is auto."""
    batch_keys = ("train_batch_size", "train_micro_batch_size_per_gpu")
    megatron_batch = ("micro_batch_size", "global_batch_size")
    if not any(k in raw for k in batch_keys + megatron_batch):
        # runtime/config.py, _set_batch_related_parameters: `assert False, 'Either
        # train_batch_size or train_micro_batch_size_per_gpu needs to be provided'`. Current
        # transformers (`fill_match`) and Accelerate fill only keys written "auto"; PyTorch
        # Lightning's DeepSpeedStrategy (and the HF Trainer of 2021) add an absent micro batch.
        # A file with "auto" values is one for the HF Trainer / Accelerate: an error; otherwise
        # the launcher decides: a warning that says which ones fill it.
        hf = uses_auto(raw)
        what = error if hf else warning
        out.findings.append(
            what(
                "train_batch_size",
                "neither train_batch_size nor train_micro_batch_size_per_gpu is set: DeepSpeed "
                "refuses to start (`Either train_batch_size or train_micro_batch_size_per_gpu "
                "needs to be provided`); "
                + (
                    "this file's `auto` values are for the HF Trainer / Accelerate, which fill "
                    "only keys written `auto`"
                    if hf
                    else "only a launcher that adds the micro batch (PyTorch Lightning) runs it; "
                    "current HF Trainer and Accelerate fill only keys written `auto`"
                ),
                '"train_micro_batch_size_per_gpu": "auto" and "train_batch_size": "auto" for the '
                "HF Trainer / Accelerate, numbers otherwise",
            )
        )
    if raw.get("train_batch_size") == AUTO and "gradient_accumulation_steps" not in raw:
        # A warning, not an error: whether it fails depends on the launcher, not on the file.
        # The HF Trainer fills train_batch_size = micro x its --gradient_accumulation_steps x
        # world size, and leaves an absent gradient_accumulation_steps absent
        # (transformers/integrations/deepspeed.py, `fill_match` skips keys the file lacks);
        # the run then reaches DeepSpeed with an accumulation of 1 (codealpaca#14: "256 !=
        # 8 * 1 * 8"), which passes only when the Trainer does not accumulate (DeepSpeed#3654's
        # config of this shape trained).
        out.findings.append(
            warning(
                "gradient_accumulation_steps",
                "train_batch_size is `auto` but gradient_accumulation_steps is missing: the HF "
                "Trainer fills train_batch_size = micro x its --gradient_accumulation_steps x "
                "world size but not the missing key, so DeepSpeed runs with an accumulation of "
                "1 and its batch check (`train_batch_size is not equal to micro_batch_per_gpu * "
                "gradient_acc_step * world_size`) fails whenever the Trainer accumulates",
                'add "gradient_accumulation_steps": "auto"',
            )
        )


def _precision_findings(raw: dict[str, Any], out: Imported) -> None:
    fp16, bf16 = raw.get("fp16"), raw.get("bf16")
    fp16_on = isinstance(fp16, dict) and deepspeed_true(fp16.get("enabled"))
    bf16_on = isinstance(bf16, dict) and deepspeed_true(bf16.get("enabled"))
    if fp16_on and bf16_on:
        out.findings.append(
            error(
                "fp16.enabled",
                "fp16 and bf16 are both enabled (DeepSpeed asserts: `bfloat16 and fp16 modes "
                "cannot be simultaneously enabled`)",
                "enable exactly one of them",
            )
        )
    if fp16_on and uses_auto(raw):
        out.findings.append(
            warning(
                "fp16.enabled",
                "fp16 is hard-coded to true in a config whose other values are `auto`: launched "
                "with --bf16 the HF Trainer refuses it (`--mixed_precision` bf16 vs fp16 in the "
                "DeepSpeed config)",
                'set fp16.enabled (and bf16.enabled) to "auto" so the launcher decides',
            )
        )
