"""What Megatron-LM and Megatron-DeepSpeed themselves refuse or infer from a launch script's
flags, beyond the layout rules dstrain shares with them (`rules.py`): each rule cites the engine
source it models. Flags arrive as Megatron's argparse dests (`tensor_model_parallel_size`).
"""

from typing import Any

from dstrain.config.findings import Finding, error, info


def engine_rules(engine: str, flags: dict[str, Any], ds_config: dict[str, Any] | None) -> list:
    findings: list[Finding] = []
    if engine == "Megatron-DeepSpeed":
        findings += _deepspeed_pipeline_engine(flags, ds_config)
        findings += _external_ds_config(flags, ds_config)
    return findings


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
