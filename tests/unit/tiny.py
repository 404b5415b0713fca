"""Tiny model arguments shared by the unit tests."""

from dstrain.config.model_args import ModelArgs


def tiny_args(**changes) -> ModelArgs:
    base = dict(
        vocab_size=64,
        dim=32,
        num_layers=3,
        num_heads=2,
        q_lora_rank=16,
        kv_lora_rank=8,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=8,
        inter_dim=48,
        first_k_dense=1,
        num_routed_experts=4,
        num_shared_experts=1,
        num_activated_experts=2,
        moe_inter_dim=16,
        n_group=2,
        topk_group=1,
        num_mtp_modules=1,
        max_seq_len=32,
        original_seq_len=32,
    )
    return ModelArgs(**{**base, **changes})
