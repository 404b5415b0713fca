"""The model architecture as numbers: what a flavor fixes and the `model` section overrides.

Names follow the DeepSeek-V2/V3 papers and their Hugging Face `config.json` so that conversion is a
key map. It lives in `config/` because `check` and the planner reason about these numbers without
building a model; `dstrain/model/` builds the network from them.
"""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class ModelArgs(BaseModel):
    """A DeepSeek-style decoder: MLA (or multi-head) attention, dense then MoE layers, MTP."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    vocab_size: int = Field(2048, gt=0, description="Vocabulary size (rows of the embedding).")
    dim: int = Field(128, gt=0, description="Hidden size of the residual stream (HF hidden_size).")
    num_layers: int = Field(4, gt=0, description="Transformer blocks (HF num_hidden_layers).")
    num_heads: int = Field(4, gt=0, description="Attention heads (HF num_attention_heads).")
    attention: Literal["mla", "mha"] = Field(
        "mla",
        description="`mla`: Multi-head Latent Attention (DeepSeek-V2/V3); `mha`: classic "
        "multi-head (or grouped-query) attention as in DeepSeek-LLM and DeepSeekMoE-16B.",
    )
    num_kv_heads: int | None = Field(
        None,
        gt=0,
        description="Key/value heads for `mha` (grouped-query when < num_heads). None = num_heads. "
        "MLA ignores it: its keys and values come from one shared latent.",
    )
    head_dim: int | None = Field(
        None, gt=0, description="Per-head width for `mha`. None = dim / num_heads."
    )
    q_lora_rank: int = Field(
        64,
        ge=0,
        description="MLA query compression rank (wq_a -> q_norm -> wq_b). 0 = direct query "
        "projection wq, as DeepSeek-V2-Lite does.",
    )
    kv_lora_rank: int = Field(32, gt=0, description="MLA key/value latent rank (wkv_a output).")
    qk_nope_head_dim: int = Field(
        32, gt=0, description="MLA per-head query/key width without RoPE."
    )
    qk_rope_head_dim: int = Field(
        16, gt=0, description="MLA decoupled RoPE width per head (shared key across heads)."
    )
    v_head_dim: int = Field(32, gt=0, description="MLA per-head value width.")
    mlp: Literal["swiglu", "gelu"] = Field(
        "swiglu",
        description="FFN kind: `swiglu` (gate, up, down: DeepSeek, Llama) or `gelu` (up, down: "
        "GPT-2, BLOOM).",
    )
    inter_dim: int = Field(
        384, gt=0, description="Width of the dense SwiGLU FFN (HF intermediate_size)."
    )
    first_k_dense: int = Field(
        1,
        ge=0,
        description="The first k layers use the dense FFN, the rest DeepSeekMoE (HF "
        "first_k_dense_replace). Equal to num_layers for a dense model.",
    )
    num_routed_experts: int = Field(
        8, ge=0, description="Fine-grained routed experts per MoE layer. 0 = dense model."
    )
    num_shared_experts: int = Field(
        1, ge=0, description="Always-active shared experts per MoE layer."
    )
    num_activated_experts: int = Field(
        2, ge=0, description="Routed experts chosen per token (top-k; HF num_experts_per_tok)."
    )
    moe_inter_dim: int = Field(64, gt=0, description="Width of each expert's SwiGLU FFN.")
    n_group: int = Field(
        2, gt=0, description="Expert groups for group-limited routing. 1 = no grouping."
    )
    topk_group: int = Field(
        1, gt=0, description="Groups a token may route into (device-limited routing)."
    )
    score_func: Literal["sigmoid", "softmax"] = Field(
        "sigmoid",
        description="Router affinity: `sigmoid` (DeepSeek-V3) or `softmax` (V2, MoE-16B).",
    )
    route_scale: float = Field(
        1.0, gt=0, description="Routed scaling factor applied to the combined routed output."
    )
    norm_topk_prob: bool = Field(
        True, description="Renormalize the top-k gate weights to sum to 1 (V3: yes, V2: no)."
    )
    bias_update_speed: float = Field(
        0.001,
        ge=0,
        description="Auxiliary-loss-free balancing: per-step bias update speed gamma. 0 = off.",
    )
    aux_loss_alpha: float = Field(
        0.0, ge=0, description="Weight of the sequence-wise balance loss. 0 = off (V3 uses 1e-4)."
    )
    seq_aux: bool = Field(
        True,
        description="The balance loss per sequence, averaged (V3 eq. 17-20; HF seq_aux), or "
        "over all tokens of the micro-batch at once (false: DeepSeek-V2's batch-wise form).",
    )
    num_mtp_modules: int = Field(
        1, ge=0, description="Multi-token prediction depth D (extra future tokens). 0 = off."
    )
    mtp_loss_weight: float = Field(0.3, ge=0, description="MTP loss weight lambda.")
    max_seq_len: int = Field(256, gt=0, description="Longest sequence the RoPE tables cover.")
    rope_theta: float = Field(10000.0, gt=0, description="RoPE base.")
    rope_factor: float = Field(
        1.0, ge=1.0, description="YaRN context-extension factor. 1 = plain RoPE."
    )
    original_seq_len: int = Field(
        256, gt=0, description="YaRN: the context length the model was pre-trained at."
    )
    beta_fast: float = Field(32.0, description="YaRN: fast rotation boundary.")
    beta_slow: float = Field(1.0, description="YaRN: slow rotation boundary.")
    mscale: float = Field(1.0, description="YaRN: attention-temperature scale.")
    mscale_all_dim: float = Field(
        0.0,
        ge=0,
        description="YaRN: softmax-scale correction (DeepSeek's mscale_all_dim). 0 = none.",
    )
    norm_eps: float = Field(1e-6, gt=0, description="RMSNorm epsilon.")

    @model_validator(mode="after")
    def _consistent(self) -> "ModelArgs":
        if self.first_k_dense > self.num_layers:
            raise ValueError(
                f"first_k_dense={self.first_k_dense} exceeds num_layers={self.num_layers}; "
                "set it to num_layers for a dense model"
            )
        if self.num_routed_experts and self.num_activated_experts > self.num_routed_experts:
            raise ValueError(
                f"num_activated_experts={self.num_activated_experts} exceeds "
                f"num_routed_experts={self.num_routed_experts}"
            )
        return self

    @property
    def is_moe(self) -> bool:
        return self.num_routed_experts > 0 and self.first_k_dense < self.num_layers

    @property
    def kv_heads(self) -> int:
        """Key/value heads as TP sees them: every head for MLA, num_kv_heads for `mha`."""
        return self.num_heads if self.attention == "mla" else (self.num_kv_heads or self.num_heads)
