"""The whole decoder: output shapes, build_model (meta -> to_empty -> init_parameters), parameter
count against flops.param_counts, and multi-token prediction (DeepSeek-V3 section 2.2)."""

import math

import pytest
import torch

from dstrain.config.model_args import ModelArgs
from dstrain.model.flops import param_counts
from dstrain.model.init import INIT_STD
from dstrain.model.moe import MoE
from dstrain.model.norm import RMSNorm
from dstrain.model.transformer import Transformer, build_model

# vocab_size differs from every other width, so a vocabulary-sized tensor is the embedding/head.
BASE = ModelArgs(
    vocab_size=80,
    dim=32,
    num_layers=2,
    num_heads=2,
    q_lora_rank=16,
    kv_lora_rank=12,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=8,
    inter_dim=48,
    first_k_dense=1,
    num_routed_experts=8,
    num_shared_experts=1,
    num_activated_experts=2,
    moe_inter_dim=16,
    n_group=2,
    topk_group=1,
    num_mtp_modules=2,
    max_seq_len=32,
    original_seq_len=32,
)
B, S = 2, 9


def _with(args: ModelArgs, **changes) -> ModelArgs:
    return ModelArgs.model_validate({**args.model_dump(), **changes})


VARIANTS = {
    "mla-moe-mtp2": BASE,
    "mla-no-q-lora": _with(BASE, q_lora_rank=0, num_mtp_modules=1),
    "mla-yarn": _with(BASE, rope_factor=4.0, original_seq_len=8, mscale_all_dim=1.0),
    "mha-gqa-dense-gelu": _with(
        BASE,
        attention="mha",
        num_kv_heads=1,
        head_dim=8,
        mlp="gelu",
        first_k_dense=2,
        num_routed_experts=0,
        num_shared_experts=0,
        num_activated_experts=0,
        n_group=1,
        num_mtp_modules=0,
    ),
    "mha-moe-softmax": _with(
        BASE, attention="mha", score_func="softmax", n_group=1, num_mtp_modules=1
    ),
}


def _tokens(seed: int = 0, vocab: int = BASE.vocab_size) -> torch.Tensor:
    return torch.randint(0, vocab, (B, S), generator=torch.Generator().manual_seed(seed))


def _built(args: ModelArgs, dtype: torch.dtype = torch.float32, seed: int = 0) -> Transformer:
    return build_model(args, seed=seed).to(dtype).eval()


@pytest.mark.parametrize("name", list(VARIANTS))
def test_forward_shapes(name):
    args = VARIANTS[name]
    out = _built(args)(_tokens())
    outputs = out if isinstance(out, tuple) else (out,)
    assert len(outputs) == 1 + args.num_mtp_modules
    for depth, logits in enumerate(outputs):  # depth 0: the main model
        assert logits.shape == (B, S - depth, args.vocab_size)
        assert torch.isfinite(logits).all()


def test_without_mtp_forward_returns_a_tensor():
    out = _built(_with(BASE, num_mtp_modules=0))(_tokens())
    assert isinstance(out, torch.Tensor) and out.shape == (B, S, BASE.vocab_size)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_build_model_materializes_and_initializes(name):
    args = VARIANTS[name]
    model = build_model(args)
    assert all(t.device.type == "cpu" for t in (*model.parameters(), *model.buffers()))
    assert all(torch.isfinite(p).all() for p in model.parameters())
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    assert norms and all(torch.equal(n.weight, torch.ones_like(n.weight)) for n in norms)
    for moe in (m for m in model.modules() if isinstance(m, MoE)):
        assert torch.equal(moe.router.expert_bias, torch.zeros(args.num_routed_experts))
        assert torch.equal(moe.router.tokens_per_expert, torch.zeros(args.num_routed_experts))
    # Projections are truncated normals: std 0.02, output projections (wo, w2) scaled by
    # 1/sqrt(2 layers), both cut at 3 std.
    out_std = INIT_STD / math.sqrt(2 * args.num_layers)
    for pname, p in model.named_parameters():
        if pname.endswith(("wo.weight", "w2.weight", "experts.w2")):
            assert p.abs().max() <= 3 * out_std, pname
        elif p.dim() >= 2 and not pname.startswith("embed"):
            assert 3 * out_std < p.abs().max() <= 3 * INIT_STD, pname
    # RoPE tables are rebuilt after to_empty (they are buffers, not checkpointed).
    fresh = Transformer(args).rope
    assert torch.equal(model.rope.cos, fresh.cos) and torch.equal(model.rope.sin, fresh.sin)


