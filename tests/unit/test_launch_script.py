"""Megatron/DeepSpeed launch scripts (bash, Slurm) read as configs."""

from pathlib import Path

from dstrain.config.launch_script import read_launch_script
from dstrain.config.load import load_config
from dstrain.config.preflight import preflight

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
    loaded = load_config(SCRIPT)
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
    findings = preflight(load_config(script), 8)
    assert any(f.key == "deepspeed_config" and f.severity == "error" for f in findings)
