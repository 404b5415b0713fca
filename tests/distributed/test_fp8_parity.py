"""FP8 (train.precision = fp8) in every layout, against one process in FP8.

The layouts of the bf16 matrix (test_low_precision.py), 4 steps each, on a debug model widened
so that every tensor-parallel shard of an FP8 linear is a whole number of 128-tiles (heads of
64 + 64 query/key and 64 value dims, inter_dim 256, expert width 256): the layouts quantise
exactly the tiles one process quantises (the tokens' tiles never cross a sequence, and TP shards
hold whole tiles), so what differs is what differs in bf16, reduction orders, plus the E4M3
roundings those flip. Measured (printed by the test) and bounded by FP8_RTOL on the per-step
losses.
"""

import json

import pytest

from tests.distributed.harness import run_ranks
from tests.distributed.test_low_precision import _one_process, _worst, small  # noqa: F401
from tests.distributed.test_parity_matrix import _losses

pytestmark = pytest.mark.slow

FP8_RTOL = 3e-4  # measured up to 8.1e-5 (2 ranks)
WIDE = [
    "train.precision=fp8",
    "model.qk_nope_head_dim=64",
    "model.qk_rope_head_dim=64",
    "model.v_head_dim=64",
    "model.inter_dim=256",
    "model.moe_inter_dim=256",
]
TWO_RANKS = {
    "ddp": ["parallel.dp_shard=2", "parallel.zero_stage=0"],
    "zero1": ["parallel.dp_shard=2", "parallel.zero_stage=1"],
    "zero3": ["parallel.dp_shard=2", "parallel.zero_stage=3"],
    "tp2": ["parallel.tp=2", "parallel.sequence_parallel=false"],
    "tp2_sp": ["parallel.tp=2", "parallel.sequence_parallel=true"],
    "ep2_in_fsdp": ["parallel.dp_shard=2", "parallel.ep=2", "parallel.zero_stage=2"],
    "ep2_outside_fsdp": ["parallel.dp_shard=2", "parallel.ep=2", "parallel.zero_stage=0"],
    "tp2_ep2": ["parallel.tp=2", "parallel.ep=2"],
    "pp2_1f1b": ["parallel.pp=2", "parallel.pp_schedule=1f1b"],
    "pp2_dualpipev": [
        "parallel.pp=2",
        "parallel.pp_schedule=dualpipev",
        "parallel.num_virtual_stages=2",
    ],
}
FOUR_RANKS = {
    "hsdp": ["parallel.dp_replicate=2", "parallel.dp_shard=2", "parallel.zero_stage=3"],
    "dp2_tp2": ["parallel.dp_shard=2", "parallel.tp=2", "parallel.zero_stage=2"],
    "dp4_ep2": ["parallel.dp_shard=4", "parallel.ep=2", "parallel.zero_stage=3"],
    "pp2_tp2_sp": ["parallel.pp=2", "parallel.tp=2", "parallel.sequence_parallel=true"],
    "pp2_dp2_zero1_ep2": [
        "parallel.pp=2",
        "parallel.dp_shard=2",
        "parallel.ep=2",
        "parallel.zero_stage=1",
    ],
}


# 4 ranks (FOUR_RANKS) is not yet measured to hold FP8_RTOL: it stays out of the suite until it is.
@pytest.mark.parametrize("ranks", [2])
def test_fp8_in_every_layout_matches_one_process(small, ranks):  # noqa: F811
    root, common = small
    common = [*common, *WIDE]
    layouts = TWO_RANKS if ranks == 2 else FOUR_RANKS
    reference = _one_process(root, common, f"fp8_reference{ranks}")
    spec = json.dumps({"common": common, "layouts": layouts})
    run_ranks(ranks, "train_layouts", root / f"fp8_{ranks}", spec, timeout=1200)
    for name in layouts:
        worst = _worst(reference, _losses(root, name))
        print(f"fp8 {name}: max loss rel diff {worst:.1e}")
        assert worst <= FP8_RTOL, (name, worst)
