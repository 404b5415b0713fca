"""What DeepSpeed's engine itself refuses, or reads otherwise than it looks, when it starts on a
config: the combinations `deepspeed.initialize` asserts against, and how it reads a value.

`ds_lint.py` checks the keys (unknown, misplaced, deprecated); this file checks what the engine
does with their values. Each rule cites the DeepSpeed source it models. A rule that depends on
what the launcher passes besides the file (the HF Trainer's own optimizer, a second model) says
when it fails instead of guessing.
"""

from typing import Any

from dstrain.config.findings import Finding, error, info, warning
from dstrain.interop.ds_keys import DS_REMOVED_TOP_LEVEL, DS_REMOVED_ZERO, Release
from dstrain.interop.imported import AUTO, LAX_BOOL_WORDS, lax_value

ONE_BIT = {"onebitadam": "OneBitAdam", "zerooneadam": "ZeroOneAdam", "onebitlamb": "OneBitLamb"}
_FALSE_WORDS = ("false", "0", "no", "off")
# Scalars the engine reads with a plain dict.get (get_scalar_param in
# deepspeed/runtime/config_utils.py), so a string's truth is what counts: "false" is on.
_SCALAR_SWITCHES = (
    "wall_clock_breakdown",
    "memory_breakdown",
    "prescale_gradients",
    "sparse_gradients",
    "dump_state",
    "zero_allow_untested_optimizer",
    "zero_force_ds_cpu_optimizer",
    "dataloader_drop_last",
)


def engine_rules(raw: dict[str, Any], rel: Release) -> list[Finding]:
    zero = raw.get("zero_optimization")
    zero = zero if isinstance(zero, dict) else {}
    return [
        *_string_switches(raw, rel),
        *_typed_strings(raw, rel),
        *_removed_features(raw, zero, rel),
        *_offload_devices(zero),
        *_lamb_with_a_static_loss_scale(raw),
        *_one_bit_with_zero(raw, zero),
        *_zero_with_pipeline(raw, zero),
        *_offload_with_a_client_optimizer(raw, zero),
        *_partial_offload(zero),
        *_quantized_gradients(zero),
        *_no_optimizer_for_a_second_model(raw, zero),
        *_hard_coded_batch_for_a_trainer(raw),
    ]


def deepspeed_true(value: Any) -> bool:
    """fp16/bf16 `enabled` as DeepSpeed reads it. Up to the pydantic precision configs
    (get_fp16_enabled / get_bfloat16_enabled through get_scalar_param) any non-empty string is
    on; `DeepSpeedFP16Config` / `DeepSpeedBF16Config` (deepspeed/runtime/precision_config.py,
    pydantic in lax mode) read "false" as false. `auto` is the HF Trainer's to replace."""
    if value == AUTO:
        return False
    if isinstance(value, str):
        return value.strip().lower() not in (*_FALSE_WORDS, "")
    return bool(value)


def _string_switches(raw: dict[str, Any], rel: Release) -> list[Finding]:
    found = [_string_switch(key, raw.get(key), dict_get=True) for key in _SCALAR_SWITCHES]
    for section in ("fp16", "bf16"):
        node = raw.get(section)
        if isinstance(node, dict):
            value = node.get("enabled")
            if rel.pydantic_precision:  # a pydantic bool: `_typed_strings` judges it
                found.append(_lax_switch(f"{section}.enabled", value))
            else:
                found.append(_string_switch(f"{section}.enabled", value, dict_get=False))
    return [f for f in found if f is not None]


