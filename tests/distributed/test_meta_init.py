"""Meta-device construction and layout-invariant initialisation: every layout builds its model on
`meta`, parallelises it (or carves its stages), then materialises only its own shards, and the
gathered initial weights equal a one-process build with the same seed, bit for bit: DDP, ZeRO-1/2/3
(uneven FSDP shards on 3 ranks), offload, HSDP, TP/SP, EP with the experts inside and outside
FSDP, TP x EP, and the pipeline schedules, alone and combined.
"""

import json

import pytest
import torch

from dstrain.config.flavors import resolve_model_args
from dstrain.config.load import load_config
from dstrain.model.transformer import build_model
from tests.distributed.harness import run_ranks
from tests.distributed.test_parity_matrix import setup  # noqa: F401 (fixture)

pytestmark = pytest.mark.slow

TWO_RANKS = {
    "ddp": ["parallel.dp_shard=2", "parallel.zero_stage=0"],
    "zero1": ["parallel.dp_shard=2", "parallel.zero_stage=1"],
    "zero3_offload": [
        "parallel.dp_shard=2",
        "parallel.zero_stage=3",
        "parallel.offload_optimizer=true",
        "parallel.offload_params=true",
    ],
    "tp2_sp": ["parallel.tp=2", "parallel.sequence_parallel=true"],
    "ep2_ddp": ["parallel.dp_shard=2", "parallel.ep=2", "parallel.zero_stage=0"],
    "ep2_zero2": ["parallel.dp_shard=2", "parallel.ep=2", "parallel.zero_stage=2"],
    "tp2_ep2": ["parallel.tp=2", "parallel.ep=2"],
    "pp2_1f1b": ["parallel.pp=2", "parallel.pp_schedule=1f1b"],
    "pp2_dualpipev": [
        "parallel.pp=2",
        "parallel.pp_schedule=dualpipev",
        "parallel.num_virtual_stages=2",
    ],
}
THREE_RANKS = {
    "dp3_zero3": ["parallel.dp_shard=3", "parallel.zero_stage=3", "train.global_batch_size=12"]
}
FOUR_RANKS = {
    "hsdp_ep2": [
        "parallel.dp_replicate=2",
        "parallel.dp_shard=2",
        "parallel.ep=2",
        "parallel.zero_stage=3",
    ],
    "dp2_tp2_zero1": ["parallel.dp_shard=2", "parallel.tp=2", "parallel.zero_stage=1"],
    "dp4_ep2_zero1": ["parallel.dp_shard=4", "parallel.ep=2", "parallel.zero_stage=1"],
    "pp2_dp2_zero1_dualpipev": [
        "parallel.pp=2",
        "parallel.dp_shard=2",
        "parallel.ep=2",
        "parallel.zero_stage=1",
        "parallel.pp_schedule=dualpipev",
        "parallel.num_virtual_stages=2",
        "train.micro_batch_size=2",
    ],
    "pp2_tp2": ["parallel.pp=2", "parallel.tp=2"],
}


def _reference(common: list[str]) -> dict[str, torch.Tensor]:
    config = load_config(None, common).config
    args = resolve_model_args(config.model)
    return build_model(args, "cpu", seed=config.train.seed).state_dict()


@pytest.mark.parametrize(
    "ranks, layouts", [(2, TWO_RANKS), (3, THREE_RANKS), (4, FOUR_RANKS)], ids=["2", "3", "4"]
)
def test_initial_weights_are_the_same_in_every_layout(setup, ranks, layouts):  # noqa: F811
    root, common, _ = setup
    reference = _reference(common)
    out = root / f"init{ranks}"
    spec = {"common": common, "layouts": layouts, "init_only": True}
    run_ranks(ranks, "train_layouts", out, json.dumps(spec), timeout=600)
    for name in layouts:
        weights = torch.load(out / f"{name}.pt")
        assert weights.keys() == reference.keys(), name
        for key, value in reference.items():
            assert torch.equal(weights[key], value), (name, key)
