"""Our state dict <-> the Hugging Face DeepseekV3/DeepseekV2 checkpoint layout, and config.json.

The checkpoint layout is the one DeepSeek publishes and `save_pretrained` writes: one tensor per
expert (`mlp.experts.{j}.gate_proj.weight`), MLA projections under `self_attn`, MTP modules as
extra layers after the last one (`model.layers.{num_layers + k - 1}`: enorm, hnorm, eh_proj,
shared_head.norm, and the block). transformers' fused in-memory form (`experts.gate_up_proj`) is
read too. RoPE needs no permutation: both sides rotate interleaved pairs.
"""

import json
import re
from pathlib import Path

import torch

from dstrain.config.hf_config import read_hf_config
from dstrain.config.model_args import ModelArgs
from dstrain.errors import UserError

# Our parameter name (after `layers.{i}.`) -> HF name (after `model.layers.{i}.`).
_LAYER = {
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.wq_b.weight": "self_attn.q_b_proj.weight",
    "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "ffn.w1.weight": "mlp.gate_proj.weight",
    "ffn.w3.weight": "mlp.up_proj.weight",
    "ffn.w2.weight": "mlp.down_proj.weight",
    "ffn.router.gate.weight": "mlp.gate.weight",
    "ffn.router.expert_bias": "mlp.gate.e_score_correction_bias",
    "ffn.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
    "ffn.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
}
_EXPERT = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_TOP = {
    "embed.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "head.weight": "lm_head.weight",
}
_MTP_COPIES = ("embed_tokens.weight", "shared_head.head.weight")
_MTP = {
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "proj.weight": "eh_proj.weight",
    "norm.weight": "shared_head.norm.weight",
}