def _lax_switch(key: str, value: Any) -> Finding | None:
    # DeepSpeedFP16Config / DeepSpeedBF16Config.enabled is a pydantic bool in lax mode: "false",
    # "no", "off", "0" are false, so DeepSpeed reads the switch right; the HF Trainer's
    # `fill_match` compares the string with its own boolean and refuses the mismatch.
    if not isinstance(value, str) or value == AUTO or value.strip().lower() not in LAX_BOOL_WORDS:
        return None
    return warning(
        key,
        f'`{key}` is the string "{value}", not a JSON boolean: DeepSpeed (pydantic) reads it as '
        "a boolean, but the HF Trainer's check compares it with its own boolean and refuses "
        "the mismatch",
        'write true or false without quotes, or "auto"',
    )


def _string_switch(key: str, value: Any, dict_get: bool) -> Finding | None:
    """A switch written as a string. Read by dict.get, "false" is a non-empty string, so on; the
    pydantic sections of newer releases coerce it, but older ones (and the HF integration's
    `fill_match`, which compares it with the Trainer's own boolean) do not."""
    if not isinstance(value, str) or value == AUTO:
        return None
    word = value.strip().lower()
    if word in _FALSE_WORDS:
        versions = "" if dict_get else " (DeepSpeed before its pydantic precision configs)"
        return error(
            key,
            f'`{key}` is the string "{value}": DeepSpeed{versions} reads a non-empty string as '
            "true, so this turns it on",
            f'write `"{key.rsplit(".", 1)[-1]}": false` (a JSON boolean, no quotes)'
            + ("" if dict_get else ', or "auto"'),
        )
    return warning(
        key,
        f'`{key}` is the string "{value}", not a JSON boolean: DeepSpeed takes it as true, but '
        "the HF Trainer's check compares it with its own boolean and refuses the mismatch",
        "write true or false without quotes" + ("" if dict_get else ', or "auto"'),
    )


def _one_bit_with_zero(raw: dict[str, Any], zero: dict[str, Any]) -> list[Finding]:
    # deepspeed/runtime/engine.py, _configure_basic_optimizer: the 1-bit optimizers assert
    # `not self.zero_optimization()` ("1bit-Adam is not compatible with ZeRO").
    stage = zero.get("stage", 0)
    optimizer = raw.get("optimizer")
    kind = str(optimizer.get("type", "")) if isinstance(optimizer, dict) else ""
    if kind.lower() in ONE_BIT and isinstance(stage, int) and stage >= 1:
        return [
            error(
                "optimizer.type",
                f"{ONE_BIT[kind.lower()]} does not work with ZeRO (stage {stage}): DeepSpeed's "
                "1-bit optimizers compress the full gradient all-reduce, which ZeRO replaces",
                'set "zero_optimization": {"stage": 0} with 1-bit optimizers, or use Adam/AdamW '
                "with ZeRO",
            )
        ]
    return []


def _zero_with_pipeline(raw: dict[str, Any], zero: dict[str, Any]) -> list[Finding]:
    # deepspeed/runtime/pipe/engine.py, PipelineEngine.__init__: `assert
    # self.zero_optimization_stage() < ZeroStageEnum.gradients, "ZeRO-2 and ZeRO-3 are
    # incompatible with pipeline parallelism"`. A DeepSpeed JSON with pipeline stages (its own
    # `pipeline.stages`, or Megatron-DeepSpeed's pipeline size beside it) runs that engine.
    stage = zero.get("stage", 0)
    pipeline = raw.get("pipeline")
    pp = raw.get("pipeline_model_parallel_size") or (
        pipeline.get("stages") if isinstance(pipeline, dict) else None
    )
    if isinstance(pp, int) and pp > 1 and stage in (2, 3):
        return [
            error(
                "zero_optimization.stage",
                f"ZeRO stage {stage} with pipeline parallelism ({pp} stages): DeepSpeed's "
                "PipelineEngine asserts `ZeRO-2 and ZeRO-3 are incompatible with pipeline "
                "parallelism`",
                "use stage 1 (or 0) with pipeline parallelism in DeepSpeed; dstrain itself runs "
                "ZeRO-2 with PP (`dstrain convert` this file, then set parallel.zero_stage = 2)",
            )
        ]
    return []


