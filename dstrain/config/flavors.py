"""Built-in architectures ("flavors") and the one function that resolves the config's model section.

Numbers are those of the published Hugging Face config.json of each model. They live in `config/`
(not `model/`) because `check` and the planner need them without torch; `dstrain/model/` builds
networks from the ModelArgs resolved here.
"""

from dstrain.config.hf_config import read_hf_config
from dstrain.config.model_args import ModelArgs
from dstrain.config.schema import ModelConfig
from dstrain.config.suggest import did_you_mean
from dstrain.errors import UserError

_DEEPSEEK_VOCAB = 102400

FLAVORS: dict[str, ModelArgs] = {
    # Tiny MLA + MoE + MTP model: trains on 2 CPU cores in minutes.
    "debug": ModelArgs(),
    "deepseek-v2-lite": ModelArgs(
        vocab_size=_DEEPSEEK_VOCAB,
        dim=2048,
        num_layers=27,
        num_heads=16,
        q_lora_rank=0,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        inter_dim=10944,
        first_k_dense=1,
        num_routed_experts=64,
        num_shared_experts=2,
        num_activated_experts=6,
        moe_inter_dim=1408,
        n_group=1,
        topk_group=1,
        score_func="softmax",
        route_scale=1.0,
        norm_topk_prob=False,
        aux_loss_alpha=0.001,
        bias_update_speed=0.0,
        num_mtp_modules=0,
        max_seq_len=163840,
        rope_factor=40.0,
        original_seq_len=4096,
        mscale=0.707,
        mscale_all_dim=0.707,
    ),
    "deepseek-moe-16b": ModelArgs(
        vocab_size=_DEEPSEEK_VOCAB,
        dim=2048,
        num_layers=28,
        num_heads=16,
        attention="mha",
        head_dim=128,
        inter_dim=10944,
        first_k_dense=1,
        num_routed_experts=64,
        num_shared_experts=2,
        num_activated_experts=6,
        moe_inter_dim=1408,
        n_group=1,
        topk_group=1,
        score_func="softmax",
        norm_topk_prob=False,
        aux_loss_alpha=0.001,
        bias_update_speed=0.0,
        num_mtp_modules=0,
        max_seq_len=4096,
        original_seq_len=4096,
    ),
    "deepseek-v3": ModelArgs(
        vocab_size=129280,
        dim=7168,
        num_layers=61,
        num_heads=128,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        inter_dim=18432,
        first_k_dense=3,
        num_routed_experts=256,
        num_shared_experts=1,
        num_activated_experts=8,
        moe_inter_dim=2048,
        n_group=8,
        topk_group=4,
        score_func="sigmoid",
        route_scale=2.5,
        norm_topk_prob=True,
        aux_loss_alpha=0.0001,
        bias_update_speed=0.001,
        num_mtp_modules=1,
        mtp_loss_weight=0.3,
        max_seq_len=163840,
        rope_factor=40.0,
        original_seq_len=4096,
        mscale_all_dim=1.0,
    ),
    "deepseek-llm-7b": ModelArgs(
        vocab_size=_DEEPSEEK_VOCAB,
        dim=4096,
        num_layers=30,
        num_heads=32,
        attention="mha",
        head_dim=128,
        inter_dim=11008,
        first_k_dense=30,
        num_routed_experts=0,
        num_shared_experts=0,
        num_activated_experts=0,
        n_group=1,
        topk_group=1,
        num_mtp_modules=0,
        max_seq_len=4096,
        original_seq_len=4096,
    ),
}


def flavor_args(name: str) -> ModelArgs:
    key = name.strip().lower()
    if key not in FLAVORS:
        raise UserError(
            f"unknown model flavor `{name}`{did_you_mean(name, FLAVORS)}",
            f"use one of: {', '.join(FLAVORS)}",
            exit_code=1,
        )
    return FLAVORS[key]


def resolve_model_args(model: ModelConfig) -> ModelArgs:
    """The architecture (hf_config's, else the flavor's, else init_from's config.json, else
    debug's) with the section's non-None fields applied on top."""
    if model.hf_config:
        base = read_hf_config(model.hf_config)
    elif model.flavor is None and model.init_from:
        base = read_hf_config(model.init_from)
    else:
        base = flavor_args(model.flavor or "debug")
    overrides = {
        name: value
        for name in ModelArgs.model_fields
        if (value := getattr(model, name)) is not None
    }
    try:
        return ModelArgs.model_validate({**base.model_dump(), **overrides})
    except ValueError as exc:
        raise UserError(
            f"model: {_first_line(exc)}", "fix the model overrides", exit_code=1
        ) from None


def _first_line(exc: Exception) -> str:
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return " ".join(lines[1:3]) if len(lines) > 1 else str(exc)


def model_name(model: ModelConfig) -> str:
    """How the start-up log names the model."""
    if model.hf_config:
        return str(model.hf_config)
    if model.flavor is None and model.init_from:
        return f"{model.init_from} (its config.json)"
    return model.flavor or "debug"
