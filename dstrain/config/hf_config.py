"""A Hugging Face `config.json` read into ModelArgs, by its standard keys.

Supported `model_type`s: deepseek_v3, deepseek_v2, llama, mistral, qwen2, mixtral, gpt2. MLA and
DeepSeekMoE keys map one to one; Llama-style models become multi-head (GQA) attention with a
SwiGLU FFN, GPT-2 a GELU FFN.
"""

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from dstrain.config.model_args import ModelArgs
from dstrain.config.suggest import did_you_mean
from dstrain.errors import UserError


def read_hf_config(path: Path) -> ModelArgs:
    """ModelArgs from `path` (a config.json, or a folder holding one)."""
    file = path / "config.json" if path.is_dir() else path
    if not file.exists():
        raise UserError(f"HF config not found: {file}", "point model.hf_config at a config.json")
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"{file} is not valid JSON: {exc}", "check the file") from None
    if not isinstance(data, dict):
        raise UserError(f"{file}: expected a JSON object", "check the file")
    return model_args_from_hf(data, str(file))


def model_args_from_hf(data: dict[str, Any], origin: str) -> ModelArgs:
    """ModelArgs from the keys of a config.json already read; `origin` names it in messages."""
    kind = str(data.get("model_type", ""))
    reader = _READERS.get(kind)
    if reader is None:
        raise UserError(
            f"{origin}: model_type `{kind}` is not supported{did_you_mean(kind, _READERS)}",
            f"supported: {', '.join(_READERS)}",
        )
    try:
        return ModelArgs.model_validate(reader(_Keys(data, origin)))
    except ValidationError as exc:
        first = exc.errors()[0]
        raise UserError(
            f"{origin}: {'.'.join(map(str, first['loc']))}: {first['msg']}",
            "check the config.json",
        ) from None


class _Keys:
    """Required and optional lookups that name the origin and key when one is missing."""

    def __init__(self, data: dict[str, Any], origin: str) -> None:
        self.data, self.origin = data, origin

    def need(self, key: str) -> Any:
        if self.data.get(key) is None:
            raise UserError(
                f"{self.origin}: `{key}` is missing", "add it, as transformers writes it"
            )
        return self.data[key]

    def get(self, key: str, default: Any) -> Any:
        value = self.data.get(key)
        return default if value is None else value


def _rope(k: _Keys) -> tuple[dict[str, Any], float]:
    """YaRN settings and theta, from `rope_scaling` (DeepSeek's files) or `rope_parameters`
    (transformers >= 5); a `default` rope type means no scaling."""
    rope = k.get("rope_scaling", None) or k.get("rope_parameters", None) or {}
    theta = rope.get("rope_theta", k.get("rope_theta", 10000.0))
    kind = rope.get("rope_type", rope.get("type", "default"))
    return (rope if kind == "yarn" else {}), theta


# config.json fields the reader refuses rather than ignore: (key, the value dstrain's model has).
_FIXED = {
    "moe_layer_freq": 1,  # every layer after first_k_dense_replace is MoE
    "tie_word_embeddings": False,  # the head is its own tensor
    "hidden_act": "silu",  # SwiGLU
    "rope_interleave": True,  # RoPE on interleaved pairs, the release's weight order
}
# topk_method -> (the score function it implies, whether groups limit the choice)
_TOPK_METHODS = {
    "noaux_tc": ("sigmoid", True),
    "group_limited_greedy": ("softmax", True),
    "greedy": (None, False),
}
# The balance-loss weight when config.json has none, and where it comes from.
_AUX_DEFAULT = {
    "deepseek_v3": (0.0001, "the V3 paper's (section 4.2), as the deepseek-v3 flavor"),
    "deepseek_v2": (0.001, "DeepSeek-V2's and V2-Lite's released config.json"),
}


def _refuse_unsupported(k: _Keys) -> None:
    for key, ours in _FIXED.items():
        value = k.data.get(key)
        if value is not None and value != ours:
            raise UserError(
                f"{k.origin}: {key} = {json.dumps(value)}; dstrain's DeepSeek model has "
                f"{json.dumps(ours)} only",
                f"use a checkpoint with {key} = {json.dumps(ours)} (as DeepSeek's releases), or "
                "describe the model with model.flavor and its overrides instead",
                exit_code=1,
            )
    method = k.data.get("topk_method")
    if method is not None and method not in _TOPK_METHODS:
        raise UserError(
            f"{k.origin}: topk_method `{method}` is not one dstrain routes by",
            f"dstrain routes by {', '.join(_TOPK_METHODS)} (DeepSeek-V3, V2, V2-Lite)",
            exit_code=1,
        )
    score, _ = _TOPK_METHODS.get(method, (None, True))
    scoring = k.data.get("scoring_func")
    if score is not None and scoring is not None and scoring != score:
        raise UserError(
            f"{k.origin}: topk_method `{method}` with scoring_func `{scoring}`",
            f"{method} routes on {score} scores (DeepSeek's pairing); fix one of the two",
            exit_code=1,
        )


def deepseek_notes(data: dict[str, Any]) -> list[str]:
    """What the reader decided about a DeepSeek config.json that the file does not say outright,
    for `dstrain check` to show: defaults taken, and fields that do not shape the weights."""
    notes = []
    kind = str(data.get("model_type", ""))
    if kind in _AUX_DEFAULT and data.get("aux_loss_alpha") is None:
        value, source = _AUX_DEFAULT[kind]
        notes.append(
            f"config.json has no aux_loss_alpha: the balance loss weighs {value} ({source}; "
            "set model.aux_loss_alpha to change it)"
        )
    ep = data.get("ep_size")
    if ep not in (None, 1):
        notes.append(
            f"config.json's ep_size {ep} is DeepSeek's inference-time expert-parallel degree; "
            "training's comes from parallel.ep"
        )
    return notes