def _offload_device(zero: dict[str, Any], key: str) -> str:
    node = zero.get(key)
    device = node.get("device", "none") if isinstance(node, dict) else "none"
    legacy = {"offload_optimizer": "cpu_offload", "offload_param": "cpu_offload_params"}[key]
    return "cpu" if zero.get(legacy) is True else str(device).lower()


def _offload_with_a_client_optimizer(raw: dict[str, Any], zero: dict[str, Any]) -> list[Finding]:
    # deepspeed/runtime/engine.py, _configure_optimizer (0.8.3+): with optimizer offload and a
    # client optimizer that is not DeepSpeedCPUAdam, `if self.zero_force_ds_cpu_optimizer():
    # raise ZeRORuntimeException("You are using ZeRO-Offload with a client provided optimizer
    # ...")`. Without an `optimizer` section the optimizer is the client's: the HF Trainer
    # (transformers/integrations/deepspeed.py, deepspeed_optim_sched) then passes torch's AdamW.
    if _offload_device(zero, "offload_optimizer") not in ("cpu", "nvme") or "optimizer" in raw:
        return []
    if raw.get("zero_force_ds_cpu_optimizer") is False:
        return []
    by_hf = uses_auto(raw)
    what = (
        "the HF Trainer (this file's `auto` values) passes torch's AdamW"
        if by_hf
        else "the launching code passes its own optimizer"
    )
    message = (
        "optimizer offload without an `optimizer` section: "
        f"{what}, and DeepSpeed (0.8.3+) refuses a client optimizer under ZeRO-Offload unless "
        "it is DeepSpeedCPUAdam (`You are using ZeRO-Offload with a client provided optimizer`)"
    )
    fix = (
        'add an "optimizer" section (e.g. {"type": "AdamW", "params": {"lr": "auto"}}), or '
        'set "zero_force_ds_cpu_optimizer": false'
    )
    # A warning even for the HF Trainer: whether it stops depends on the DeepSpeed release (the
    # exception is 0.8.3's) and on the optimizer the launcher really passes, and configs of this
    # shape are published as working (FastChat's deepspeed_config_s3.json).
    return [warning("zero_optimization.offload_optimizer", message, fix)]


def _partial_offload(zero: dict[str, Any]) -> list[Finding]:
    # DeepSpeed's partial optimizer offload (offload_optimizer.ratio, ZeRO-3 only) steps the
    # offloaded share with DeepSpeedCPUAdam on the CPU; on NVMe the tensors are not where it
    # expects them (DeepSpeed#4872: "expected input to be on cuda"; the maintainer: "device should
    # be cpu, not nvme").
    node = zero.get("offload_optimizer")
    if not isinstance(node, dict) or "ratio" not in node:
        return []
    ratio, device = node.get("ratio"), str(node.get("device", "none")).lower()
    if isinstance(ratio, int | float) and ratio < 1 and device == "nvme":
        return [
            error(
                "zero_optimization.offload_optimizer.ratio",
                f"partial offload (ratio {ratio}) with device nvme: DeepSpeed offloads a share of "
                "the optimizer states to the CPU only, and fails at the first step "
                "(`expected input to be on cuda`)",
                'set "device": "cpu" (no nvme_path needed), or drop ratio to offload it all',
            )
        ]
    if zero.get("stage") != 3:
        return [
            warning(
                "zero_optimization.offload_optimizer.ratio",
                f"ratio (partial offload) is read by ZeRO stage 3 only; stage {zero.get('stage')} "
                "offloads all of the optimizer states",
                "use stage 3 for partial offload, or remove ratio",
            )
        ]
    return []


