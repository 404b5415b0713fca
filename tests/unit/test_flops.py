"""Parameter counts and FLOPs against the published DeepSeek figures and hand-counted toys."""

import subprocess
import sys

import pytest

from dstrain.config.flavors import FLAVORS
from dstrain.config.model_args import ModelArgs
from dstrain.model.flops import (
    ParamCounts,
    attention_forward_flops_per_token,
    describe,
    forward_flops_per_token,
    matmul_params_per_token,
    param_counts,
    training_flops_per_token,
)

B = 1e9

# Toy MLA + MoE + MTP model, small enough to count every weight by hand below.
TINY_MLA = ModelArgs(
    vocab_size=10,
    dim=4,
    num_layers=2,
    num_heads=2,
    q_lora_rank=3,
    kv_lora_rank=2,
    qk_nope_head_dim=2,
    qk_rope_head_dim=1,
    v_head_dim=2,
    inter_dim=5,
    first_k_dense=1,
    num_routed_experts=4,
    num_shared_experts=1,
    num_activated_experts=2,
    moe_inter_dim=3,
    n_group=1,
    topk_group=1,
    num_mtp_modules=1,
)

# Toy dense model: grouped-query MHA, GELU FFN, no MTP.
TINY_MHA = ModelArgs(
    vocab_size=10,
    dim=8,
    num_layers=2,
    num_heads=4,
    attention="mha",
    num_kv_heads=2,
    mlp="gelu",
    inter_dim=6,
    first_k_dense=2,
    num_routed_experts=0,
    num_shared_experts=0,
    num_activated_experts=0,
    n_group=1,
    topk_group=1,
    num_mtp_modules=0,
)


def _rel(value: float, published: float) -> float:
    return abs(value / published - 1)


# --- Published figures ------------------------------------------------------------------------


def test_deepseek_v3_total_is_671b_without_mtp():
    # DeepSeek-V3 technical report (arXiv 2412.19437) sec. 4.2: "671B total parameters".
    counts = param_counts(FLAVORS["deepseek-v3"])
    assert round(counts.main_model_total / B) == 671  # 671.03B: matches to 0.005%
    assert counts.total == counts.main_model_total + counts.mtp


def test_deepseek_v3_hf_685b_counts_the_mtp_copy_of_embedding_and_head():
    # HF model card: 685B = 671B main model + 14B MTP module. Our MTP module shares the embedding
    # and head (11.6B of its own), but the checkpoint's layer 61 stores its own copies of both, so
    # the checkpoint holds 684.5B, which HF rounds to 685B.
    args = FLAVORS["deepseek-v3"]
    counts = param_counts(args)
    in_checkpoint = counts.total + args.num_mtp_modules * (counts.embedding + counts.head)
    assert _rel(in_checkpoint, 685 * B) < 0.001


def test_deepseek_v3_activated_is_37b():
    # Report sec. 4.2: "37B are activated for each token". We count 37.55B with the embedding and
    # head (the convention that gives DeepSeekMoE-16B its 2.8B); without the embedding it would be
    # 36.63B, 1.0% low. Neither is within 1%. The figure looks truncated (DeepSeek-V2's 21.4B, same
    # convention, is quoted as "21B"), so: the integer part, and 1.5%.
    activated = param_counts(FLAVORS["deepseek-v3"]).activated
    assert int(activated / B) == 37
    assert _rel(activated, 37 * B) < 0.015


def test_deepseek_v2_lite_total_15_7b():
    # DeepSeek-V2 report (arXiv 2405.04434), appendix B: "15.7B total parameters".
    total = param_counts(FLAVORS["deepseek-v2-lite"]).main_model_total
    assert _rel(total, 15.7 * B) < 0.002  # 15.706B


def test_deepseek_v2_lite_activated_is_not_reproduced_by_the_shared_convention():
    # Appendix B says "2.4B activated". The convention that reproduces V3, DeepSeekMoE-16B and
    # LLM-7B (embedding and head counted) gives 2.66B; excluding both gives 2.24B, excluding only
    # the embedding 2.45B. No single convention fits all four papers, and the same 2.6B was
    # raised in deepseek-ai/DeepSeek-V2 issue #73 without an answer. The honest tolerance: 11%.
    activated = param_counts(FLAVORS["deepseek-v2-lite"]).activated
    assert _rel(activated, 2.4 * B) < 0.11


