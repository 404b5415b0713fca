"""The engine rules of `dstrain check` on configs written here: what DeepSpeed, Megatron-LM and
Megatron-DeepSpeed themselves refuse or infer (docs/check.md lists them with their sources), and
the second question, what only dstrain cannot run."""

import json

import pytest

from dstrain.config.validate import raise_if_errors
from dstrain.errors import UserError
from dstrain.interop.load import load_any
from dstrain.preflight.preflight import preflight

LAUNCH = (
    "torchrun --nproc_per_node 8 --nnodes 1 pretrain_gpt.py --num-layers 24 --hidden-size 1024 "
    "--num-attention-heads 16 --max-position-embeddings 2048 --seq-length 2048 "
    "--micro-batch-size 1 --global-batch-size 32 --bf16 "
)


def _script(tmp_path, flags: str, name: str = "run.sh"):
    path = tmp_path / name
    path.write_text(f"#!/bin/bash\n{LAUNCH}{flags}\n")
    return path


def _levels(findings) -> dict:
    return {(f.severity, f.key.split(" (")[0]) for f in findings}


def _check(tmp_path, flags: str):
    loaded = load_any(_script(tmp_path, flags))
    return loaded, preflight(loaded, None)


def test_megatron_deepspeed_runs_a_pipeline_engine_even_at_pp1(tmp_path):
    loaded, findings = _check(tmp_path, "--deepspeed --deepspeed_config ds.json --zero-stage 3")
    assert loaded.engine == "Megatron-DeepSpeed"
    error = next(f for f in findings if f.severity == "error")
    assert "--no-pipeline-parallel" in error.fix and "pipeline size 1" in error.message
    _, fine = _check(
        tmp_path, "--deepspeed --deepspeed_config ds.json --zero-stage 3 --no-pipeline-parallel"
    )
    assert not [f for f in fine if f.severity == "error"]
    assert any("ds.json is a separate file" in f.message for f in fine)  # named, not read


def test_megatron_deepspeed_refuses_no_pipeline_parallel_with_stages(tmp_path):
    _, findings = _check(
        tmp_path, "--deepspeed --no-pipeline-parallel --pipeline-model-parallel-size 2"
    )
    assert ("error", "--no-pipeline-parallel") in _levels(findings)


def test_a_virtual_pipeline_size_implies_the_interleaved_schedule(tmp_path):
    loaded, findings = _check(
        tmp_path, "--pipeline-model-parallel-size 4 --virtual-pipeline-model-parallel-size 2"
    )
    p = loaded.config.parallel
    assert (p.pp_schedule, p.num_virtual_stages) == ("interleaved-1f1b", 2)
    assert not [f for f in preflight(loaded, 8) if f.severity == "error"]


def test_uneven_end_stages_become_trims(tmp_path):
    loaded, _ = _check(
        tmp_path,
        "--pipeline-model-parallel-size 4 "
        "--decoder-first-pipeline-num-layers 3 --decoder-last-pipeline-num-layers 3",
    )
    p = loaded.config.parallel  # 24 - 6 = 18 over 2 middle stages: 9 each, the ends 6 fewer
    assert (p.pp_first_stage_less_layers, p.pp_last_stage_less_layers) == (6, 6)
    _, bad = _check(
        tmp_path, "--pipeline-model-parallel-size 4 --decoder-first-pipeline-num-layers 5"
    )
    assert ("error", "decoder_first_pipeline_num_layers") in _levels(bad)  # 19 over 3 stages


@pytest.mark.parametrize(
    ("flags", "key"),
    [
        ("--fp16", "fp16"),  # beside the launch's --bf16
        ("--checkpoint-activations", "--checkpoint-activations"),
        ("--batch-size 4", "--batch-size"),
        ("--recompute-granularity selective --recompute-method uniform", "--recompute-method"),
        ("--tp-comm-overlap", "--tp-comm-overlap"),
        ("--overlap-param-gather --overlap-grad-reduce", "--overlap-param-gather"),
    ],
    ids=[
        "fp16-and-bf16",
        "checkpoint-activations",
        "batch-size",
        "selective-method",
        "tp-overlap-without-sp",
        "param-gather-without-dist-opt",
    ],
)
def test_what_megatron_lm_refuses(tmp_path, flags, key):
    _, findings = _check(tmp_path, flags)
    assert ("error", key) in _levels(findings), findings


def test_megatron_deepspeed_keeps_checkpoint_activations(tmp_path):
    _, findings = _check(tmp_path, "--deepspeed --no-pipeline-parallel --checkpoint-activations")
    assert ("error", "--checkpoint-activations") not in _levels(findings)


def test_the_deepspeed_json_and_the_flags_disagree(tmp_path):
    path = tmp_path / "run.sh"
    path.write_text(
        "#!/bin/bash\ncat <<EOT > ds.json\n"
        '{"train_batch_size": 64, "train_micro_batch_size_per_gpu": 1, '
        '"gradient_accumulation_steps": "auto", "zero_optimization": {"stage": 1}}\nEOT\n'
        f"{LAUNCH}--deepspeed --deepspeed_config ds.json\n"
    )
    levels = _levels(preflight(load_any(path), None))
    assert ("warning", "train_batch_size") in levels  # 64 in the JSON, 32 in the flags
    assert ("error", "gradient_accumulation_steps") in levels  # "auto" is not filled there


