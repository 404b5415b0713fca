"""DeepSpeed/Megatron import: the configuration guide's examples, real-world fixtures, mapping."""

import json

import pytest
import yaml

from dstrain.interop.load import load_any
from dstrain.preflight.preflight import preflight


def _by_key(findings, severity=None):
    return {f.key: f for f in findings if severity is None or f.severity == severity}


def test_guide_example_at_2048_gpus(shared, cli):
    result = cli(
        "check", shared / "examples/ds_config_guide.json", "--world-size", "2048", "--json"
    )
    assert result.code == 1
    found = {(f["severity"], f["key"]): f for f in result.json()}
    # ZeRO-3 cannot run under pipeline parallelism; the finding names the user's own key.
    assert ("error", "zero_optimization.stage") in found
    # fp16 where bf16 exists.
    assert ("warning", "fp16.enabled (train.precision)") in found
    # The micro batch was inferred: 2048 / (8 x dp 64) = 4.
    inferred = found[("info", "train.micro_batch_size")]["message"]
    assert "micro_batch_size = 4" in inferred and "dp 64" in inferred
    layout = found[("info", "parallel")]["message"]
    assert "pp8 x dp_shard64 x tp4 = 2048 ranks" in layout and "ep8" in layout


def test_guide_example_with_a_model_checks_the_split(shared, cli):
    result = cli(
        "check",
        shared / "examples/ds_config_guide.json",
        "--world-size",
        "2048",
        "--set",
        "model.flavor=deepseek-v3",
        "--json",
    )
    keys = {f["key"] for f in result.json() if f["severity"] == "error"}
    assert "pipeline_model_parallel_size (parallel.pp)" in keys  # 61 layers over 8 stages


def test_guide_example_maps_every_key(shared):
    loaded = load_any(shared / "examples/ds_config_guide.json")
    c = loaded.config
    assert loaded.source == "deepspeed"
    assert (c.parallel.pp, c.parallel.tp, c.parallel.ep) == (8, 4, 8)
    assert c.parallel.zero_stage == 3 and c.parallel.offload_optimizer
    assert c.train.global_batch_size == 2048 and c.train.grad_accum_steps == 8
    assert c.train.precision == "fp16" and c.train.loss_scale.loss_scale_window == 1000
    assert c.optim.name == "adamw" and c.optim.lr == 6e-5 and c.optim.betas == (0.9, 0.95)
    assert c.optim.weight_decay == 0.1
    assert c.metrics.log_interval == 10 and c.metrics.timers is True
    raw_keys = set(json.loads((shared / "examples/ds_config_guide.json").read_text()))
    reported = {f.key.split(".")[0] for f in loaded.findings}
    mapped = {
        "train_batch_size",
        "gradient_accumulation_steps",
        "optimizer",
        "fp16",
        "zero_optimization",
        "pipeline_model_parallel_size",
        "tensor_model_parallel_size",
        "expert_model_parallel_size",
        "steps_per_print",
        "wall_clock_breakdown",
    }
    assert raw_keys <= mapped | reported


def test_guide_fragments(shared, tmp_path):
    fragments = json.loads((shared / "examples/ds_fragments_guide.json").read_text())
    results = []
    for i, fragment in enumerate(fragments):
        path = tmp_path / f"fragment{i}.json"
        path.write_text(json.dumps(fragment))
        results.append(preflight(load_any(path), None))
    first, second, third = (_by_key(r, "error") for r in results)
    # 1: a micro batch with Megatron's global batch is fine; `data_loader_type` is no DeepSpeed
    # key, and DeepSpeed ignores unknown top-level keys: a warning, not an error.
    assert first == {} and "data_loader_type" in _by_key(results[0], "warning")
    second = _by_key(results[1], "warning")
    assert load_any(tmp_path / "fragment0.json").config.train.micro_batch_size == 4
    # 2: the virtual-pipeline key is misspelt.
    assert (
        "did you mean `num_layers_per_virtual_pipeline_stage`"
        in second["num_layers_per_virtual_pipeline"].message
    )
    # 3: offload_params -> offload_param.
    assert "did you mean `offload_param`" in third["zero_optimization.offload_params"].message


