"""Megatron's layout rules as Megatron computes them (issue 33, part 4): the per-rank layer split
of Megatron-Core (validate_args, TransformerConfig.__post_init__, get_num_layers_to_build), with
only part of the architecture given, and the engine a script runs picking the rule set."""

import pytest

from dstrain.interop.load import load_any
from dstrain.interop.megatron_split import pipeline_split
from dstrain.preflight.preflight import preflight

TORCHRUN = "torchrun --nproc_per_node 8 pretrain_gpt.py "
MODEL = (
    "--hidden-size 1024 --num-attention-heads 16 --seq-length 2048 --max-position-embeddings 2048 "
)


def _findings(tmp_path, line: str, world: int | None = None):
    path = tmp_path / "run.sh"
    path.write_text(f"#!/bin/bash\n{line}\n")
    loaded = load_any(path)
    return loaded, preflight(loaded, world)


def _levels(findings) -> set:
    return {(f.severity, f.key.split(" (")[0]) for f in findings}


def _errors(findings) -> list:
    return [f for f in findings if f.severity == "error"]


@pytest.mark.parametrize(
    "line",
    [
        TORCHRUN + "--num-layers 24 --pipeline-model-parallel-size 2",
        "python megatron_gpt_pretraining.py model.num_layers=24 trainer.devices=8",
        "NPROC_PER_NODE=8 megatron sft --model Qwen/Qwen3-8B --tensor_model_parallel_size 2",
        TORCHRUN + "--num-layers 24 --deepspeed --deepspeed_config ds.json",  # not read
    ],
    ids=["megatron-lm", "nemo", "ms-swift", "megatron-deepspeed-external-json"],
)
def test_no_deepspeed_rule_fires_without_a_deepspeed_config(tmp_path, line):
    _, findings = _findings(tmp_path, line)
    assert not [f for f in findings if "DeepSpeed refuses" in f.message], findings
    assert "train_batch_size" not in {k for _, k in _levels(findings)}


def test_layers_pp_does_not_divide_are_caught_with_a_partial_architecture(tmp_path):
    _, findings = _findings(tmp_path, TORCHRUN + "--num-layers 30 --pipeline-model-parallel-size 4")
    assert ("error", "pipeline_model_parallel_size") in _levels(findings), findings
    # with the whole architecture it is reported once, not again by dstrain's own layer rule
    _, whole = _findings(
        tmp_path, TORCHRUN + MODEL + "--num-layers 30 --pipeline-model-parallel-size 4", 8
    )
    assert [f.key for f in _errors(whole)] == ["pipeline_model_parallel_size"], whole


def test_first_last_stage_counts_are_physical_ranks_under_a_virtual_size(tmp_path):
    # 32 layers, pp 4: ranks [6, 10, 10, 6]; each splits into 2 chunks (Megatron starts it)
    line = TORCHRUN + "--num-layers 32 --pipeline-model-parallel-size 4 "
    uneven = "--decoder-first-pipeline-num-layers 6 --decoder-last-pipeline-num-layers 6 "
    _, findings = _findings(tmp_path, line + uneven + "--num-virtual-stages-per-pipeline-rank 2")
    assert not _errors(findings), findings
    chunks, vp, _ = pipeline_split(
        32,
        4,
        {
            "decoder_first_pipeline_num_layers": 6,
            "decoder_last_pipeline_num_layers": 6,
            "num_virtual_stages_per_pipeline_rank": 2,
        },
    )
    assert (chunks, vp) == ([3, 5, 5, 3, 3, 5, 5, 3], 2)
    # the virtual size must divide each rank's count: 5 on the first rank does not split in 2
    _, odd = _findings(
        tmp_path,
        line + "--decoder-first-pipeline-num-layers 5 --decoder-last-pipeline-num-layers 7 "
        "--num-virtual-stages-per-pipeline-rank 2",
    )
    assert ("error", "decoder_first_pipeline_num_layers") in _levels(odd), odd
    # ... and each middle rank's: 32 - 6 - 6 = 20 over 2 middle ranks is 10, not a multiple of 3
    _, middle = _findings(
        tmp_path,
        line + uneven + "--num-virtual-stages-per-pipeline-rank 3",
    )
    assert ("error", "num_virtual_stages_per_pipeline_rank") in _levels(middle), middle


@pytest.mark.parametrize(
    ("spelling", "value"),
    [
        ("--num-virtual-stages-per-pipeline-rank", "2"),
        ("--num-layers-per-virtual-pipeline-stage", "3"),
        ("--virtual-pipeline-model-parallel-size", "2"),
    ],
)
def test_every_spelling_of_the_virtual_size_counts_the_embedding(tmp_path, spelling, value):
    # 23 layers + the embedding = 24 over pp 4: 6 per rank, 2 chunks of 3; the first holds 2
    line = TORCHRUN + MODEL + "--num-layers 23 --pipeline-model-parallel-size 4 "
    loaded, findings = _findings(
        tmp_path, line + f"--account-for-embedding-in-pipeline-split {spelling} {value}", 8
    )
    p = loaded.config.parallel
    assert not _errors(findings), findings
    assert (p.num_virtual_stages, p.pp_first_stage_less_layers, p.pp_last_stage_less_layers) == (
        2,
        1,
        0,
    )
    _, without = _findings(tmp_path, line + f"{spelling} {value}")
    assert _errors(without), without  # 23 layers over 4 ranks


