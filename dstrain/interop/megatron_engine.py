"""What Megatron-LM and Megatron-DeepSpeed themselves refuse or infer from a launch script's
flags, beyond the layout rules dstrain shares with them (`rules.py`): each rule cites the engine
source it models. Flags arrive as Megatron's argparse dests (`tensor_model_parallel_size`).
"""

import difflib
from typing import Any

from dstrain.config.findings import Finding, error, info, warning

# Sources (the stored copies read, by commit): Megatron-LM megatron/training/arguments.py
# (NVIDIA 000c4ac, 2025; 307dcf3, early 2024) and megatron/arguments.py (97d9a50, 2023);
# megatron/core/transformer/transformer_config.py; Megatron-DeepSpeed megatron/arguments.py
# (deepspeedai 207b2d5; microsoft bb4ac1c), megatron/training.py, megatron/utils.py.


def engine_rules(engine: str, flags: dict[str, Any], ds_config: dict[str, Any] | None) -> list:
    findings: list[Finding] = [*_removed_flags(engine, flags), *_flag_combinations(flags, engine)]
    if engine == "ms-swift":
        findings.append(
            info(
                "script",
                "an ms-swift (Megatron-SWIFT) launch: the architecture and the precision come from "
                "the --model checkpoint's config.json and ms-swift's own defaults, which this "
                "check does not read; rules that depend on them are skipped (the split of layers "
                "over pipeline_model_parallel_size, of heads over tensor_model_parallel_size, of "
                "experts over expert_model_parallel_size)",
                "check the layout with the model named: --set model.hf_config=PATH/config.json",
            )
        )
    if engine == "Megatron-DeepSpeed":
        findings += _deepspeed_pipeline_engine(flags, ds_config)
        findings += _no_pipeline_parallel(flags)
        findings += _two_batch_sizes(flags, ds_config)
        findings += _external_ds_config(flags, ds_config)
    return findings


# Flags of the launchers that share a script's command line with Megatron's (torchrun, the
# deepspeed launcher, srun, python itself): not Megatron's, and not its typos.
_LAUNCHER_FLAGS = frozenset(
    {
        "nproc_per_node",
        "nnodes",
        "node_rank",
        "master_addr",
        "master_port",
        "rdzv_backend",
        "rdzv_endpoint",
        "rdzv_id",
        "rdzv_conf",
        "max_restarts",
        "monitor_interval",
        "tee",
        "redirects",
        "log_dir",
        "standalone",
        "no_python",
        "module",
        "num_gpus",
        "num_nodes",
        "hostfile",
        "include",
        "exclude",
        "launcher",
        "launcher_args",
        "ntasks",
        "ntasks_per_node",
        "gpus_per_node",
        "cpus_per_task",
        "nodes",
        "gres",
        "partition",
        "time",
        "job_name",
        "output",
        "error",
        "mpi",
        "container_image",
        "container_mounts",
        "local_rank",
        "deepspeed",
        "deepspeed_config",
        "deepscale",
        "deepscale_config",
        "config_path",
        "config_name",
        "help",
    }
)


def misspelt_flags(engine: str, unknown: list[str], known: set[str]) -> list[Finding]:
    """Flags Megatron-LM does not know that read like one of its own: its parser
    (argparse with allow_abbrev=False, megatron/training/arguments.py, parse_args) stops with
    `unrecognized arguments`; ms-swift's (HfArgumentParser) with `remaining_argv`. A warning,
    since the same line carries other programs' flags (and ms-swift's own)."""
    if engine not in ("Megatron-LM", "Megatron-DeepSpeed", "ms-swift"):
        return []
    found = []
    for name in unknown:
        if name in _LAUNCHER_FLAGS or name.startswith(("no_", "disable_")) or name in _RENAMED:
            continue
        if engine == "ms-swift" and name in _SWIFT_OWN:
            continue  # store_false flags (--no-bias-swiglu-fusion) have another dest
        # Close spellings only (difflib's ratio >= 0.85), not suggest.closest's containment
        # fallback: `--fp8` is not a typo of `--fp8-format`.
        matches = difflib.get_close_matches(name, known, n=1, cutoff=0.85)
        match = matches[0] if matches else None
        if match and match != name:
            flag, meant = f"--{name.replace('_', '-')}", f"--{match.replace('_', '-')}"
            found.append(
                warning(
                    flag,
                    f"{flag} is not a {engine} argument (did you mean {meant}?): its parser "
                    "stops with `unrecognized arguments` on an unknown flag",
                    f"rename it to {meant}, or drop it if it belongs to another program",
                )
            )
    return found