@pytest.fixture(autouse=True)
def _offline_rules(monkeypatch):
    monkeypatch.setenv("DSTRAIN_DEEPSPEED_ENGINE", "0")  # the installed engine judges elsewhere


def _fixture_cases(shared_dir):
    expect = yaml.safe_load((shared_dir / "fixtures/deepspeed/mistakes/expect.yaml").read_text())
    return expect


# Where dstrain deliberately disagrees with expect.yaml: the file alone cannot decide, so the
# mistake is a warning that names it (exit 0), not an error. 09's shape (`auto` batch sizes, no
# gradient_accumulation_steps) fails only when the HF Trainer accumulates; the same shape trained
# in DeepSpeed#3654 (tests/fixtures/deepspeed/valid/08_...), and a false error there is worse.
CONDITIONAL = {"09_batch_mismatch_no_grad_acc_codealpaca14.json": "gradient_accumulation_steps"}
# A missing comma at a line end: DeepSpeed's loader reads the file with hjson and starts (through
# --deepspeed_config), so check reads it too and warns, naming the line, instead of exit 2.
HJSON = {
    "07_invalid_json_missing_comma_dsexamples_pr954.json": (0,),
    "13_missing_comma_onebitadam_gptneox_pr78.json": (1,),
}


def test_mistake_fixtures_are_caught(shared, cli):
    expect = _fixture_cases(shared)
    assert expect, "expect.yaml is empty"
    for name, rule in expect.items():
        args = ["check", shared / "fixtures/deepspeed/mistakes" / name]
        if "world_size" in rule:
            args += ["--world-size", str(rule["world_size"])]
        result = cli(*args)
        if name in CONDITIONAL:
            found = {(f["severity"], f["key"]) for f in cli(*args, "--json").json()}
            assert result.code == 0 and ("warning", CONDITIONAL[name]) in found, result.text
            continue
        assert result.code in HJSON.get(name, rule["exit"]), (name, result.code, result.text)
        text = result.text.lower()
        assert any(word.lower() in text for word in rule["mention"]), (name, result.text)
        assert "traceback" not in text


@pytest.mark.parametrize("name", ["08_onebitadam_lr1e-8_dsexamples_pr63.json"])
def test_tiny_learning_rate_is_flagged(shared, name):
    findings = preflight(load_any(shared / "fixtures/deepspeed/mistakes" / name), None)
    assert "optimizer.params.lr (optim.lr)" in _by_key(findings, "warning")


def test_hard_coded_fp16_in_an_auto_config_is_flagged(shared):
    path = shared / "fixtures/deepspeed/mistakes/17_fp16_hardcoded_vs_bf16_medicalgpt288.json"
    findings = _by_key(preflight(load_any(path), None), "warning")
    assert "`auto`" in findings["fp16.enabled"].message


# Shared valid configs that ran on an older DeepSpeed than the newest: judged by its rules.
OLDER_RELEASE = {"03_dsexamples_bert_onebitadam_bsz4k_nccl.json": "0.18.9"}  # 1-bit Adam


def test_valid_fixtures_pass_and_convert(shared, cli, tmp_path, monkeypatch):
    files = sorted((shared / "fixtures/deepspeed/valid").glob("*.json"))
    assert len(files) >= 10
    monkeypatch.setenv("DSTRAIN_DEEPSPEED_ENGINE", "0")  # the offline rules of each release
    for path in files:
        monkeypatch.setenv("DSTRAIN_DEEPSPEED_RELEASE", OLDER_RELEASE.get(path.name, "0.19.8"))
        result = cli("check", path)
        assert result.code == 0, (path.name, result.text)
        out = tmp_path / f"{path.stem}.toml"
        converted = cli("convert", path, "-o", out)
        assert converted.code == 0, (path.name, converted.text)
        assert load_any(out).findings == [], path.name


