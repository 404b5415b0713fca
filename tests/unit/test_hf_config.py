"""Hugging Face config.json files read into ModelArgs by their standard keys."""

import json

import pytest

from dstrain.config.flavors import FLAVORS, resolve_model_args
from dstrain.config.hf_config import read_hf_config
from dstrain.config.load import load_config
from dstrain.errors import UserError

V3 = {  # the keys and values of DeepSeek-V3's published config.json that dstrain reads
    "model_type": "deepseek_v3",
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "n_shared_experts": 1,
    "n_routed_experts": 256,
    "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "qk_nope_head_dim": 128,
    "topk_method": "noaux_tc",
    "n_group": 8,
    "topk_group": 4,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "norm_topk_prob": True,
    "scoring_func": "sigmoid",
    "aux_loss_alpha": 0.0001,
    "max_position_embeddings": 163840,
    "rope_theta": 10000,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rms_norm_eps": 1e-06,
    "num_nextn_predict_layers": 1,
}


def _write(tmp_path, data, name="config.json"):
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


def test_deepseek_v3_config_equals_the_flavor(tmp_path):
    assert read_hf_config(_write(tmp_path, V3)) == FLAVORS["deepseek-v3"]
    assert read_hf_config(tmp_path) == FLAVORS["deepseek-v3"]  # a folder holding config.json


def test_llama_mixtral_gpt2(tmp_path):
    llama = read_hf_config(
        _write(
            tmp_path,
            {
                "model_type": "llama",
                "vocab_size": 32000,
                "hidden_size": 4096,
                "intermediate_size": 11008,
                "num_hidden_layers": 32,
                "num_attention_heads": 32,
                "num_key_value_heads": 8,
            },
        )
    )
    assert llama.attention == "mha" and llama.kv_heads == 8 and not llama.is_moe
    mixtral = read_hf_config(
        _write(
            tmp_path,
            {
                "model_type": "mixtral",
                "vocab_size": 32000,
                "hidden_size": 4096,
                "intermediate_size": 14336,
                "num_hidden_layers": 32,
                "num_attention_heads": 32,
                "num_key_value_heads": 8,
                "num_local_experts": 8,
                "num_experts_per_tok": 2,
            },
        )
    )
    assert mixtral.is_moe and mixtral.num_routed_experts == 8 and mixtral.first_k_dense == 0
    gpt2 = read_hf_config(
        _write(
            tmp_path,
            {"model_type": "gpt2", "vocab_size": 50257, "n_embd": 768, "n_layer": 12, "n_head": 12},
        )
    )
    assert gpt2.mlp == "gelu" and gpt2.inter_dim == 3072 and gpt2.max_seq_len == 1024


def test_hf_config_in_a_run_config_with_overrides(tmp_path):
    path = _write(tmp_path, V3)
    loaded = load_config(
        None, [f"model.hf_config={path}", "model.num_layers=4", "model.first_k_dense=1"]
    )
    args = resolve_model_args(loaded.config.model)
    assert args.num_layers == 4 and args.dim == 7168


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"model_type": "bert"}, "not supported"),
        ({"model_type": "llama", "hidden_size": 8}, "is missing"),
        ({**V3, "num_hidden_layers": -1}, "num_layers"),
    ],
)
def test_bad_hf_configs_are_user_errors(tmp_path, data, message):
    with pytest.raises(UserError, match=message):
        read_hf_config(_write(tmp_path, data))


def test_missing_and_broken_files(tmp_path):
    with pytest.raises(UserError, match="not found"):
        read_hf_config(tmp_path / "nope.json")
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    with pytest.raises(UserError, match="not valid JSON"):
        read_hf_config(broken)


# ---- the release's config.json fields: honoured, or refused by name ---------------------------


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("moe_layer_freq", 2),
        ("tie_word_embeddings", True),
        ("hidden_act", "gelu"),
        ("rope_interleave", False),
        ("topk_method", "sinkhorn"),
    ],
)
def test_fields_the_model_cannot_honour_are_refused_by_name(tmp_path, key, value):
    with pytest.raises(UserError) as caught:
        read_hf_config(_write(tmp_path, {**V3, key: value}))
    assert key in caught.value.message and caught.value.fix


def test_fields_the_release_sets_are_honoured(tmp_path):
    from dstrain.config.hf_config import deepseek_notes

    release = {**V3, "moe_layer_freq": 1, "tie_word_embeddings": False, "hidden_act": "silu"}
    release |= {"seq_aux": True, "ep_size": 1, "aux_loss_alpha": 0.001}
    args = read_hf_config(_write(tmp_path, release))
    assert args.aux_loss_alpha == 0.001 and args.seq_aux
    assert read_hf_config(_write(tmp_path, {**V3, "seq_aux": False})).seq_aux is False
    # Absent: each generation's paper (and the flavor), said as a note.
    no_alpha = {k: v for k, v in V3.items() if k != "aux_loss_alpha"}
    assert read_hf_config(_write(tmp_path, no_alpha)).aux_loss_alpha == 0.0001
    assert any("no aux_loss_alpha" in n for n in deepseek_notes(no_alpha))
    v2 = {**no_alpha, "model_type": "deepseek_v2", "scoring_func": "softmax"}
    v2 |= {"topk_method": "greedy", "n_group": 8, "topk_group": 3}
    v2_args = read_hf_config(_write(tmp_path, v2))
    assert v2_args.aux_loss_alpha == 0.001
    assert (v2_args.n_group, v2_args.topk_group) == (1, 1)  # greedy: groups do not limit
    assert any("ep_size 8" in n for n in deepseek_notes({**V3, "ep_size": 8}))
    with pytest.raises(UserError, match="scoring_func"):
        read_hf_config(_write(tmp_path, {**V3, "scoring_func": "softmax"}))  # noaux_tc: sigmoid