# ms-swift's own arguments (swift/llm/argument, swift/megatron/argument) that read like one of
# Megatron's: not typos (`--lora_rank` is not `--q-lora-rank`).
_SWIFT_OWN = frozenset(
    {
        "lora_rank",
        "lora_alpha",
        "lora_dropout",
        "target_modules",
        "train_type",
        "model_type",
        "max_length",
        "max_epochs",
        "num_train_epochs",
        "split_dataset_ratio",
        "dataset_num_proc",
        "load_from_cache_file",
        "save_safetensors",
        "freeze_llm",
        "freeze_vit",
        "freeze_aligner",
        "attn_impl",
        "padding_free",
        "packing",
        "mcore_model",
        "mcore_adapter",
        "ref_load",
        "ref_adapter_load",
        "vit_gradient_checkpointing",
        "model_author",
        "model_name",
        "report_to",
    }
)

# Flags of earlier Megatron-LM releases that the 2025 arguments.py keeps only under a
# deprecated dest (use_dist_ckpt_deprecated, dist_ckpt_format_deprecated,
# deprecated_use_mcore_models) or no longer has, and what replaces them (None: the behaviour is
# the default now). The release after it refuses them with `unrecognized arguments`.
_RENAMED: dict[str, str | None] = {
    "use_dist_ckpt": "--ckpt-format torch_dist",
    "dist_ckpt_format": "--ckpt-format",
    "use_mcore_models": None,
    "moe_token_dropping": "--moe-expert-capacity-factor",
    "encoder_pipeline_model_parallel_size": None,
    "virtual_pipeline_model_parallel_size": "--num-virtual-stages-per-pipeline-rank",
}


def spelling_rules(engine: str, spellings: dict[str, str], known: set[str]) -> list[Finding]:
    """How Megatron-LM's parser takes the flags as written (`spellings`: argparse dest -> the
    flag as the script writes it, without the dashes): renamed flags, and underscore spellings
    of its dashed flags, which argparse does not match (`unrecognized arguments`)."""
    if engine not in ("Megatron-LM", "Megatron-DeepSpeed"):
        return []
    found = []
    for name, written in spellings.items():
        if name in _RENAMED and engine == "Megatron-LM":
            new = _RENAMED[name]
            found.append(
                warning(
                    f"--{written}",
                    f"--{written} is gone from current Megatron-LM (the 2025 arguments.py keeps it "
                    "at most as deprecated; later releases stop with `unrecognized arguments`)"
                    + (f": it is {new} now" if new else ": its behaviour is the default now"),
                    f"use {new}" if new else f"drop --{written}",
                )
            )
    if engine == "Megatron-LM":
        found += _underscore_spellings(spellings, known)
    return found


def _underscore_spellings(spellings: dict[str, str], known: set[str]) -> list[Finding]:
    """`--micro_batch_size` for Megatron-LM's `--micro-batch-size`. An error when the script
    writes its other Megatron flags with dashes (so Megatron-LM's own parser reads the line);
    a warning when most are underscored (a wrapper such as ms-swift may read them)."""
    ours = {n: w for n, w in spellings.items() if n in known and n not in _LAUNCHER_FLAGS}
    underscored = [w for w in ours.values() if "_" in w]
    if not underscored:
        return []
    mostly_dashed = len(underscored) * 2 < len(ours)
    level = error if mostly_dashed else warning
    return [
        level(
            f"--{w}",
            f"--{w} is written with underscores: Megatron-LM defines --{w.replace('_', '-')} and "
            "its parser (argparse) stops with `unrecognized arguments` on the other spelling",
            f"write --{w.replace('_', '-')}",
        )
        for w in underscored
    ]


def _given(flags: dict[str, Any], name: str) -> bool:
    return name in flags and flags[name] is not False


