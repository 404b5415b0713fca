"""Megatron-Core's own verdict on a launch script beside check's (megatron_verdict.py): its
TransformerConfig refuses what Megatron refuses, and its get_num_layers_to_build puts the same
layers on every pipeline rank and virtual stage as dstrain's reading (megatron_split.py).

Skipped without megatron-core (`pip install megatron-core==0.16.1 -c constraints.txt`; the
test extras install it)."""

import importlib.util
import itertools
from pathlib import Path

import pytest

from dstrain.interop import megatron_split
from dstrain.interop.load import load_any
from dstrain.interop.megatron_verdict import ENGINE_ENV, ENGINE_KEY, engine_verdict

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed"
)
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures/megatron"


@pytest.fixture(autouse=True)
def engine_on(monkeypatch):
    monkeypatch.setenv(ENGINE_ENV, "1")


def _verdicts(path: Path) -> list:
    return [f for f in load_any(path).findings if f.key == ENGINE_KEY]


def test_a_working_uneven_interleaved_split_is_megatrons_own():
    found = _verdicts(FIXTURES / "valid/08_constructed_uneven_physical_stages_with_vpp.sh")
    assert [f.severity for f in found] == ["info", "info"], found
    assert "accepts it" in found[0].message
    assert "[3, 5, 5, 3, 3, 5, 5, 3] layers on its 8 pipeline stages, as dstrain reads" in (
        found[1].message
    )


def test_megatron_refuses_a_first_stage_the_virtual_size_does_not_divide():
    found = _verdicts(
        FIXTURES / "broken/04_constructed_mr2795_dsv3_last_stage_not_divisible_by_vpp.sh"
    )
    assert [f.severity for f in found] == ["error"], found
    assert "must be divisible by virtual pipeline" in found[0].message
    assert "stand-ins" in found[0].message  # the script gives only part of the architecture


def test_a_moe_baseline_script_is_accepted_with_its_store_false_flags():
    # --disable-bias-linear (argparse dest add_bias_linear=False): without it Megatron-Core
    # refuses `Bias in Moe is only supported when ETP==1` at tp 2.
    found = _verdicts(FIXTURES / "valid/04_megatronlm1523_tp2_pp2_cp2_ep2_moe_baseline.sh")
    assert [f.severity for f in found] == ["info", "info"], found
    assert "[4, 4] layers" in found[1].message


def test_no_verdict_for_deepspeed_scripts_or_with_the_engine_off(monkeypatch):
    flags = {"num_layers": 8, "pipeline_model_parallel_size": 2}
    assert engine_verdict("Megatron-DeepSpeed", flags) == []
    assert engine_verdict("Megatron-LM", {"pipeline_model_parallel_size": 2}) == []
    monkeypatch.setenv(ENGINE_ENV, "0")
    assert engine_verdict("Megatron-LM", flags) == []


SPLITS = [
    {},
    {"num_virtual_stages_per_pipeline_rank": 2},
    {"num_layers_per_virtual_pipeline_stage": 1},
    {"account_for_embedding_in_pipeline_split": True},
    {"account_for_loss_in_pipeline_split": True},
    {"account_for_embedding_in_pipeline_split": True, "account_for_loss_in_pipeline_split": True},
    {"decoder_first_pipeline_num_layers": 1},
    {"decoder_last_pipeline_num_layers": 2},
    {"decoder_first_pipeline_num_layers": 2, "num_virtual_stages_per_pipeline_rank": 2},
]


@pytest.mark.parametrize("split", SPLITS, ids=lambda s: ",".join(s) or "even")
def test_dstrains_split_is_megatron_cores_on_every_layout(split):
    """Every (layers, pp) up to 12 x 4 under each way of shaping the split: where dstrain's
    reading gives a split, Megatron-Core's own agrees stage for stage; where dstrain's refuses,
    Megatron-Core refuses too (or validate_args, not in megatron-core, would)."""
    compared = refused = 0
    for layers, pp in itertools.product(range(2, 13), range(2, 5)):
        flags = {"num_layers": layers, "pipeline_model_parallel_size": pp, **split}
        ours, _, found = megatron_split.pipeline_split(layers, pp, flags)
        verdict = engine_verdict("Megatron-LM", flags)
        if ours is None:
            refused += 1
            assert found, (layers, pp)
            assert not verdict or verdict[0].severity == "error", (layers, pp, verdict)
            continue
        assert [f.severity for f in verdict] == ["info", "info"], (layers, pp, ours, verdict)
        assert f"puts {ours} layers" in verdict[1].message, (layers, pp, verdict[1].message)
        compared += 1
    assert compared >= 5 and refused >= 1, (compared, refused)