def _quantized_gradients(zero: dict[str, Any]) -> list[Finding]:
    # deepspeed/runtime/zero/stage3.py, ZeRO++'s quantized gradients (all-to-all reduce):
    # `assert self.reduce_scatter, "when enable all_to_all_reduce, reduce_scatter should also
    # be enabled for data type checks."` (DeepSpeed#3809).
    if zero.get("zero_quantized_gradients") is True and zero.get("reduce_scatter") is False:
        return [
            error(
                "zero_optimization.zero_quantized_gradients",
                "ZeRO++ quantized gradients (an all_to_all reduce) with reduce_scatter false: "
                "DeepSpeed asserts `when enable all_to_all_reduce, reduce_scatter should also be "
                "enabled`",
                'set "reduce_scatter": true (or drop zero_quantized_gradients)',
            )
        ]
    return []


def _no_optimizer_for_a_second_model(raw: dict[str, Any], zero: dict[str, Any]) -> list[Finding]:
    # deepspeed/runtime/engine.py, _configure_zero_optimizer: initialising a model with neither a
    # client optimizer nor an `optimizer` section asserts "zero stage {N} requires an optimizer"
    # at stages 1-2. Training passes one; a second model (a DPO/PPO reference model wrapped by
    # deepspeed.initialize alone, LlamaFactory#1243) does not. The file cannot say: a note.
    stage = zero.get("stage", 0)
    if stage in (1, 2) and "optimizer" not in raw:
        return [
            info(
                "optimizer",
                f"no `optimizer` section at ZeRO stage {stage}: fine for the model being trained "
                "(the launcher passes its optimizer), but a model initialised without one (a DPO "
                f"or PPO reference model) stops with `zero stage {stage} requires an optimizer`",
                'add an "optimizer" section if the run wraps a second model (DPO, PPO)',
            )
        ]
    return []


def _hard_coded_batch_for_a_trainer(raw: dict[str, Any]) -> list[Finding]:
    # transformers/integrations/deepspeed.py, HfTrainerDeepSpeedConfig.trainer_config_process:
    # `fill_match` compares a present, non-`auto` value with the Trainer's own argument and
    # trainer_config_finalize raises "Please correct the following DeepSpeed config values that
    # mismatch TrainingArguments values" (LlamaFactory#366: micro 16 and gas 8 in the file, the
    # Trainer's defaults 8 and 1). A file with no `optimizer` section is one a launcher with its
    # own optimizer (the HF Trainer, Lightning) runs; whether the numbers match is on its
    # command line: a note.
    hard = [
        k
        for k in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
        if isinstance(raw.get(k), int)
    ]
    if not hard or "optimizer" in raw:
        return []
    return [
        info(
            hard[0],
            f"{' and '.join(hard)} hard-coded in a config without an `optimizer` section (one a "
            "trainer with its own optimizer launches): under the HF Trainer they must equal "
            "--per_device_train_batch_size / --gradient_accumulation_steps, or it refuses them "
            "(`Please correct the following DeepSpeed config values that mismatch "
            "TrainingArguments values`)",
            'write "auto" for them when launching through the HF Trainer',
        )
    ]


def uses_auto(raw: dict[str, Any]) -> bool:
    """Some value is the HF Trainer's `auto`: the file is one the Trainer fills in."""
    return any(v == AUTO for v in _leaves(raw))


def _leaves(node: Any) -> list[Any]:
    if isinstance(node, dict):
        return [leaf for v in node.values() for leaf in _leaves(v)]
    return [node]