def _removed_flags(engine: str, flags: dict[str, Any]) -> list[Finding]:
    """Flags Megatron-LM's validate_args refuses by name (arguments.py, all versions read)."""
    removed = {
        "batch_size": "--batch-size argument is no longer valid, use --micro-batch-size instead",
        "warmup": "--warmup argument is no longer valid, use --lr-warmup-fraction instead",
        "model_parallel_size": "--model-parallel-size is no longer valid, use "
        "--tensor-model-parallel-size instead",
    }
    found = [
        error(
            f"--{name.replace('_', '-')}", f"Megatron asserts: `{message}`", message.split(", ")[1]
        )
        for name, message in removed.items()
        if _given(flags, name)
    ]
    # Megatron-LM 2023+: `--checkpoint-activations is no longer valid, use
    # --recompute-activations ...`, then exit(): the job ends at once, with status 0.
    # Megatron-DeepSpeed keeps the flag (its DeepSpeed activation checkpointing reads it).
    if engine == "Megatron-LM" and _given(flags, "checkpoint_activations"):
        found.append(
            error(
                "--checkpoint-activations",
                "Megatron-LM (2023 and later) prints `--checkpoint-activations is no longer "
                "valid, use --recompute-activations` and exits before training, with status 0",
                "use --recompute-activations (selective), or --recompute-granularity full "
                "--recompute-method uniform --recompute-num-layers 1",
            )
        )
    return found


def _flag_combinations(flags: dict[str, Any], engine: str) -> list[Finding]:
    """Combinations Megatron-LM's validate_args (and TransformerConfig) assert against. A
    wrapper with defaults of its own (ms-swift: precision from the checkpoint, the distributed
    optimizer on) is judged only on what its flags say outright."""
    found = []
    defaults_known = engine in ("Megatron-LM", "Megatron-DeepSpeed")
    ep = flags.get("expert_model_parallel_size", 1)
    tp = flags.get("tensor_model_parallel_size", 1)
    # Both asserts are in validate_args of the 2023-2025 releases read; the differential run
    # against Megatron-LM of 2026-08 (issue 33) starts both: a warning that names both.
    if isinstance(ep, int) and ep > 1 and _given(flags, "fp16"):
        found.append(
            warning(
                "--fp16",
                "expert parallelism with fp16: Megatron-LM 2023-2025 asserts `Expert parallelism "
                "is not supported with fp16 training.`; current Megatron-LM (2026) no longer has "
                "the assert",
                "use --bf16 with --expert-model-parallel-size > 1 on older releases",
            )
        )
    if _given(flags, "moe_grouped_gemm") and (
        _given(flags, "fp16") or (defaults_known and not _given(flags, "bf16"))
    ):
        found.append(
            warning(
                "--moe-grouped-gemm",
                "--moe-grouped-gemm without --bf16: Megatron-LM 2024-2025 asserts `Currently "
                "GroupedGEMM for MoE only supports bf16 dtype.`; current Megatron-LM (2026) no "
                "longer has the assert",
                "add --bf16 on older releases, or drop --moe-grouped-gemm",
            )
        )
    if (
        isinstance(ep, int)
        and isinstance(tp, int)
        and ep > 1
        and tp > 1
        and not _given(flags, "sequence_parallel")
    ):
        found.append(
            warning(
                "--sequence-parallel",
                "expert and tensor parallelism without --sequence-parallel: Megatron-LM 2023-24 "
                "asserts `When using expert parallelism and tensor parallelism, sequence "
                "parallelism must be used`; current Megatron-Core only warns",
                "add --sequence-parallel",
            )
        )
    found += _recompute(flags, engine)
    if flags.get("recompute_granularity") == "selective" and _given(flags, "recompute_method"):
        found.append(
            error(
                "--recompute-method",
                "Megatron asserts `recompute method is not yet supported for selective "
                "recomputing granularity`",
                "drop --recompute-method, or use --recompute-granularity full",
            )
        )
    if _given(flags, "tp_comm_overlap") and not (
        _given(flags, "sequence_parallel") and isinstance(tp, int) and tp > 1
    ):
        found.append(
            error(
                "--tp-comm-overlap",
                "Megatron asserts `Tensor parallel communication/GEMM overlap can happen only when "
                "sequence parallelism is enabled` (at tp 1 sequence parallelism is switched off)",
                "add --sequence-parallel with --tensor-model-parallel-size > 1, or drop "
                "--tp-comm-overlap",
            )
        )
    if _given(flags, "overlap_param_gather"):
        if not _given(flags, "use_distributed_optimizer") and defaults_known:
            found.append(
                error(
                    "--overlap-param-gather",
                    "Megatron asserts `--overlap-param-gather only supported with distributed "
                    "optimizer`",
                    "add --use-distributed-optimizer",
                )
            )
        if not _given(flags, "overlap_grad_reduce") and defaults_known:
            found.append(
                error(
                    "--overlap-param-gather",
                    "Megatron asserts `Must use --overlap-param-gather with --overlap-grad-reduce`",
                    "add --overlap-grad-reduce",
                )
            )
    found += _interleaving(flags)
    return found