def test_deepseek_moe_16b_total_16_4b_activated_2_8b():
    # DeepSeekMoE (arXiv 2401.06066), DeepSeekMoE 16B: 16.4B total, 2.8B activated.
    counts = param_counts(FLAVORS["deepseek-moe-16b"])
    print(f"DeepSeekMoE 16B: total rel {_rel(counts.main_model_total, 16.4 * B):.2%}")
    # 16.38B: measured 0.15 % (integer arithmetic, the same on every CPU); bound 0.5 %.
    assert _rel(counts.main_model_total, 16.4 * B) < 0.005
    assert _rel(counts.activated, 2.8 * B) < 0.02  # 2.83B


def test_deepseek_llm_7b_is_6_9b_dense():
    # DeepSeek LLM (arXiv 2401.02954); the HF model has 6.91B parameters.
    counts = param_counts(FLAVORS["deepseek-llm-7b"])
    assert _rel(counts.total, 6.91 * B) < 0.001
    assert counts.activated == counts.total


def test_describe_deepseek_v3():
    counts = param_counts(FLAVORS["deepseek-v3"])
    assert describe(counts) == "671.0B total, 37.6B activated (+11.6B MTP)"


# --- Hand-counted toy models ------------------------------------------------------------------


def test_tiny_mla_params_term_by_term():
    counts = param_counts(TINY_MLA)
    expected = ParamCounts(
        embedding=10 * 4,
        head=10 * 4,
        # wq_a 3*4 + wq_b (2*3)*3 + wkv_a (2+1)*4 + wkv_b 2*(2+2)*2 + wo 4*(2*2), two layers
        attention=2 * (12 + 18 + 12 + 16 + 16),
        # attention_norm 4 + ffn_norm 4 + q_norm 3 + kv_norm 2 per layer, final norm 4
        norms=2 * (4 + 4 + 3 + 2) + 4,
        dense_ffn=3 * 4 * 5,  # layer 0 only
        routed_experts=4 * (3 * 4 * 3),  # layer 1: 4 experts of 36
        activated_routed_experts=2 * 36,
        shared_experts=36,
        router=4 * 4,
        main_model_total=40 + 40 + 148 + 30 + 60 + 144 + 36 + 16,
        activated=514 - 144 + 72,
        # enorm 4 + hnorm 4 + output norm 4 + proj 2*4*4 + block (74 + 13 + 144 + 36 + 16)
        mtp=4 + 4 + 4 + 32 + 283,
        mtp_activated=327 - 144 + 72,
        total=514 + 327,
    )
    assert counts == expected


def test_tiny_mla_flops_term_by_term():
    seq_len = 8
    # Main: attention 148 + dense 60 + top-2 experts 72 + shared 36 + router 16 + head 40.
    # MTP: block 74 + 72 + 36 + 16, proj 32, its own head application 40.
    assert matmul_params_per_token(TINY_MLA) == 372 + 270
    # 2 heads * (qk 2+1 + v 2) * 2 FLOPs * average context 8/2, in 2 layers + 1 MTP block.
    assert attention_forward_flops_per_token(TINY_MLA, seq_len) == 3 * (2 * 2 * 5 * 4)
    assert forward_flops_per_token(TINY_MLA, seq_len) == 2 * 642 + 240
    assert training_flops_per_token(TINY_MLA, seq_len) == 3 * 1524


def test_tiny_mha_dense_term_by_term():
    counts = param_counts(TINY_MHA)
    # head_dim 8/4 = 2: wq 8*8 + wk (2*2)*8 + wv 32 + wo 64, two layers
    assert counts.attention == 2 * (64 + 32 + 32 + 64)
    assert counts.dense_ffn == 2 * (2 * 8 * 6)  # GELU: w1 and w2 only
    assert counts.norms == 2 * (8 + 8) + 8
    assert counts.total == counts.activated == 80 + 80 + 384 + 192 + 40
    # matmuls 384 + 192 + head 80; attention 2 layers * 4 heads * (2 + 2) * 2 * 6/2
    assert forward_flops_per_token(TINY_MHA, 6) == 2 * 656 + 2 * (2 * 4 * 4 * 3)