def test_an_ms_swift_launch_reads_booleans_as_values(tmp_path):
    path = tmp_path / "sft.sh"
    path.write_text(
        "NPROC_PER_NODE=8 \\\nmegatron sft --model Qwen/Qwen3-8B --tensor_model_parallel_size 2 "
        "--sequence_parallel true --use_distributed_optimizer true --micro_batch_size 1 "
        "--global_batch_size 16 --overlap_param_gather true --moe_grouped_gemm true\n"
    )
    loaded = load_any(path)
    assert loaded.engine == "ms-swift" and loaded.config.parallel.sequence_parallel is True
    assert (loaded.config.cluster.nodes, loaded.config.cluster.gpus_per_node) == (1, 8)
    findings = preflight(loaded, None)
    # Its precision and distributed optimizer are ms-swift's own defaults: not guessed at.
    assert not [f for f in findings if f.severity == "error"], findings


def test_kv_heads_that_divide_tp_run_in_megatron_not_in_dstrain(tmp_path):
    loaded, _ = _check(
        tmp_path, "--tensor-model-parallel-size 8 --group-query-attention --num-query-groups 4"
    )
    findings = preflight(loaded, 8)
    assert ("unsupported", "num_query_groups") in _levels(findings)
    assert not [f for f in findings if f.severity == "error"]
    with pytest.raises(UserError):  # dstrain train refuses what it cannot run
        raise_if_errors(findings)


def test_check_for_dstrain_exits_3_on_what_only_dstrain_cannot_run(cli, tmp_path):
    # fewer key/value heads than tp ranks: Megatron-LM replicates them, dstrain's trainer not
    path = _script(
        tmp_path, "--tensor-model-parallel-size 8 --group-query-attention --num-query-groups 4"
    )
    assert cli("check", path).code == 0
    result = cli("check", path, "--for", "dstrain", "--json")
    assert result.code == 3
    found = next(f for f in result.json() if f["severity"] == "unsupported")
    assert found["message"].startswith("runs under Megatron-LM; dstrain cannot yet"), found
    # context parallelism with PP: both run it
    both = _script(tmp_path, "--context-parallel-size 2 --pipeline-model-parallel-size 2")
    assert cli("check", both, "--for", "dstrain").code == 0


# As DeepSpeed 0.19.8 (the release the offline rules model by default) judges each value: its
# fp16/bf16 sections are strict models since 0.17.3, coercing "false" and refusing unknown keys.
@pytest.mark.parametrize(
    ("config", "level", "key"),
    [
        ({"train_batch_size": 8, "cpu_offload": True}, "warning", "cpu_offload"),
        ({"train_batch_size": 8, "fp16": {"enabled": "false"}}, "warning", "fp16.enabled"),
        ({"train_batch_size": 8, "fp16": {"enabled": "true"}}, "warning", "fp16.enabled"),
        (
            {"train_batch_size": 8, "fp16": {"enabled": True, "opt_level": "O2"}},
            "error",
            "fp16.opt_level",
        ),
        ({"train_batch_size": 8, "wall_clock_breakdown": "false"}, "error", "wall_clock_breakdown"),
        (
            {
                "train_batch_size": 8,
                "zero_optimization": {
                    "stage": 3,
                    "reduce_scatter": False,
                    "zero_quantized_gradients": True,
                },
            },
            "error",
            "zero_optimization.zero_quantized_gradients",
        ),
        (
            {
                "train_batch_size": 8,
                "optimizer": {"type": "AdamW"},
                "zero_optimization": {
                    "stage": 3,
                    "offload_optimizer": {"device": "nvme", "ratio": 0.3},
                },
            },
            "error",
            "zero_optimization.offload_optimizer.ratio",
        ),
        (
            {
                "train_batch_size": "auto",
                "train_micro_batch_size_per_gpu": "auto",
                "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
            },
            "warning",
            "zero_optimization.offload_optimizer",
        ),
        (
            {
                "train_batch_size": 8,
                "zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}},
            },
            "warning",
            "zero_optimization.offload_param",
        ),
    ],
    ids=[
        "top-level-misplaced",
        "string-false",
        "string-true",
        "fp16-opt-level",
        "top-level-string-false",
        "zeropp-reduce-scatter",
        "partial-offload-nvme",
        "offload-client-optimizer",
        "offload-param-stage2",
    ],
)
def test_what_deepspeed_does_with_a_value(tmp_path, config, level, key):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    findings = preflight(load_any(path), 8)
    assert (level, key) in _levels(findings), findings
    if level != "error":
        assert not [f for f in findings if f.severity == "error"], findings


def test_a_misspelt_megatron_flag_is_named_with_the_one_meant(tmp_path):
    _, findings = _check(tmp_path, "--tensor-model-paralel-size 2 --no-bias-swiglu-fusion")
    warned = {f.key: f for f in findings if f.severity == "warning"}
    assert (
        "did you mean --tensor-model-parallel-size?"
        in warned["--tensor-model-paralel-size"].message
    )
    assert "--no-bias-swiglu-fusion" not in warned  # a store_false flag, not a typo
