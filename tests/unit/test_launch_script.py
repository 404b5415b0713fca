"""Megatron/DeepSpeed launch scripts (bash, Slurm) read as configs."""

from pathlib import Path

from dstrain.interop.launch_script import read_launch_script
from dstrain.interop.load import load_any
from dstrain.preflight.preflight import preflight

SCRIPT = Path(__file__).parent / "data" / "moe_launch.slurm"


def test_variables_heredoc_and_sbatch_are_read():
    facts = read_launch_script(SCRIPT.read_text())
    assert (facts.nodes, facts.gpus_per_node, facts.gpu) == (4, 8, "H100")
    assert facts.deepspeed == {
        "train_micro_batch_size_per_gpu": 1,
        "train_batch_size": 256,
        "zero_optimization": {"stage": 1},
        "bf16": {"enabled": True},
        "gradient_clipping": 1.0,
    }
    flags = facts.flags
    assert flags["tensor_model_parallel_size"] == 2 and flags["num_layers"] == 30
    assert flags["train_samples"] == 256_000  # $((GBS * 1000))
    assert flags["bf16"] is True and flags["nnodes"] == 4
    assert "SLURM_JOB_NODELIST" in facts.unresolved


def test_script_maps_to_a_checked_config(cli):
    loaded = load_any(SCRIPT)
    c = loaded.config
    assert loaded.source == "script"
    assert (c.parallel.tp, c.parallel.pp, c.parallel.ep) == (2, 4, 4)
    assert (c.cluster.nodes, c.cluster.gpus_per_node) == (4, 8)
    assert c.model.num_routed_experts == 64 and c.model.attention == "mha"
    assert c.train.steps == 1000 and c.lr.warmup_steps == 20
    assert (c.parallel.pp_first_stage_less_layers, c.parallel.pp_last_stage_less_layers) == (1, 1)
    result = cli("check", SCRIPT, "--json")
    errors = [f for f in result.json() if f["severity"] == "error"]
    assert result.code == 0, errors
    layout = next(f for f in result.json() if f["key"] == "parallel")
    assert "pp4 x dp_shard4 x tp2 = 32 ranks" in layout["message"]


def test_script_with_a_broken_layout_fails(cli, tmp_path):
    broken = tmp_path / "run.sh"
    broken.write_text(SCRIPT.read_text().replace("TP=2", "TP=3"))
    result = cli("check", broken, "--json")
    keys = {f["key"] for f in result.json() if f["severity"] == "error"}
    assert result.code == 1
    assert "parallel.dp_shard" in keys  # 32 GPUs do not divide by tp 3 x pp 4


def test_broken_heredoc_json_is_reported(tmp_path):
    script = tmp_path / "run.sh"
    script.write_text(
        '#!/bin/bash\ncat <<EOT > ds.json\n{"train_batch_size": 8,}\nEOT\n'
        "python pretrain_gpt.py --micro-batch-size 1\n"
    )
    findings = preflight(load_any(script), 8)
    assert any(f.key == "deepspeed_config" and f.severity == "error" for f in findings)


def test_values_from_outside_the_script_are_named_not_guessed(cli, tmp_path):
    script = tmp_path / "run.sh"
    script.write_text(
        "#!/bin/bash\nsource ./env.sh\nGPUS_PER_NODE=$(nvidia-smi -L | wc -l)\n"
        "NNODES=${NNODES:-2}\nTP=$1\n"
        'cat <<EOT > ds.json\n{"train_batch_size": $GBS, "zero_optimization": {"stage": 1}}\nEOT\n'
        "torchrun --nproc_per_node $GPUS_PER_NODE --nnodes $NNODES pretrain_gpt.py "
        "--tensor-model-parallel-size $TP --pipeline-model-parallel-size 2 --num-layers 24 "
        "--micro-batch-size 1 --global-batch-size $GBS --deepspeed --deepspeed_config ds.json\n"
    )
    result = cli("check", script, "--json")
    assert result.code == 0, result.text  # nothing unresolved becomes an error
    notes = " ".join(f["message"] for f in result.json() if f["key"] == "script")
    for named in ("GBS", "$1", "nvidia-smi -L | wc -l", "./env.sh", "NNODES=2"):
        assert named in notes, named
    assert "--tensor-model-parallel-size $arg1" in notes and "train_batch_size $GBS" in notes
    world = next(f for f in result.json() if f["key"] == "parallel")
    assert "world size unknown" in world["message"]  # 2 nodes x an unknown GPU count
    assert load_any(script).config.parallel.pp == 2  # what the script does say is read


def test_a_nemo_launch_reads_its_hydra_overrides(cli, tmp_path):
    script = tmp_path / "nemo.sh"
    script.write_text(
        "python megatron_gpt_pretraining.py --config-path=conf --config-name=megatron_gpt_config "
        "trainer.devices=8 trainer.num_nodes=2 trainer.precision=bf16-mixed "
        "model.tensor_model_parallel_size=4 model.pipeline_model_parallel_size=2 "
        "model.micro_batch_size=1 model.global_batch_size=256 model.encoder_seq_length=4096\n"
    )
    loaded = load_any(script)
    c = loaded.config
    assert loaded.engine == "NeMo"
    assert (c.parallel.tp, c.parallel.pp, c.cluster.nodes, c.cluster.gpus_per_node) == (4, 2, 2, 8)
    assert (c.train.precision, c.train.seq_len, c.train.global_batch_size) == ("bf16", 4096, 256)
    result = cli("check", script, "--json")
    assert result.code == 0 and "judged as NeMo" not in result.text  # JSON only
    assert any("NeMo config" in f["message"] for f in result.json())