# Fields of DeepSpeed's pydantic sections (runtime/zero/config.py, zero/offload_config.py,
# precision_config.py) by type. Pydantic's lax mode turns "2" into 2 and "false" into False, and
# refuses "5e8" for an int and "maybe" for a bool.
_INT_FIELDS = {
    "zero_optimization": (
        "stage", "reduce_bucket_size", "allgather_bucket_size", "sub_group_size",
        "prefetch_bucket_size", "stage3_prefetch_bucket_size", "param_persistence_threshold",
        "stage3_param_persistence_threshold", "model_persistence_threshold",
        "stage3_model_persistence_threshold", "max_live_parameters", "stage3_max_live_parameters",
        "max_reuse_distance", "stage3_max_reuse_distance", "zero_hpz_partition_size",
    ),
    "zero_optimization.offload_param": ("buffer_count", "buffer_size", "max_in_cpu"),
    "zero_optimization.offload_optimizer": ("buffer_count",),
    "fp16": ("initial_scale_power", "loss_scale_window", "hysteresis"),
}  # fmt: skip
_FLOAT_FIELDS = {
    "fp16": ("loss_scale", "min_loss_scale"),
    "zero_optimization.offload_optimizer": ("ratio",),
}
_BOOL_FIELDS = {
    "zero_optimization": (
        "contiguous_gradients", "reduce_scatter", "allgather_partitions", "overlap_comm",
        "load_from_fp32_weights", "elastic_checkpoint", "round_robin_gradients",
        "ignore_unused_parameters", "zero_quantized_weights", "zero_quantized_gradients",
        "zero_quantized_nontrainable_weights", "gather_16bit_weights_on_model_save",
        "stage3_gather_16bit_weights_on_model_save", "use_multi_rank_bucket_allreduce",
        "memory_efficient_linear",
    ),
    "zero_optimization.offload_param": ("pin_memory",),
    "zero_optimization.offload_optimizer": ("pin_memory", "pipeline_read", "pipeline_write"),
    "fp16": ("auto_cast", "consecutive_hysteresis", "fp16_master_weights_and_grads"),
    "bf16": ("immediate_grad_update", "check_grad_overflow"),
}  # fmt: skip
_PRECISION = ("fp16", "bf16")


def _typed_strings(raw: dict[str, Any], rel: Release) -> list[Finding]:
    """A number or switch written as a string inside a pydantic section: coerced by DeepSpeed
    when pydantic's lax mode can read it (a warning), refused when it cannot (an error)."""
    found = []
    for kind, table in (("int", _INT_FIELDS), ("float", _FLOAT_FIELDS), ("bool", _BOOL_FIELDS)):
        for section, names in table.items():
            if section in _PRECISION and not rel.pydantic_precision:
                continue  # read with dict.get before 0.17.3: deepspeed.py's mappers judge them
            node = _node(raw, section)
            for name in names:
                value = node.get(name)
                if isinstance(value, str) and value != AUTO:
                    found.append(_typed_string(f"{section}.{name}", value, kind))
    return found


def _typed_string(key: str, value: str, kind: str) -> Finding:
    what = {"int": "a whole number", "float": "a number", "bool": "true or false"}[kind]
    if lax_value(value, kind) is None:
        return error(
            key,
            f'`{key}` is the string "{value}", which DeepSpeed\'s config (pydantic) cannot read '
            f"as {what}: it refuses the config",
            f"write {what} without quotes",
        )
    return warning(
        key,
        f'`{key}` is the string "{value}": DeepSpeed (pydantic) coerces it to {what}, but other '
        "tools reading the file may not",
        f"write {what} without quotes",
    )


def _node(raw: dict[str, Any], dotted: str) -> dict[str, Any]:
    node: Any = raw
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node if isinstance(node, dict) else {}