_VIRTUAL = (
    "num_layers_per_virtual_pipeline_stage",
    "num_virtual_stages_per_pipeline_rank",
    "virtual_pipeline_model_parallel_size",
)


def _interleaving(flags: dict[str, Any]) -> list[Finding]:
    """validate_args, on any spelling of the virtual size: the interleaved schedule needs
    pp > 1 (2025, with p2p overlap on, the default) or pp > 2 (2023-24, and 2025 with
    --no-overlap-p2p-communication)."""
    given = [name for name in _VIRTUAL if _given(flags, name)]
    pp = flags.get("pipeline_model_parallel_size", 1)
    if not given or not isinstance(pp, int) or pp > 2:
        return []
    flag = f"--{given[0].replace('_', '-')}"
    if pp == 1:
        return [
            error(
                flag,
                f"{flag} at pipeline size 1: Megatron asserts `When interleaved schedule is used, "
                "pipeline-model-parallel size should be greater than 1`",
                f"drop {flag}, or use --pipeline-model-parallel-size > 1",
            )
        ]
    return [
        warning(
            flag,
            "the interleaved schedule at pipeline size 2: Megatron-LM 2023-24 asserts "
            "`pipeline-model-parallel size should be greater than 2 with interleaved "
            "schedule`; 2025 releases accept it while p2p overlap is on (the default)",
            "use pp > 2 on older Megatron-LM",
        )
    ]


def _recompute(flags: dict[str, Any], engine: str) -> list[Finding]:
    """TransformerConfig.__post_init__: full recomputation needs a method (block or uniform)
    and a layer count; selective takes neither. Argparse defaults both to None in Megatron-LM
    and ms-swift; NeMo's config and Megatron-DeepSpeed's engine may set them."""
    if engine not in ("Megatron-LM", "ms-swift") or flags.get("recompute_granularity") != "full":
        return []
    found = []
    for name, missing in (("recompute_method", "method"), ("recompute_num_layers", "num_layers")):
        if not _given(flags, name):
            found.append(
                error(
                    "--recompute-granularity",
                    f"--recompute-granularity full without --{name.replace('_', '-')}: "
                    f"Megatron-Core raises `Using recompute_granularity: full so recompute_"
                    f"{missing} must be ...` (TransformerConfig.__post_init__)",
                    "add --recompute-method uniform --recompute-num-layers 1",
                )
            )
    return found


def _no_pipeline_parallel(flags: dict[str, Any]) -> list[Finding]:
    # Megatron-DeepSpeed arguments.py: `pipeline_model_parallel_size must be 1 if pipeline
    # parallel is disabled`.
    pp = flags.get("pipeline_model_parallel_size", 1)
    if _given(flags, "no_pipeline_parallel") and isinstance(pp, int) and pp != 1:
        return [
            error(
                "--no-pipeline-parallel",
                f"--no-pipeline-parallel with --pipeline-model-parallel-size {pp}: "
                "Megatron-DeepSpeed asserts `pipeline_model_parallel_size must be 1 if pipeline "
                "parallel is disabled`",
                "drop --no-pipeline-parallel, or set --pipeline-model-parallel-size 1",
            )
        ]
    return []


