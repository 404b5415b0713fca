"""Resharding resume: a checkpoint written under one layout resumes under another, and the steps
after it have the losses of the uninterrupted one-process run.

The run of the parity matrix (8 steps); the first 4 are trained and checkpointed under
dp_shard2 x ep2 (FSDP), pp2 (with the MTP copy of the embedding), tp2 + SP and dp_shard2 ZeRO-1.
Copies of those run directories then resume to step 8 under tp2, pp2, dp_shard2 x ep2 (ZeRO-1
and -2), dp_shard2 ZeRO-2, dp_shard4 (ZeRO-3), pp2 x dp2 (ZeRO-1 and -2) and one process: dp,
tp, ep, pp and the ZeRO stage all change. The data position is a global sample count, so it
continues exactly when dp changes (2 -> 4, 2 -> 1): a wrong position would change every later
loss.
"""

import json
import shutil

import pytest

from dstrain.config.load import load_config
from dstrain.train.trainer import Trainer
from tests.distributed.harness import run_ranks
from tests.distributed.test_parity_matrix import (  # noqa: F401 (fixtures)
    NO_MTP,
    _losses,
    cp_reference,
    setup,
)

pytestmark = pytest.mark.slow

SAVE_AT = 4
RTOL = 1e-6  # the parity matrix's LOSS_RTOL; measured up to 6.4e-8 (printed)
SAVED = {
    "save_ep2": ["parallel.dp_shard=2", "parallel.ep=2", "parallel.zero_stage=2"],
    "save_pp2": ["parallel.pp=2"],
    "save_tp2": ["parallel.tp=2", "parallel.sequence_parallel=true"],
    "save_zero1": ["parallel.dp_shard=2", "parallel.zero_stage=1"],
}
LAYOUTS = {
    "tp2": ["parallel.tp=2"],
    "pp2": ["parallel.pp=2"],
    "ep2": ["parallel.dp_shard=2", "parallel.ep=2", "parallel.zero_stage=2"],
    "dp4_zero3": ["parallel.dp_shard=4", "parallel.zero_stage=3"],
    "pp2_dp2": ["parallel.pp=2", "parallel.dp_shard=2"],
    "dp2_zero2": ["parallel.dp_shard=2", "parallel.zero_stage=2"],
    "ep2_zero1": ["parallel.dp_shard=2", "parallel.ep=2", "parallel.zero_stage=1"],
    "pp2_dp2_zero1": ["parallel.pp=2", "parallel.dp_shard=2", "parallel.zero_stage=1"],
    "dp2_zero1": ["parallel.dp_shard=2", "parallel.zero_stage=1"],
}
TWO_RANKS = {"ep2_to_tp2": ("save_ep2", "tp2"), "ep2_to_pp2": ("save_ep2", "pp2")}
TWO_RANKS |= {"pp2_to_ep2": ("save_pp2", "ep2"), "tp2_to_pp2": ("save_tp2", "pp2")}
TWO_RANKS |= {"zero1_to_zero2": ("save_zero1", "dp2_zero2"), "zero1_to_pp2": ("save_zero1", "pp2")}
TWO_RANKS |= {
    "tp2_to_zero1_ep2": ("save_tp2", "ep2_zero1"),
    "pp2_to_zero1": ("save_pp2", "dp2_zero1"),
}
FOUR_RANKS = {"ep2_to_dp4": ("save_ep2", "dp4_zero3"), "pp2_to_pp2dp2": ("save_pp2", "pp2_dp2")}
FOUR_RANKS |= {"zero1_to_dp4": ("save_zero1", "dp4_zero3")}
FOUR_RANKS |= {"ep2_to_pp2_zero1": ("save_ep2", "pp2_dp2_zero1")}
ONE_PROCESS = {"ep2_to_one": "save_ep2", "pp2_to_one": "save_pp2", "tp2_to_one": "save_tp2"}
ONE_PROCESS |= {"zero1_to_one": "save_zero1"}


def _resumable(common: list[str]) -> list[str]:
    return [*common, "checkpoint.enable=true", "checkpoint.resume=auto"]


def _branch(root, source: str, name: str) -> None:
    """A copy of a saved run directory under a new run name (each resume writes into its own)."""
    runs = root / "runs"
    shutil.rmtree(runs / name, ignore_errors=True)
    shutil.copytree(runs / source, runs / name)


def _check(root, name: str, reference: str = "reference") -> None:
    expected, got = _losses(root, reference), _losses(root, name)
    assert len(got) == len(expected), (name, len(got))
    rel = max(abs(a - b) / abs(a) for a, b in zip(expected[SAVE_AT:], got[SAVE_AT:], strict=True))
    print(f"reshard {name}: max loss rel diff over steps {SAVE_AT + 1}-8 {rel:.1e}")
    assert rel <= RTOL, (name, rel)


def test_checkpoints_reshard_across_layouts(setup):  # noqa: F811
    root, common, _ = setup
    common = _resumable(common)
    spec = {"common": common, "layouts": SAVED, "stop_at": SAVE_AT}
    run_ranks(2, "train_layouts", root / "saves", json.dumps(spec))

    for ranks, cases in ((2, TWO_RANKS), (4, FOUR_RANKS)):
        for name, (source, _) in cases.items():
            _branch(root, source, name)
        layouts = {name: LAYOUTS[layout] for name, (_, layout) in cases.items()}
        spec = json.dumps({"common": common, "layouts": layouts})
        run_ranks(ranks, "train_layouts", root / f"resume{ranks}", spec, timeout=600)
        for name in cases:
            _check(root, name)

    for name, source in ONE_PROCESS.items():
        _branch(root, source, name)
        Trainer(load_config(None, [*common, f"run.name={name}"]).config).train()
        _check(root, name)


def test_a_context_parallel_checkpoint_resumes_at_cp1_and_dp2(setup, cp_reference):  # noqa: F811
    """Saved at cp2 (ZeRO-3 over dp_shard x cp), resumed by one process and at dp_shard2: the
    losses after the checkpoint are the uninterrupted one-process run's (without MTP, which cp
    refuses so far)."""
    root, common, _ = setup
    common = _resumable([*common, *NO_MTP])
    saved = {"save_cp2": ["parallel.cp=2", "parallel.zero_stage=3"]}
    run_ranks(2, "train_layouts", root / "cp_saves", json.dumps({"common": common,
              "layouts": saved, "stop_at": SAVE_AT}))  # fmt: skip
    _branch(root, "save_cp2", "cp2_to_dp2")
    resumed = {"cp2_to_dp2": ["parallel.dp_shard=2", "parallel.zero_stage=1"]}
    spec = json.dumps({"common": common, "layouts": resumed})
    run_ranks(2, "train_layouts", root / "cp_resume", spec, timeout=600)
    _check(root, "cp2_to_dp2", "reference_no_mtp")
    _branch(root, "save_cp2", "cp2_to_one")
    Trainer(load_config(None, [*common, "run.name=cp2_to_one"]).config).train()
    _check(root, "cp2_to_one", "reference_no_mtp")