def _removed_features(raw: dict[str, Any], zero: dict[str, Any], rel: Release) -> list[Finding]:
    # runtime/config.py (0.19+), _reject_removed_config_keys: a DeepSpeedConfigError naming the
    # removed feature (issue #8489); engine.py: the 1-bit optimizers left DEEPSPEED_OPTIMIZERS,
    # so `_is_supported_optimizer` fails ("OneBitAdam is not a supported DeepSpeed Optimizer").
    if not rel.removed_features:
        return []
    keys = [k for k in raw if k in DS_REMOVED_TOP_LEVEL]
    keys += [f"zero_optimization.{k}" for k in zero if k in DS_REMOVED_ZERO]
    found = [
        error(
            key,
            f"`{key}` is a feature DeepSpeed {rel.name} removed: its config loader refuses the "
            "file (DeepSpeedConfigError, DeepSpeed issue #8489)",
            "remove the section (fp16/bf16/torch_autocast replace apex `amp`; "
            "data_efficiency.data_sampling.curriculum_learning replaces curriculum_learning), "
            f"or judge by the release you run: {_RELEASE_HINT}",
        )
        for key in keys
    ]
    optimizer = raw.get("optimizer")
    kind = str(optimizer.get("type", "")) if isinstance(optimizer, dict) else ""
    if kind.lower() in ONE_BIT:
        found.append(
            error(
                "optimizer.type",
                f"DeepSpeed {rel.name} has no {kind}: the 1-bit optimizers were removed, so "
                f"deepspeed.initialize asserts `{kind} is not a supported DeepSpeed Optimizer`",
                f"use Adam/AdamW, or judge by the release you run: {_RELEASE_HINT}",
            )
        )
    return found


_RELEASE_HINT = "DSTRAIN_DEEPSPEED_RELEASE=0.18.9 dstrain check ..."
_OFFLOAD_DEVICES = ("none", "cpu", "nvme")


def _offload_devices(zero: dict[str, Any]) -> list[Finding]:
    # runtime/zero/offload_config.py, OffloadDeviceEnum: "none", "cpu" or "nvme", case and all;
    # ZeRO-3 asserts `"nvme_path" in DeepSpeed Config cannot be None if remote device is nvme`
    # (zero/partition_parameters.py) and joins the optimizer's nvme_path (zero/stage3.py).
    found = []
    for name in ("offload_param", "offload_optimizer"):
        node = zero.get(name)
        if not isinstance(node, dict) or "device" not in node:
            continue
        device, key = node["device"], f"zero_optimization.{name}.device"
        if device not in _OFFLOAD_DEVICES:
            found.append(
                error(
                    key,
                    f"offload device {device!r} does not exist: DeepSpeed accepts only "
                    '"none", "cpu" or "nvme" (lower case) and refuses the config',
                    'write "cpu" (or "nvme" with an nvme_path)',
                )
            )
        elif device == "nvme" and not node.get("nvme_path") and zero.get("stage") in (3, "3"):
            found.append(
                error(
                    f"zero_optimization.{name}.nvme_path",
                    f"{name} on nvme without an nvme_path: ZeRO-3 stops at start-up "
                    '(`"nvme_path" in DeepSpeed Config cannot be None if remote device is nvme`)',
                    'add "nvme_path": "/local_nvme" (a fast local disk), or use "device": "cpu"',
                )
            )
    return found


def _lamb_with_a_static_loss_scale(raw: dict[str, Any]) -> list[Finding]:
    # runtime/engine.py, _do_sanity_check: `if self.optimizer_name() == LAMB_OPTIMIZER: assert
    # self.dynamic_loss_scale(), "DeepSpeed lamb optimizer requires dynamic loss scaling"`, where
    # dynamic_loss_scale() is `fp16.loss_scale == 0`, read whether fp16 is on or not.
    optimizer, fp16 = raw.get("optimizer"), raw.get("fp16")
    kind = str(optimizer.get("type", "")).lower() if isinstance(optimizer, dict) else ""
    scale = fp16.get("loss_scale", 0) if isinstance(fp16, dict) else 0
    number = lax_value(scale, "float") if isinstance(scale, str) else scale
    if kind != "lamb" or not isinstance(number, int | float) or number == 0:
        return []
    return [
        error(
            "fp16.loss_scale",
            f"LAMB with a static loss scale ({scale}): deepspeed.initialize asserts `DeepSpeed "
            "lamb optimizer requires dynamic loss scaling` (it reads fp16.loss_scale even with "
            "fp16 off)",
            'set "loss_scale": 0 (dynamic), or remove it',
        )
    ]