def _two_batch_sizes(flags: dict[str, Any], ds_config: dict[str, Any] | None) -> list[Finding]:
    """Megatron-DeepSpeed never compares the two configs' batch sizes: under DeepSpeed's
    pipeline engine the micro-batches per step are the JSON's, while --global-batch-size drives
    the LR schedule and the samples consumed (megatron/training.py, get_optimizer_param_scheduler;
    megatron/utils.py, set_ds_auto_config_values replaces only `auto`). A gas of `auto` stays
    the string "auto" and breaks DeepSpeed's batch arithmetic (a TypeError)."""
    ds = ds_config or {}
    found = []
    for ds_key, flag in (
        ("train_batch_size", "global_batch_size"),
        ("train_micro_batch_size_per_gpu", "micro_batch_size"),
    ):
        ours, theirs = ds.get(ds_key), flags.get(flag)
        if isinstance(ours, int) and isinstance(theirs, int) and ours != theirs:
            found.append(
                warning(
                    ds_key,
                    f"the DeepSpeed JSON's {ds_key} {ours} differs from --{flag.replace('_', '-')} "
                    f"{theirs}: Megatron-DeepSpeed does not check them against each other; "
                    "DeepSpeed steps by the JSON's, the LR schedule counts the flag's",
                    f'make them equal, or write "{ds_key}": "auto" (filled from the flag)',
                )
            )
    if ds.get("gradient_accumulation_steps") == "auto":
        found.append(
            error(
                "gradient_accumulation_steps",
                '"auto" gradient_accumulation_steps under Megatron-DeepSpeed: it fills only '
                "train_batch_size and train_micro_batch_size_per_gpu, so DeepSpeed's batch "
                "arithmetic gets the string and fails",
                "drop the key (DeepSpeed derives it) or write the number",
            )
        )
    return found


def _zero_stage(flags: dict[str, Any], ds_config: dict[str, Any] | None) -> tuple[int | None, str]:
    """The ZeRO stage DeepSpeed will run: the heredoc JSON's when the script writes one, else
    Megatron-DeepSpeed's own --zero-stage (which scripts keep equal to the JSON's)."""
    zero = (ds_config or {}).get("zero_optimization")
    if isinstance(zero, dict) and isinstance(zero.get("stage"), int):
        return zero["stage"], "zero_optimization.stage"
    stage = flags.get("zero_stage")
    return (stage, "zero_stage") if isinstance(stage, int) else (None, "")


def _deepspeed_pipeline_engine(
    flags: dict[str, Any], ds_config: dict[str, Any] | None
) -> list[Finding]:
    # Megatron-DeepSpeed's pretrain_gpt.py, model_provider: `if args.deepspeed and not
    # args.no_pipeline_parallel: model = GPTModelPipe(...)`. Under --deepspeed the model is a
    # DeepSpeed PipelineModule at any pipeline size, pp 1 included, so DeepSpeed's PipelineEngine
    # runs it, and deepspeed/runtime/pipe/engine.py asserts `ZeRO-2 and ZeRO-3 are incompatible
    # with pipeline parallelism`.
    if not flags.get("deepspeed") or flags.get("no_pipeline_parallel"):
        return []
    stage, key = _zero_stage(flags, ds_config)
    pp = flags.get("pipeline_model_parallel_size", 1)
    if stage is None or stage < 2:
        return [
            info(
                "deepspeed",
                f"Megatron-DeepSpeed builds the model as a DeepSpeed PipelineModule (GPTModelPipe) "
                f"under --deepspeed, at pipeline size {pp}; --no-pipeline-parallel would build "
                "the plain GPTModel",
            )
        ]
    return [
        error(
            key,
            f"ZeRO stage {stage} under --deepspeed without --no-pipeline-parallel: "
            "Megatron-DeepSpeed builds a DeepSpeed PipelineModule even at pipeline size "
            f"{pp}, and DeepSpeed's PipelineEngine asserts `ZeRO-2 and ZeRO-3 are incompatible "
            "with pipeline parallelism`",
            "add --no-pipeline-parallel (with --pipeline-model-parallel-size 1) to run ZeRO-2/3, "
            "or use --zero-stage 1",
        )
    ]


def _external_ds_config(flags: dict[str, Any], ds_config: dict[str, Any] | None) -> list[Finding]:
    path = flags.get("deepspeed_config")
    if ds_config is not None or not isinstance(path, str):
        return []
    return [
        info(
            "deepspeed_config",
            f"the DeepSpeed config {path} is a separate file, which this check does not read "
            "(batch sizes, precision and ZeRO settings in it are not checked)",
            f"check it too: dstrain check {path} --world-size N",
        )
    ]
