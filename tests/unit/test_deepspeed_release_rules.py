"""The offline DeepSpeed rules of issue 33: one named release, and the classes the differential
run found (benchmarks/deepspeed_differential.py measures them against DeepSpeed itself)."""

import json

import pytest

from dstrain.interop.ds_keys import RELEASE_ENV
from dstrain.interop.ds_verdict import ENGINE_ENV
from dstrain.interop.load import detect_source, load_any

BATCH = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1}


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv(ENGINE_ENV, "0")


def _findings(tmp_path, config: dict, release: str | None = None, monkeypatch=None):
    if release:
        monkeypatch.setenv(RELEASE_ENV, release)
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config))
    return {(f.severity, f.key): f for f in load_any(path).findings}


def _errors(found) -> set[str]:
    return {key for severity, key in found if severity == "error"}


def test_a_checkpoint_section_does_not_make_it_a_dstrain_config():
    assert detect_source({**BATCH, "checkpoint": {"tag_validation": "Warn"}}) == "deepspeed"
    assert detect_source({"checkpoint": {"interval": 100}, "train": {"steps": 10}}) == "dstrain"


def test_the_release_judged_is_named(tmp_path, monkeypatch):
    found = _findings(tmp_path, BATCH)
    assert "0.19.8" in found["info", "deepspeed release"].message
    found = _findings(tmp_path, BATCH, "0.16.9", monkeypatch)
    assert "0.16.9" in found["info", "deepspeed release"].message


def test_numbers_as_strings_in_pydantic_sections_are_coerced(tmp_path):
    zero = {"stage": "2", "reduce_bucket_size": "500000000", "overlap_comm": "false"}
    found = _findings(
        tmp_path,
        {
            **BATCH,
            "zero_optimization": zero,
            "fp16": {"enabled": True, "initial_scale_power": "16"},
        },
    )
    assert not _errors(found), found
    assert ("warning", "zero_optimization.reduce_bucket_size") in found
    # pydantic cannot read "5e8" as an int, nor "maybe" as a bool: DeepSpeed refuses them
    found = _findings(
        tmp_path,
        {
            **BATCH,
            "zero_optimization": {"stage": 2, "reduce_bucket_size": "5e8", "overlap_comm": "maybe"},
        },
    )
    assert {"zero_optimization.reduce_bucket_size", "zero_optimization.overlap_comm"} <= _errors(
        found
    )


def test_string_booleans_and_bf16_keys_follow_one_release(tmp_path, monkeypatch):
    config = {**BATCH, "fp16": {"enabled": "false"}, "bf16": {"enabled": True, "loss_scale": 0}}
    newest = _findings(tmp_path, config)
    assert ("warning", "fp16.enabled") in newest  # pydantic reads "false" as false
    assert "bf16.loss_scale" in _errors(newest)  # extra="forbid"
    old = _findings(tmp_path, config, "0.16.9", monkeypatch)
    assert "fp16.enabled" in _errors(old)  # dict.get: a non-empty string is on
    assert ("warning", "bf16.loss_scale") in old  # dict.get ignores it


@pytest.mark.parametrize("device", ["gpu", "CPU", "disk"])
def test_an_offload_device_deepspeed_lacks(tmp_path, device):
    zero = {"stage": 3, "offload_param": {"device": device}}
    assert "zero_optimization.offload_param.device" in _errors(
        _findings(tmp_path, {**BATCH, "zero_optimization": zero})
    )


def test_nvme_offload_without_a_path(tmp_path):
    zero = {"stage": 3, "offload_optimizer": {"device": "nvme"}}
    found = _findings(tmp_path, {**BATCH, "zero_optimization": zero})
    assert "zero_optimization.offload_optimizer.nvme_path" in _errors(found)
    zero["offload_optimizer"]["nvme_path"] = "/local_nvme"
    assert not _errors(_findings(tmp_path, {**BATCH, "zero_optimization": zero}))


@pytest.mark.parametrize(
    "key", ["amp", "curriculum_learning", "elasticity", "sparse_attention", "eigenvalue"]
)
def test_removed_features_by_release(tmp_path, monkeypatch, key):
    config = {**BATCH, key: {"enabled": False}}
    assert key in _errors(_findings(tmp_path, config))
    assert key not in _errors(_findings(tmp_path, config, "0.18.9", monkeypatch))


def test_one_bit_adam_is_gone_in_the_newest_release(tmp_path, monkeypatch):
    config = {**BATCH, "optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-4}}}
    assert "optimizer.type" in _errors(_findings(tmp_path, config))
    assert "optimizer.type" not in _errors(_findings(tmp_path, config, "0.18.9", monkeypatch))


def test_lamb_with_a_static_loss_scale(tmp_path):
    config = {**BATCH, "optimizer": {"type": "Lamb", "params": {"lr": 1e-3}}}
    assert "fp16.loss_scale" in _errors(
        _findings(tmp_path, {**config, "fp16": {"enabled": True, "loss_scale": 128}})
    )
    assert not _errors(_findings(tmp_path, {**config, "fp16": {"enabled": True, "loss_scale": 0}}))


def test_no_batch_keys_in_a_file_for_the_hf_trainer(tmp_path):
    found = _findings(tmp_path, {"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}})
    assert "train_batch_size" in _errors(found)
    found = _findings(tmp_path, {"zero_optimization": {"stage": 2}})  # Lightning fills it
    assert ("warning", "train_batch_size") in found


def test_the_cli_picks_the_release_and_refuses_a_bad_one(cli, tmp_path, monkeypatch):
    monkeypatch.delenv(RELEASE_ENV, raising=False)
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({**BATCH, "amp": {"enabled": True}}))  # removed in 0.19
    newest = cli("check", path, "--json")
    assert newest.code == 1 and "amp" in {f["key"] for f in newest.json()}, newest.text
    older = cli("check", path, "--deepspeed-release", "0.18.9", "--json")
    assert older.code == 0, older.text
    bad = cli("check", path, "--deepspeed-release", "latest")
    assert bad.code == 2 and "is not a version number" in bad.err
    assert "Traceback" not in bad.text


@pytest.mark.parametrize(
    ("key", "value"), [("gradient_clipping", "1.0"), ("steps_per_print", "10")]
)
def test_numbers_as_strings_deepspeed_reads_with_dict_get_fail_once_training_runs(
    tmp_path, key, value
):
    # the loader and initialize accept them; the engine compares or divides by them at step 1
    found = _findings(tmp_path, {**BATCH, key: value})
    assert [sev for sev, k in found if k == key] == ["error"], found
    assert "TypeError once training runs" in found["error", key].message
