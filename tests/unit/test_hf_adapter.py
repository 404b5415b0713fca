"""Our names <-> the Hugging Face DeepSeek checkpoint layout, without files: every tensor makes
the round trip, MTP depths land on the layers after the last one (as DeepSeek publishes them),
config.json's routing method is the releases', and what has no DeepSeek layout is refused."""

import pytest
import torch

from dstrain.config.flavors import FLAVORS
from dstrain.errors import UserError
from dstrain.model.hf_adapter import check_exportable, from_hf, hf_config, to_hf, with_mtp_copies
from dstrain.model.transformer import build_model
from tests.hf_models import fuse_experts
from tests.unit.tiny import tiny_args


def test_every_tensor_makes_the_round_trip_with_two_mtp_depths():
    # 3 layers and 2 depths: an odd layer count, so an index computed with a bit operation
    # instead of a sum lands elsewhere
    args = tiny_args(num_layers=3, num_mtp_modules=2)
    state = {
        k: v for k, v in build_model(args).state_dict().items() if "tokens_per_expert" not in k
    }
    hf = with_mtp_copies(to_hf(state, args), args)
    # depth d is layer num_layers + d - 1, with its own copies of the embedding and the head
    for layer in (3, 4):
        for part in ("eh_proj.weight", "embed_tokens.weight", "shared_head.head.weight"):
            assert f"model.layers.{layer}.{part}" in hf, (layer, part)
    assert not any(name.startswith("model.layers.5.") for name in hf)
    back = from_hf(hf, args)
    assert back.keys() == state.keys()
    for name, tensor in state.items():
        assert torch.equal(back[name], tensor), name


def test_fused_experts_read_as_the_per_expert_ones():
    """transformers' fused layout (gate_up_proj [E, 2F, D], down_proj [E, D, F]) gives the same
    state as DeepSeek's per-expert one."""
    args = tiny_args()
    state = {
        k: v for k, v in build_model(args).state_dict().items() if "tokens_per_expert" not in k
    }
    fused = fuse_experts(with_mtp_copies(to_hf(state, args), args))
    assert not any(".mlp.experts.0." in name for name in fused)
    back = from_hf(fused, args)
    assert back.keys() == state.keys()
    for name, tensor in state.items():
        assert torch.equal(back[name], tensor), name


def test_config_json_routes_as_the_releases_do():
    """DeepSeek-V2's config.json: n_group 8, group_limited_greedy; V2-Lite's: n_group 1, greedy;
    V3's: noaux_tc."""
    lite = FLAVORS["deepseek-v2-lite"]
    assert hf_config(lite)["topk_method"] == "greedy"
    v2 = lite.model_copy(update={"n_group": 8, "topk_group": 3, "num_routed_experts": 160})
    assert hf_config(v2)["topk_method"] == "group_limited_greedy"
    assert hf_config(FLAVORS["deepseek-v3"])["topk_method"] == "noaux_tc"


def test_only_mla_with_swiglu_has_a_deepseek_layout():
    check_exportable(tiny_args())
    for changed in (dict(mlp="gelu"), dict(attention="mha")):
        with pytest.raises(UserError):
            check_exportable(tiny_args(**changed))