def to_hf(state: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """Our state dict -> HF checkpoint tensors (per-expert layout)."""
    out = {}
    for name, tensor in state.items():
        if name in _TOP:
            out[_TOP[name]] = tensor
        elif name.startswith("layers."):
            _, layer, rest = name.split(".", 2)
            out.update(_block_to_hf(f"model.layers.{layer}.", rest, tensor))
        elif name.startswith("mtp."):
            _, depth, rest = name.split(".", 2)
            prefix = f"model.layers.{args.num_layers + int(depth) - 1}."
            if rest.startswith("block."):
                out.update(_block_to_hf(prefix, rest.removeprefix("block."), tensor))
            elif rest in _MTP:
                out[prefix + _MTP[rest]] = tensor
    return {k: v.contiguous() for k, v in out.items()}


def mtp_copies(args: ModelArgs) -> dict[str, str]:
    """The MTP layers' copies of the embedding and the head: copy name -> main tensor name."""
    out = {}
    for depth in range(1, args.num_mtp_modules + 1):
        prefix = f"model.layers.{args.num_layers + depth - 1}."
        out[prefix + "embed_tokens.weight"] = "model.embed_tokens.weight"
        out[prefix + "shared_head.head.weight"] = "lm_head.weight"
    return out


def with_mtp_copies(hf: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """`hf` plus, for the embedding and the head among them, the MTP layers' copies the release
    holds (their own storage: safetensors refuses shared tensors)."""
    copies = {copy: hf[main].clone() for copy, main in mtp_copies(args).items() if main in hf}
    return hf | copies


def _block_to_hf(prefix: str, rest: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    if rest in _LAYER:
        return {prefix + _LAYER[rest]: tensor}
    match = re.fullmatch(r"ffn\.experts\.(w[123])", rest)
    if match:
        kind = _EXPERT[match.group(1)]
        return {f"{prefix}mlp.experts.{j}.{kind}.weight": w for j, w in enumerate(tensor)}
    return {}  # buffers that are not weights (load counters)


def from_hf(hf: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """HF checkpoint tensors (per-expert or fused layout) -> our state dict."""
    inverse_top = {v: k for k, v in _TOP.items()}
    inverse_layer = {v: k for k, v in _LAYER.items()}
    inverse_mtp = {v: k for k, v in _MTP.items()}
    out: dict[str, torch.Tensor] = {}
    experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    for name, tensor in hf.items():
        if name in inverse_top:
            out[inverse_top[name]] = tensor
            continue
        match = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
        if not match:
            continue
        index, rest = int(match.group(1)), match.group(2)
        ours = _our_prefix(index, args)
        if index >= args.num_layers and rest in _MTP_COPIES:
            continue  # the embedding's and head's copies (with_mtp_copies)
        if index >= args.num_layers and rest in inverse_mtp:
            out[ours.removesuffix("block.") + inverse_mtp[rest]] = tensor
        elif rest in inverse_layer:
            out[ours + inverse_layer[rest]] = tensor
        elif m := re.fullmatch(r"mlp\.experts\.(\d+)\.(\w+)\.weight", rest):
            experts.setdefault((ours, m.group(2)), {})[int(m.group(1))] = tensor
        elif rest == "mlp.experts.gate_up_proj":
            out[ours + "ffn.experts.w1"], out[ours + "ffn.experts.w3"] = tensor.chunk(2, dim=1)
        elif rest == "mlp.experts.down_proj":
            out[ours + "ffn.experts.w2"] = tensor
    inverse_expert = {v: k for k, v in _EXPERT.items()}
    for (ours, kind), by_index in experts.items():
        stacked = torch.stack([by_index[j] for j in sorted(by_index)])
        out[f"{ours}ffn.experts.{inverse_expert[kind]}"] = stacked
    for name in [n for n in out if n.endswith("ffn.router.gate.weight")]:
        # DeepseekV2 checkpoints have no balancing bias: it starts at zero.
        bias = name.replace("gate.weight", "expert_bias")
        out.setdefault(bias, torch.zeros(out[name].size(0), dtype=torch.float32))
    return out


def _our_prefix(index: int, args: ModelArgs) -> str:
    if index < args.num_layers:
        return f"layers.{index}."
    return f"mtp.{index - args.num_layers + 1}.block."


def hf_config(args: ModelArgs) -> dict:
    """config.json for the HF model that matches `args` (DeepseekV3 for sigmoid routing, else
    DeepseekV2)."""
    v3 = args.score_func == "sigmoid"
    config = {
        "architectures": ["DeepseekV3ForCausalLM" if v3 else "DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v3" if v3 else "deepseek_v2",
        "vocab_size": args.vocab_size,
        "hidden_size": args.dim,
        "intermediate_size": args.inter_dim,
        "moe_intermediate_size": args.moe_inter_dim,
        "num_hidden_layers": args.num_layers,
        "num_attention_heads": args.num_heads,
        "num_key_value_heads": args.num_heads,
        "n_shared_experts": args.num_shared_experts,
        "n_routed_experts": args.num_routed_experts,
        "num_experts_per_tok": args.num_activated_experts,
        "routed_scaling_factor": args.route_scale,
        "kv_lora_rank": args.kv_lora_rank,
        "q_lora_rank": args.q_lora_rank or None,
        "qk_rope_head_dim": args.qk_rope_head_dim,
        "qk_nope_head_dim": args.qk_nope_head_dim,
        "v_head_dim": args.v_head_dim,
        "n_group": args.n_group,
        "topk_group": args.topk_group,
        "first_k_dense_replace": args.first_k_dense if args.num_routed_experts else args.num_layers,
        "norm_topk_prob": args.norm_topk_prob,
        "scoring_func": args.score_func,
        "topk_method": "noaux_tc"
        if v3
        else ("group_limited_greedy" if args.n_group > 1 else "greedy"),
        "aux_loss_alpha": args.aux_loss_alpha,
        "seq_aux": args.seq_aux,
        "moe_layer_freq": 1,
        "ep_size": 1,
        "num_nextn_predict_layers": args.num_mtp_modules,
        "max_position_embeddings": args.max_seq_len,
        "rms_norm_eps": args.norm_eps,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "attention_bias": False,
        "rope_theta": args.rope_theta,
        "rope_interleave": True,
    }
    if args.rope_factor > 1:
        config["rope_scaling"] = {
            "type": "yarn",
            "rope_type": "yarn",
            "factor": args.rope_factor,
            "original_max_position_embeddings": args.original_seq_len,
            "beta_fast": args.beta_fast,
            "beta_slow": args.beta_slow,
            "mscale": args.mscale,
            "mscale_all_dim": args.mscale_all_dim,
        }
    return config


def check_exportable(args: ModelArgs) -> None:
    if args.attention != "mla" or args.mlp != "swiglu":
        raise UserError(
            "HF export covers the DeepseekV2/V3 architectures (MLA + SwiGLU)",
            "export MLA models only; multi-head flavors have no DeepseekV3 layout",
            exit_code=1,
        )


def save_hf_checkpoint(state: dict[str, torch.Tensor], args: ModelArgs, out_dir: Path) -> None:
    """config.json + model.safetensors that `transformers` loads with from_pretrained."""
    from safetensors.torch import save_file

    check_exportable(args)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().cpu() for k, v in with_mtp_copies(to_hf(state, args), args).items()}
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(hf_config(args), indent=2) + "\n")


def load_hf_checkpoint(folder: Path) -> tuple[ModelArgs, dict[str, torch.Tensor]]:
    """ModelArgs and our state dict from a HF checkpoint folder (single or sharded safetensors)."""
    from safetensors.torch import load_file

    args = read_hf_config(folder)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise UserError(f"no .safetensors files in {folder}", "point at a HF checkpoint folder")
    hf: dict[str, torch.Tensor] = {}
    for file in files:
        hf.update(load_file(str(file)))
    return args, from_hf(hf, args)
