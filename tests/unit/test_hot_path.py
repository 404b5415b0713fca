"""What a training step costs the host: its syncs (device -> host reads, each a stall on a GPU)
and its file writes, counted per step so that a new one shows up here.

Budgets, per optimizer step:
- syncs (`tests/device_check.py`: the step on `meta`, every `.item()`, `.tolist()` and copy to
  the host counted): one, the step's agreement (`train/agreement.py`: the global loss, gradient
  norm, fp16 overflow and preemption flags in one read); plus one under data parallelism, the
  global token counts (the loss's divisors, needed before the forward); plus, per MoE layer
  and micro-batch (`test_moe_host_syncs_per_step`), one split-size read where the experts
  cannot run on device offsets: under EP (all-to-all takes host split sizes; the same read
  brings the local experts' sizes), FP8 (no grouped blockwise kernel), and fp32 or fp16 on
  CUDA (`_grouped_mm` takes bf16 only there); none for bf16 without EP. Not counted: every
  `metrics.log_interval` steps the metrics line's gather;
- file writes: three heartbeat records (step, data, compute), each one `pwrite` in place; the
  metrics sinks write only every `metrics.log_interval` steps.
"""

import builtins
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from dstrain.config.load import load_config
from dstrain.config.schema import LossScaleConfig
from dstrain.model import moe
from dstrain.model.fp8_linear import apply_fp8
from dstrain.model.transformer import build_model
from dstrain.parallel.expert_parallel import apply_ep
from dstrain.train.loss_scale import LossScaler
from dstrain.train.step import DataParallel, train_step
from dstrain.train.trainer import Trainer
from tests.device_check import device_check
from tests.unit.tiny import tiny_args

STEPS = 3


@pytest.mark.parametrize(
    "dp, fp16, budget",
    [(1, False, 1), (1, True, 1), (2, False, 2), (2, True, 2)],
    ids=["one-process", "one-process-fp16", "dp2", "dp2-fp16"],
)
def test_host_syncs_per_step(dp, fp16, budget):
    with device_check(world_size=dp) as recorded:
        model = build_model(tiny_args(), device=None).to(torch.bfloat16)  # on meta
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        group = dist.group.WORLD if dp > 1 else None
        for _ in range(STEPS):
            batches = [torch.randint(0, 64, (2, 9)) for _ in range(2)]  # the loader's, on the host
            train_step(
                model,
                optimizer,
                batches,
                scaler=LossScaler(LossScaleConfig(), enabled=fp16),
                precision="fp32",
                grad_clip=1.0,
                mtp_weight=0.3,
                num_mtp=1,
                bias_update_speed=1e-3,
                dp=DataParallel(group, dp),
            )
    assert len(recorded.syncs) == budget * STEPS, recorded.syncs


MOE_STEPS, MICRO_BATCHES = 2, 2
# The tiny model's MoE layers, each run once per micro-batch: two main layers and the MTP block.
MOE_LAYERS = 3
PARAM_DTYPES = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp8": torch.bfloat16,  # FSDP2's bf16 copies, which the FP8 GEMMs quantise
}


class _BalancedRouting:
    """`.tolist()` answers for the meta run's split sizes, as if routing were balanced: they
    must add up to the rows they split (the last routing's top-k copies), which ones do not."""

    def __init__(self, num_experts: int, ep: int) -> None:
        self.num_experts, self.ep, self.rows = num_experts, ep, None

    def counting(self, original):
        def count(experts_TK, num_experts, rows_T=None):
            self.rows = experts_TK.numel()
            return original(experts_TK, num_experts, rows_T)

        return count

    def answer(self, t: torch.Tensor) -> list | None:
        if t.dtype != torch.int64 or self.rows is None:
            return None
        E, W, R = self.num_experts, self.ep, self.rows
        if t.numel() == E:  # counts per expert
            return _even(R, E)
        if W > 1 and t.numel() == 2 * W + E // W:  # EP: sent, received, local experts' rows
            return _even(R, W) * 2 + _even(R, E // W)
        return None


def _even(total: int, parts: int) -> list[int]:
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


@pytest.mark.parametrize("ep", [1, 2], ids=["no-ep", "ep2"])
@pytest.mark.parametrize("precision", list(PARAM_DTYPES))
def test_moe_host_syncs_per_step(precision, ep, monkeypatch):
    """Device-to-host reads of a MoE step on meta, which takes CUDA's path choices (meta is not
    the CPU): the budget of the module docstring. FP8 runs the `scaled_mm` backend, so torch's
    meta kernels judge every blockwise GEMM of the step too (`test_cuda_rules.py`)."""
    args = tiny_args()
    routing = _BalancedRouting(args.num_routed_experts, ep)
    monkeypatch.setattr(moe, "count_per_expert", routing.counting(moe.count_per_expert))
    with device_check(world_size=2, answer=routing.answer) as recorded:
        model = build_model(args, device=None).to(PARAM_DTYPES[precision])  # on meta
        if precision == "fp8":
            apply_fp8(model, "scaled_mm")
        if ep > 1:
            apply_ep(model, DeviceMesh("cpu", [0, 1]))
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        dp = DataParallel(dist.group.WORLD, 2) if ep > 1 else DataParallel(None, 1)
        for _ in range(MOE_STEPS):
            batches = [torch.randint(0, 64, (2, 9)) for _ in range(MICRO_BATCHES)]
            train_step(
                model,
                optimizer,
                batches,
                scaler=LossScaler(LossScaleConfig(), enabled=precision == "fp16"),
                precision="fp32",  # the parameters' own dtype: meta has no autocast
                grad_clip=1.0,
                mtp_weight=0.3,
                num_mtp=1,
                bias_update_speed=1e-3,
                dp=dp,
            )
    base = 2 if ep > 1 else 1  # the step's agreement, and under DP the token counts
    per_moe = 0 if (precision == "bf16" and ep == 1) else 1
    budget = base + per_moe * MOE_LAYERS * MICRO_BATCHES
    assert len(recorded.syncs) == budget * MOE_STEPS, recorded.syncs


def test_file_writes_per_step(tmp_path, monkeypatch):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(Path(torch.__file__).read_text() * 4)  # any text: torch's __init__.py
    overrides = [
        f"data.source={corpus}",
        f"data.cache_dir={tmp_path / 'cache'}",
        f"run.root={tmp_path}",
        "model.dim=32",
        "model.num_layers=2",
        "model.num_heads=2",
        "model.vocab_size=512",
        "train.seq_len=16",
        "train.micro_batch_size=2",
        "checkpoint.enable=false",
        "metrics.log_interval=1000",
        "metrics.tensorboard=false",
    ]
    trainer = Trainer(load_config(None, overrides).config)
    trainer._one_step()  # warm: the first step may open files once
    writes = []
    monkeypatch.setattr(os, "pwrite", _counted(os.pwrite, writes, "pwrite"))
    monkeypatch.setattr(os, "replace", _counted(os.replace, writes, "replace"))
    monkeypatch.setattr(builtins, "open", _counted_open(builtins.open, writes))
    for _ in range(STEPS):
        trainer.heartbeat.beat(trainer.step, "step")  # what the loop beats before each step
        trainer._one_step()
    assert writes == ["pwrite"] * (3 * STEPS), writes


def _counted(original, writes, name):
    def call(*args, **kwargs):
        writes.append(name)
        return original(*args, **kwargs)

    return call


def _counted_open(original, writes):
    def call(file, mode="r", *args, **kwargs):
        if any(flag in mode for flag in "wax+"):
            writes.append(f"open {file}")
        return original(file, mode, *args, **kwargs)

    return call
