"""Tiny random Hugging Face DeepSeek checkpoints the tests build themselves (no download): a
DeepseekV3 and a DeepseekV2 from transformers, saved with `save_pretrained` in fp32 or bf16, and
an FP8 copy quantised here as DeepSeek-V3's release is (e4m3 weights, one fp32 `weight_scale_inv`
per block, blocks that do not divide the shape included), and the reference loss transformers
computes on a batch."""

import copy
import json
import math
from pathlib import Path

import torch

E4M3_MAX = 448.0
# Shapes no power-of-two block divides: 96 x 64, 40 x 64, 64 x 48, 24 x 64 ...
TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=24,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_shared_experts=1,
    n_routed_experts=8,
    kv_lora_rank=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    qk_nope_head_dim=16,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
    max_position_embeddings=64,
    num_nextn_predict_layers=0,
)
KINDS = {
    "v3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        dict(q_lora_rank=24, n_group=4, topk_group=2),
    ),
    "v2": (
        "DeepseekV2Config",
        "DeepseekV2ForCausalLM",
        dict(q_lora_rank=None, topk_method="greedy", n_group=1, topk_group=1),
    ),
}
# What DeepSeek-V3's release keeps in bf16: embedding, head, norms, the router's gate.
NOT_QUANTISED = ("embed_tokens", "lm_head", "norm", "mlp.gate.weight", "e_score_correction")


def hf_model(kind: str = "v3"):
    import transformers

    config_cls, model_cls, extra = KINDS[kind]
    config = getattr(transformers, config_cls)(**TINY, **extra)
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():  # nonzero balancing biases, so their mapping is tested too
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn_like(buffer) * 0.1)
    return model


def save(model, folder: Path, dtype: torch.dtype = torch.float32) -> Path:
    copy.deepcopy(model).to(dtype).save_pretrained(folder)
    return folder


def quantise_block(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weights, fp32 scale_inv [ceil(R/b), ceil(C/b)]): per block, scale = amax / 448."""
    rows, cols = w.shape
    grid = (math.ceil(rows / block), math.ceil(cols / block))
    padded = torch.zeros(grid[0] * block, grid[1] * block, dtype=torch.float64)
    padded[:rows, :cols] = w.double()
    tiles = padded.view(grid[0], block, grid[1], block)
    amax = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale = amax / E4M3_MAX
    q = (tiles / scale[:, None, :, None]).view_as(padded)[:rows, :cols]
    return q.to(torch.float8_e4m3fn), scale.float()


def dequantise_block(q: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    """The fp64 reference: each element times its block's scale."""
    grid = scale.double().repeat_interleave(block, 0).repeat_interleave(block, 1)
    return q.double() * grid[: q.size(0), : q.size(1)]


def save_fp8(model, folder: Path, block: int) -> Path:
    """`model` as DeepSeek-V3 ships: quantisable weights in e4m3 with `weight_scale_inv`, the
    rest in bf16, per-expert tensors, config.json with quantization_config."""
    from safetensors.torch import load_file, save_file

    from dstrain.config.hf_config import read_hf_config
    from dstrain.model.hf_adapter import from_hf, to_hf

    save(model, folder)  # config.json and the fp32 tensors
    tensors = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
        file.unlink()
    # The release's layout: one 2-D tensor per expert (transformers saves them fused).
    args = read_hf_config(folder)
    tensors = to_hf(from_hf(tensors, args), args)
    out = {}
    for name, w in tensors.items():
        if w.dim() == 2 and not any(k in name for k in NOT_QUANTISED):
            out[name], out[name + "_scale_inv"] = quantise_block(w, block)
        else:
            out[name] = w.to(torch.bfloat16)
    save_file(out, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [block, block],
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def hf_loss(model, batches: list[torch.Tensor]) -> float:
    """transformers' mean next-token loss over all target tokens of `batches` ([B, S+1] each)."""
    total, count = 0.0, 0
    with torch.no_grad():
        for batch in batches:
            logits = model(input_ids=batch[:, :-1]).logits.double()
            targets = batch[:, 1:]
            total += torch.nn.functional.cross_entropy(
                logits.flatten(0, 1), targets.flatten(), reduction="sum"
            ).item()
            count += targets.numel()
    return total / count


def fuse_experts(tensors: dict) -> dict:
    """Per-expert checkpoint tensors (`mlp.experts.{j}.gate_proj.weight`, as DeepSeek publishes
    them) in the fused layout transformers keeps in memory and some exports write:
    `mlp.experts.gate_up_proj` [E, 2F, D] and `mlp.experts.down_proj` [E, D, F]."""
    import re
    from collections import defaultdict

    experts: dict = defaultdict(dict)
    fused = {}
    for name, tensor in tensors.items():
        match = re.fullmatch(r"(.*\.mlp\.experts)\.(\d+)\.(\w+)\.weight", name)
        if match is None:
            fused[name] = tensor
        else:
            experts[match.group(1)][(int(match.group(2)), match.group(3))] = tensor
    for prefix, parts in experts.items():
        count = 1 + max(j for j, _ in parts)
        fused[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([parts[j, "gate_proj"], parts[j, "up_proj"]]) for j in range(count)]
        )
        fused[f"{prefix}.down_proj"] = torch.stack([parts[j, "down_proj"] for j in range(count)])
    return fused
