"""train.precision = fp8: what `check` says and what the runtime does, on a CPU (dry runs on the
fake backend for the tensor-parallel refusal)."""

import pytest
import torch

from dstrain.config.flavors import flavor_args
from dstrain.config.load import load_config
from dstrain.errors import UserError
from dstrain.model import fp8
from dstrain.model.fp8_linear import Fp8Linear, apply_fp8, fp8_linears
from dstrain.model.moe import GroupedExperts
from dstrain.model.transformer import build_model
from dstrain.preflight import rules
from dstrain.preflight.preflight import preflight
from dstrain.train.dry_run import dry_run_rank
from dstrain.train.precision import configure_precision

WIDE = [
    "model.qk_nope_head_dim=64",
    "model.qk_rope_head_dim=64",
    "model.v_head_dim=64",
    "model.inter_dim=256",
    "model.moe_inter_dim=256",
]


def test_the_recipe_converts_attention_ffn_mtp_and_experts_but_not_head_router_embedding():
    model = build_model(flavor_args("debug"), device="meta")
    changed = apply_fp8(model, "emulated")
    names = {name for name, _ in fp8_linears(model)}
    assert {"layers.0.attention.wq_a", "layers.0.ffn.w2", "layers.1.ffn.shared_experts.w2"} <= names
    assert "mtp.1.proj" in names
    assert not any("gate" in n or n == "head" for n in names)
    assert type(model.head) is torch.nn.Linear and type(model.embed) is torch.nn.Embedding
    experts = [m for m in model.modules() if isinstance(m, GroupedExperts)]
    assert experts and all(m.fp8_backend == "emulated" for m in experts)
    assert changed == len(names) + len(experts)
    assert all(isinstance(m, Fp8Linear) for _, m in fp8_linears(model))


def test_an_fp8_model_trains_a_step_and_its_gradients_are_fp32():
    torch.manual_seed(0)
    model = build_model(flavor_args("debug"), device="cpu", seed=0)
    apply_fp8(model, "emulated")
    tokens = torch.randint(0, model.args.vocab_size, (2, 32))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(tokens)[0]
    logits.float().logsumexp(-1).mean().backward()
    wq = model.layers["0"].attention.wq_a.weight
    assert wq.dtype == torch.float32 and wq.grad.dtype == torch.float32
    assert wq.grad.abs().sum() > 0
    expert = next(m for m in model.modules() if isinstance(m, GroupedExperts))
    assert expert.w1.grad is not None and expert.w1.grad.abs().sum() > 0


def _check_errors(*sets, world=2):
    loaded = load_config(None, ["train.precision=fp8", *sets])
    return [f for f in preflight(loaded, world) if f.severity == "error"]


MHA = ["model.attention=mha", *WIDE]


@pytest.mark.parametrize(
    "sets, refused",
    [
        (["parallel.tp=2"], "attention wq_b (192 wide)"),  # the debug model's: 96 per rank
        (["parallel.tp=2", *WIDE], None),
        (["parallel.tp=2", *WIDE, "model.inter_dim=384"], "dense FFN w1/w2/w3 (384 wide)"),
        (["parallel.dp_shard=2"], None),
        (["parallel.tp=2", *MHA], "attention wq/wo (128 wide)"),  # 4 heads of 32
        (["parallel.tp=2", *MHA, "model.dim=512"], None),  # 4 heads of 128
    ],
)
def test_check_and_the_runtime_agree_on_tensor_parallel_widths(monkeypatch, sets, refused):
    errors = _check_errors(*sets)
    assert bool(errors) == bool(refused), [e.message for e in errors]
    if refused:
        assert errors[0].key == "parallel.tp" and "multiple of 128" in errors[0].message
        assert refused in errors[0].message, errors[0].message
        # tp divides the width, so the layout is sound: the whole-tile shards are dstrain's own
        assert errors[0].trainer_limit
    # The runtime's own refusal (parallel/fp8_tp.py), with the check's rule taken out.
    monkeypatch.setattr(
        rules, "RULES", [r for r in rules.RULES if r is not rules.rule_fp8_tensor_parallel]
    )
    config = load_config(None, ["train.precision=fp8", "train.precision=fp8", *sets]).config
    if refused:
        with pytest.raises(UserError, match="not a multiple of 128"):
            dry_run_rank(config, 2, 0, step=False)
    else:
        dry_run_rank(config, 2, 1, step=False)


def test_a_gpu_without_the_blockwise_kernel_is_an_error_unless_emulation_is_allowed():
    (error,) = _check_errors("cluster.gpu=A100-80GB", world=1)
    assert "no FP8 tensor cores" in error.message and "fp8_backend = emulated" in error.fix
    assert "RTX4090" in _check_errors("cluster.gpu=RTX4090", world=1)[0].message
    assert not _check_errors("cluster.gpu=H100", world=1)
    loaded = load_config(
        None, ["train.precision=fp8", "cluster.gpu=A100-80GB", "train.fp8_backend=emulated"]
    )
    findings = preflight(loaded, 1)
    assert not [f for f in findings if f.severity == "error"]
    assert any(f.severity == "warning" and f.key == "train.fp8_backend" for f in findings)


@pytest.mark.parametrize(
    ("capability", "cuda", "refused"),
    [
        ((9, 0), "12.9", None),  # H100/H200/H800 with torch's CUDA 12.9 build: the kernel runs
        ((9, 0), "13.0", None),
        ((9, 0), "12.8", "CUDA 12.8"),
        ((8, 0), "12.9", "compute capability 8.0"),  # A100
        ((10, 0), "12.9", "compute capability 10.0"),  # Blackwell: another kernel
    ],
)
def test_the_blockwise_kernel_needs_sm90_and_cuda_12_9(monkeypatch, capability, cuda, refused):
    """Judged from the GPU's capability and torch's CUDA build alone (no GPU needed)."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "GPU")
    monkeypatch.setattr(torch.version, "cuda", cuda)
    reason = fp8.blockwise_kernel_reason(torch.device("cuda", 0))
    assert reason is None if refused is None else refused in reason, reason


def test_the_trainer_logs_the_backend_and_counts_mfu_against_what_runs():
    args = flavor_args("debug")
    setup = configure_precision("fp8", None, torch.device("cpu"), args)
    assert setup.fp8_backend == "emulated" and setup.peak_kind == "fp32"
    assert "emulated" in setup.describe() and setup.warning is None
    with pytest.raises(UserError, match="blockwise kernel"):
        configure_precision("fp8", None, torch.device("cpu"), args, "scaled_mm")
    with pytest.raises(UserError, match="tf32"):
        configure_precision("fp8", True, torch.device("cpu"), args)