def _deepseek(k: _Keys) -> dict[str, Any]:
    _refuse_unsupported(k)
    rope, theta = _rope(k)
    layers = k.need("num_hidden_layers")
    experts = k.get("n_routed_experts", 0)
    kind = k.data.get("model_type")
    v3 = kind == "deepseek_v3"
    _, grouped = _TOPK_METHODS.get(k.data.get("topk_method"), (None, True))
    return {
        "vocab_size": k.need("vocab_size"),
        "dim": k.need("hidden_size"),
        "num_layers": layers,
        "num_heads": k.need("num_attention_heads"),
        "q_lora_rank": k.get("q_lora_rank", 0),
        "kv_lora_rank": k.need("kv_lora_rank"),
        "qk_nope_head_dim": k.need("qk_nope_head_dim"),
        "qk_rope_head_dim": k.need("qk_rope_head_dim"),
        "v_head_dim": k.need("v_head_dim"),
        "inter_dim": k.need("intermediate_size"),
        "first_k_dense": k.get("first_k_dense_replace", 0) if experts else layers,
        "num_routed_experts": experts,
        "num_shared_experts": k.get("n_shared_experts", 0),
        "num_activated_experts": k.get("num_experts_per_tok", 0),
        "moe_inter_dim": k.get("moe_intermediate_size", 1),
        # greedy top-k ignores any groups the file lists (V2-Lite's n_group is 1 anyway)
        "n_group": k.get("n_group", 1) if grouped else 1,
        "topk_group": k.get("topk_group", 1) if grouped else 1,
        "score_func": k.get("scoring_func", "sigmoid" if v3 else "softmax"),
        "route_scale": k.get("routed_scaling_factor", 1.0),
        "norm_topk_prob": k.get("norm_topk_prob", False),
        "aux_loss_alpha": k.get("aux_loss_alpha", _AUX_DEFAULT.get(kind, (0.0, ""))[0]),
        "seq_aux": k.get("seq_aux", True),
        "bias_update_speed": 0.001 if v3 or k.get("topk_method", "") == "noaux_tc" else 0.0,
        "num_mtp_modules": k.get("num_nextn_predict_layers", 0),
        "max_seq_len": k.get("max_position_embeddings", 4096),
        "rope_theta": theta,
        "rope_factor": rope.get("factor", 1.0),
        "original_seq_len": rope.get("original_max_position_embeddings", 4096),
        "beta_fast": rope.get("beta_fast", 32.0),
        "beta_slow": rope.get("beta_slow", 1.0),
        "mscale": rope.get("mscale", 1.0),
        "mscale_all_dim": rope.get("mscale_all_dim", 0.0),
        "norm_eps": k.get("rms_norm_eps", 1e-6),
    }


def _dense(layers: int) -> dict[str, Any]:
    """A model without routed experts or MTP: every layer a dense FFN."""
    return {
        "first_k_dense": layers,
        "num_routed_experts": 0,
        "num_shared_experts": 0,
        "num_activated_experts": 0,
        "n_group": 1,
        "topk_group": 1,
        "num_mtp_modules": 0,
    }


def _llama(k: _Keys) -> dict[str, Any]:
    layers = k.need("num_hidden_layers")
    heads = k.need("num_attention_heads")
    return {
        "vocab_size": k.need("vocab_size"),
        "dim": k.need("hidden_size"),
        "num_layers": layers,
        "num_heads": heads,
        "attention": "mha",
        "num_kv_heads": k.get("num_key_value_heads", heads),
        "head_dim": k.get("head_dim", k.need("hidden_size") // heads),
        "inter_dim": k.need("intermediate_size"),
        **_dense(layers),
        "max_seq_len": k.get("max_position_embeddings", 4096),
        "original_seq_len": k.get("max_position_embeddings", 4096),
        "rope_theta": _rope(k)[1],
        "norm_eps": k.get("rms_norm_eps", 1e-5),
    }


def _mixtral(k: _Keys) -> dict[str, Any]:
    args = _llama(k)
    args |= {
        "first_k_dense": 0,
        "num_routed_experts": k.need("num_local_experts"),
        "num_activated_experts": k.need("num_experts_per_tok"),
        "moe_inter_dim": k.need("intermediate_size"),
        "score_func": "softmax",
        "norm_topk_prob": True,
        "bias_update_speed": 0.0,
        "aux_loss_alpha": k.get("router_aux_loss_coef", 0.0),
    }
    return args


def _gpt2(k: _Keys) -> dict[str, Any]:
    dim, layers, heads = k.need("n_embd"), k.need("n_layer"), k.need("n_head")
    return {
        "vocab_size": k.need("vocab_size"),
        "dim": dim,
        "num_layers": layers,
        "num_heads": heads,
        "attention": "mha",
        "head_dim": dim // heads,
        "mlp": "gelu",
        "inter_dim": k.get("n_inner", 4 * dim),
        **_dense(layers),
        "max_seq_len": k.get("n_positions", 1024),
        "original_seq_len": k.get("n_positions", 1024),
        "norm_eps": k.get("layer_norm_epsilon", 1e-5),
    }


_READERS: dict[str, Callable[[_Keys], dict[str, Any]]] = {
    "deepseek_v3": _deepseek,
    "deepseek_v2": _deepseek,
    "llama": _llama,
    "mistral": _llama,
    "qwen2": _llama,
    "mixtral": _mixtral,
    "gpt2": _gpt2,
}