def test_last_aux_loss_is_readable_after_build_model():
    model = build_model(_with(BASE, aux_loss_alpha=0.01))
    assert all(m.last_aux_loss.item() == 0.0 for m in model.modules() if isinstance(m, MoE))


@pytest.mark.parametrize("name", list(VARIANTS))
def test_built_model_parameter_count_matches_flops(name):
    args = VARIANTS[name]
    model = build_model(args)
    counts = param_counts(args)
    assert sum(p.numel() for p in model.parameters()) == counts.total
    # Buffers (RoPE tables, balancing bias, load counts) are not parameters.
    assert not any("expert_bias" in n or "rope" in n for n, _ in model.named_parameters())


def test_build_model_gives_finite_logits_that_depend_on_the_tokens():
    model = _built(BASE)
    logits, *_ = model(_tokens(0))
    other, *_ = model(_tokens(1))
    assert torch.isfinite(logits).all()
    assert not torch.allclose(logits, other)


# --- Multi-token prediction ---------------------------------------------------------------------


@pytest.mark.parametrize("j", [2, 5, S - 1])
def test_mtp_depth_k_at_position_i_sees_only_tokens_up_to_i_plus_k(j):
    """Perturb token j: the main logits at i < j and MTP depth k logits at i < j - k stay put
    (within fp64 rounding: the MoE regroups its sorted tokens), the others move."""
    model = _built(BASE, torch.float64)
    tokens = _tokens()
    changed = tokens.clone()
    changed[:, j] = (changed[:, j] + 1) % BASE.vocab_size
    with torch.no_grad():
        before, after = model(tokens), model(changed)
    for k, (a, b) in enumerate(zip(before, after, strict=True)):  # k = 0: the main model
        diff = (a - b).abs().amax(-1)  # [B, S - k]
        first_affected = max(j - k, 0)
        assert (diff[:, :first_affected] < 1e-12).all(), (k, diff)
        assert (diff[:, first_affected] > 1e-6).all(), (k, diff)


def test_mtp_shares_the_embedding_and_the_head():
    model = _built(BASE)
    assert not any(isinstance(m, torch.nn.Embedding) for m in model.mtp.modules())
    assert all(BASE.vocab_size not in p.shape for p in model.mtp.parameters())
    with torch.no_grad():
        model.head.weight.zero_()
    _, *mtp_logits = model(_tokens())
    assert all(torch.equal(logits, torch.zeros_like(logits)) for logits in mtp_logits)


def test_mtp_modules_combine_depth_k_minus_1_states_with_the_embedding_of_token_i_plus_k():
    """V3 eq. 21-23, written out: h^k_i = TRM_k(M_k [RMSNorm(Emb(t_{i+k})); RMSNorm(h^{k-1}_i)]),
    logits^k_i = Head(RMSNorm(h^k_i)), h^0 the main model's last hidden state. The embedding
    comes first in the concatenation, as in the published checkpoint's eh_proj (the paper's
    notation lists h first; the learned M_k absorbs the order)."""
    model = _built(BASE, torch.float64)
    tokens = _tokens()
    with torch.no_grad():
        _, *mtp_logits = model(tokens)
        emb = model.embed(tokens)
        cos, sin = model.rope(S)
        h = emb
        for layer in model.layers.values():
            h = layer(h, cos, sin)
        for k, module in model.mtp.items():
            k = int(k)
            length = S - k
            h_in = module.proj(
                torch.cat([module.enorm(emb[:, k:]), module.hnorm(h[:, :length])], -1)
            )
            h = module.block(h_in, cos[:length], sin[:length])
            expected = model.head(module.norm(h))
            torch.testing.assert_close(mtp_logits[k - 1], expected, rtol=0, atol=1e-12)


def test_mtp_block_is_a_moe_layer_past_the_main_model():
    model = Transformer(BASE)
    for k, module in model.mtp.items():
        assert module.block.layer_id == BASE.num_layers + int(k) - 1
        assert isinstance(module.block.ffn, MoE)
