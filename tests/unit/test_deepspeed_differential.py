"""DeepSpeed's own verdict beside check's, and a small seeded differential run against it.

Skipped without DeepSpeed (`DS_BUILD_OPS=0 pip install deepspeed==0.19.8 -c constraints.txt`)."""

import importlib.util
import json
from pathlib import Path

import pytest

from dstrain.config.ds_verdict import ENGINE_ENV, ENGINE_KEY, engine_verdict
from dstrain.config.load import load_config

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed is not installed"
)
ROOT = Path(__file__).resolve().parents[2]


def test_the_engine_verdict_is_a_finding_with_its_source(tmp_path, monkeypatch):
    monkeypatch.setenv(ENGINE_ENV, "1")
    path = tmp_path / "ds_config.json"
    path.write_text('{"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2}')
    found = {f.key: f for f in load_config(path).findings}
    assert found[ENGINE_KEY].severity == "info"
    assert "accepts it" in found[ENGINE_KEY].message
    path.write_text('{"train_batch_size": 8, "train_batch_size": 16}')
    found = {f.key: f for f in load_config(path).findings}
    assert found[ENGINE_KEY].severity == "error"
    assert "Duplicate keys" in found[ENGINE_KEY].message


def test_the_engine_fills_auto_as_the_hf_trainer_does(monkeypatch):
    monkeypatch.setenv(ENGINE_ENV, "1")
    raw = {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "fp16": {"enabled": "auto"},
    }
    assert engine_verdict(raw)[0].severity == "info"
    assert (
        engine_verdict(
            {**raw, "zero_optimization": {"stage": 3, "offload_param": {"device": "gpu"}}}
        )[0].severity
        == "error"
    )


def test_a_seeded_differential_sample_meets_the_bounds(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import deepspeed_differential as diff

    verdicts = [diff.judge(c, tmp_path) for c in diff.cases(7, 3)]
    report = diff.summarize(verdicts)
    starts, refuses = report["engine_starts"], report["engine_refuses"]
    assert report["tracebacks"] == [], json.dumps(report, indent=1)
    assert len(report["misses_without_a_finding"]) <= 0.10 * refuses, report
    # Target 2 %; the known remainder: steps_per_print / gradient_clipping written as strings,
    # which DeepSpeed's loader takes and its training step does not (check refuses them).
    assert len(report["false_errors"]) <= 0.05 * starts, report