def test_account_for_embedding_and_loss_in_pipeline_split(tmp_path):
    line = TORCHRUN + "--num-layers 30 --pipeline-model-parallel-size 4 "
    both = "--account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split"
    loaded, findings = _findings(tmp_path, line + both)
    p = loaded.config.parallel
    assert not _errors(findings), findings  # 32 over 4: first and last build 7
    assert (p.pp_first_stage_less_layers, p.pp_last_stage_less_layers) == (1, 1)
    _, mixed = _findings(
        tmp_path,
        line + "--account-for-loss-in-pipeline-split --decoder-first-pipeline-num-layers 6",
    )
    assert ("error", "decoder_first_pipeline_num_layers") in _levels(mixed), mixed


def test_nemo_names_of_the_uneven_split(tmp_path):
    _, findings = _findings(
        tmp_path,
        "python pretrain.py model.num_layers=32 model.pipeline_model_parallel_size=4 "
        "model.num_layers_in_first_pipeline_stage=5 model.virtual_pipeline_model_parallel_size=2",
    )
    assert ("error", "decoder_first_pipeline_num_layers") in _levels(findings), findings


@pytest.mark.parametrize(
    ("line", "refused"),
    [
        (TORCHRUN + "--num-layers 24 --checkpoint-activations", True),
        ("deepspeed --num_gpus 8 pretrain_gpt.py --num-layers 24 --checkpoint-activations", False),
        (TORCHRUN + "--num-layers 24 --checkpoint-activations $DS_ARGS", False),
        (TORCHRUN + "--num-layers 24 --checkpoint-activations --zero-stage 1", False),
    ],
    ids=["megatron-lm", "deepspeed-launcher", "ds-args-variable", "zero-stage-flag"],
)
def test_checkpoint_activations_is_refused_only_by_megatron_lm(tmp_path, line, refused):
    loaded, findings = _findings(tmp_path, line)
    assert loaded.engine == ("Megatron-LM" if refused else "Megatron-DeepSpeed")
    assert (("error", "--checkpoint-activations") in _levels(findings)) == refused, findings
    # `$DS_ARGS` after a switch is more flags, not the switch's value
    assert loaded.config.train.activation_checkpoint == "full"


@pytest.mark.parametrize(
    "flags",
    ["--fp16 --expert-model-parallel-size 2 --num-experts 8", "--fp16 --moe-grouped-gemm"],
    ids=["ep-fp16", "grouped-gemm-fp16"],
)
def test_asserts_current_megatron_dropped_are_warnings(tmp_path, flags):
    _, findings = _findings(tmp_path, TORCHRUN + "--num-layers 24 " + flags)
    assert not _errors(findings), findings
    assert any("2026" in f.message for f in findings if f.severity == "warning"), findings


def test_full_recompute_needs_a_method_and_a_layer_count(tmp_path):
    line = TORCHRUN + "--num-layers 24 --recompute-granularity full "
    _, findings = _findings(tmp_path, line)
    assert ("error", "--recompute-granularity") in _levels(findings), findings
    _, fine = _findings(tmp_path, line + "--recompute-method uniform --recompute-num-layers 1")
    assert not _errors(fine), fine


def test_interleaving_at_pipeline_size_1_is_refused(tmp_path):
    _, findings = _findings(tmp_path, TORCHRUN + "--num-virtual-stages-per-pipeline-rank 2")
    assert ("error", "--num-virtual-stages-per-pipeline-rank") in _levels(findings), findings


def test_renamed_and_underscored_flags(tmp_path):
    _, findings = _findings(
        tmp_path, TORCHRUN + "--num-layers 24 --use-dist-ckpt --micro_batch_size 1 --bf16"
    )
    levels = _levels(findings)
    assert ("warning", "--use-dist-ckpt") in levels  # now --ckpt-format torch_dist
    assert ("error", "--micro_batch_size") in levels  # argparse knows --micro-batch-size only


def test_a_typo_in_underscore_form_is_named_in_an_ms_swift_launch(tmp_path):
    _, findings = _findings(
        tmp_path,
        "megatron sft --model Qwen/Qwen3-8B --tensor_model_paralel_size 2 --lora_rank 8",
    )
    warned = {f.key: f.message for f in findings if f.severity == "warning"}
    assert "did you mean --tensor-model-parallel-size?" in warned["--tensor-model-paralel-size"]
    assert "--lora-rank" not in warned  # ms-swift's own, not a typo of --q-lora-rank