def test_convert_writes_a_config_that_loads_back(shared, cli, tmp_path):
    out = tmp_path / "run.toml"
    source = shared / "fixtures/deepspeed/valid/02_dsexamples_bingbertsquad_bsz24.json"
    result = cli("convert", source, "-o", out)
    assert result.code == 0, result.text
    loaded = load_any(out)
    assert loaded.findings == []
    c = loaded.config
    assert (c.train.global_batch_size, c.train.micro_batch_size) == (24, 3)
    assert c.train.precision == "fp16" and c.train.grad_clip == 1.0 and c.optim.lr == 3e-5
    assert "bias_correction" in out.read_text()  # reported as a comment, not dropped


def test_convert_refuses_to_write_on_errors(shared, cli, tmp_path):
    out = tmp_path / "run.toml"
    source = shared / "fixtures/deepspeed/mistakes/03_persitence_typo_dsexamples_pr200.json"
    result = cli("convert", source, "-o", out)
    assert result.code == 1
    assert not out.exists()
    assert "stage3_param_persistence_threshold" in result.text


def test_megatron_keys_beside_deepspeed(tmp_path):
    path = tmp_path / "mixed.json"
    path.write_text(
        json.dumps(
            {
                "train_micro_batch_size_per_gpu": 2,
                "tensor_model_parallel_size": 2,
                "pipeline_model_parallel_size": 2,
                "expert-model-parallel-size": 4,
                "num_layers": 8,
                "hidden_size": 256,
                "num_attention_heads": 8,
                "seq_length": 512,
                "max_position_embeddings": 1024,
                "lr": 3e-4,
                "min_lr": 3e-5,
                "bf16": True,
                "use_distributed_optimizer": True,
                "num_layers_per_virtual_pipeline_stage": 2,
                "global_batch_size": 64,
                "num_experts": 8,
            }
        )
    )
    loaded = load_any(path)
    c = loaded.config
    assert (c.parallel.tp, c.parallel.pp, c.parallel.ep) == (2, 2, 4)
    assert c.model.num_layers == 8 and c.model.dim == 256 and loaded.model_given
    assert c.train.seq_len == 512 and c.train.precision == "bf16"
    assert c.optim.lr == 3e-4 and abs(c.lr.min_lr_ratio - 0.1) < 1e-12
    assert c.parallel.zero_stage == 1 and c.parallel.pp_schedule == "interleaved-1f1b"
    findings = preflight(loaded, 16)
    assert loaded.config.parallel.num_virtual_stages == 2  # 8 layers / (pp 2 x 2)
    assert _by_key(findings, "error") == {}, findings


def test_deepspeed_zero_with_pipeline_and_onebit(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(
        json.dumps(
            {
                "train_batch_size": 32,
                "pipeline": {"stages": 2},
                "zero_optimization": {"stage": 2},
                "optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-4, "freeze_step": 10}},
            }
        )
    )
    found = _by_key(preflight(load_any(path), 4), "error")
    assert "PipelineEngine" in found["zero_optimization.stage"].message  # DeepSpeed-only limit
    assert "pipeline.stages (parallel.pp)" not in found
    assert "OneBitAdam" in found["optimizer.type"].message


def test_both_half_precisions_on(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(
        json.dumps({"train_batch_size": 8, "fp16": {"enabled": True}, "bf16": {"enabled": True}})
    )
    assert "fp16.enabled" in _by_key(preflight(load_any(path), 1), "error")


def test_legacy_offload_keys_map_with_a_warning(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(
        json.dumps(
            {
                "train_batch_size": 8,
                "zero_optimization": {"stage": 3, "cpu_offload": True, "cpu_offload_params": True},
            }
        )
    )
    loaded = load_any(path)
    assert loaded.config.parallel.offload_optimizer and loaded.config.parallel.offload_params
    assert "zero_optimization.cpu_offload" in _by_key(loaded.findings, "warning")