# --- Properties -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(FLAVORS))
def test_activated_at_most_total(name):
    counts = param_counts(FLAVORS[name])
    assert 0 < counts.activated <= counts.main_model_total <= counts.total
    assert counts.mtp_activated <= counts.mtp


@pytest.mark.parametrize("name", list(FLAVORS))
def test_parts_sum_to_total(name):
    c = param_counts(FLAVORS[name])
    parts = (c.embedding, c.head, c.attention, c.dense_ffn, c.routed_experts)
    rest = (c.shared_experts, c.router, c.norms)
    assert sum(parts) + sum(rest) == c.main_model_total


@pytest.mark.parametrize("name", [n for n, a in FLAVORS.items() if a.num_mtp_modules == 0])
def test_training_flops_are_6n_plus_attention(name):
    # Kaplan et al. / PaLM appendix B: 6 * N (activated, without the embedding lookup) + attention.
    args = FLAVORS[name]
    counts = param_counts(args)
    attention = 3 * attention_forward_flops_per_token(args, 4096)
    flops = training_flops_per_token(args, 4096)
    # Exact once the norms (elementwise, not matmuls) are taken out of N; they are < 0.01% of it.
    assert flops == 6 * (counts.activated_non_embedding - counts.norms) + attention
    assert _rel(flops, 6 * counts.activated_non_embedding + attention) < 1e-4


def test_attention_term_is_half_of_deepseek_llm_m():
    # DeepSeek LLM (arXiv 2401.02954) sec. 3.1 counts 12 * n_layer * d_model * l_seq per token for
    # full (non-causal) attention; our causal average context halves it.
    args = FLAVORS["deepseek-llm-7b"]
    seq_len = 4096
    full = 12 * args.num_layers * args.dim * seq_len
    assert 3 * attention_forward_flops_per_token(args, seq_len) == full / 2


@pytest.mark.parametrize("name", list(FLAVORS))
def test_flops_grow_with_seq_len_only_through_attention(name):
    args = FLAVORS[name]
    f1, f2, f3 = (training_flops_per_token(args, s) for s in (1024, 2048, 3072))
    assert f2 > f1 and f3 - f2 == pytest.approx(f2 - f1)  # linear in seq_len
    attn1, attn2 = (3 * attention_forward_flops_per_token(args, s) for s in (1024, 2048))
    assert f2 - f1 == pytest.approx(attn2 - attn1)


def test_mtp_adds_its_block_proj_and_head():
    args = FLAVORS["deepseek-v3"]
    without = args.model_copy(update={"num_mtp_modules": 0})
    counts = param_counts(args)
    added = training_flops_per_token(args, 4096) - training_flops_per_token(without, 4096)
    one_layer_attention = 3 * attention_forward_flops_per_token(without, 4096) / args.num_layers
    mtp_norms = 3 * args.dim + (2 * args.dim + args.q_lora_rank + args.kv_lora_rank)
    matmuls = counts.mtp_activated - mtp_norms + counts.head  # plus one more head application
    assert added == pytest.approx(6 * matmuls + one_layer_attention)
    assert param_counts(without).main_model_total == counts.main_model_total


def test_seq_len_must_be_positive():
    with pytest.raises(ValueError, match="seq_len"):
        training_flops_per_token(TINY_MLA, 0)


@pytest.mark.parametrize(
    "args", [TINY_MLA, TINY_MHA, FLAVORS["deepseek-v3"]], ids=["tiny-mla", "tiny-mha", "v3"]
)
def test_counts_match_the_built_model(args):
    # The formulas must describe the network dstrain/model builds; meta tensors cost no memory.
    torch = pytest.importorskip("torch")
    from dstrain.model.transformer import Transformer

    with torch.device("meta"):
        model = Transformer(args)
    counts = param_counts(args)
    assert sum(p.numel() for p in model.parameters()) == counts.total
    mtp = sum(p.numel() for p in model.mtp.parameters()) if model.mtp is not None else 0
    assert mtp == counts.mtp


def test_flops_module_imports_no_torch():
    # The planner and `dstrain check` run this on a laptop without torch.
    code = "import sys, dstrain.model.flops; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
