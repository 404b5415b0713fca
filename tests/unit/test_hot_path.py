"""What a training step costs the host: its syncs (device -> host reads, each a stall on a GPU)
and its file writes, counted per step so that a new one shows up here.

Budgets, per optimizer step:
- syncs (`tests/device_check.py`: the step on `meta`, every `.item()`, `.tolist()` and copy to
  the host counted): one, the step's agreement (`train/agreement.py`: the global loss, gradient
  norm, fp16 overflow and preemption flags in one read); plus one under data parallelism, the
  global token counts (the loss's divisors, needed before the forward). Not counted here: under
  EP one split-size read per MoE layer and micro-batch (all-to-all needs sizes), under fp32 on
  CUDA the per-expert fallback's split sizes, and every `metrics.log_interval` steps the
  metrics line's gather;
- file writes: three heartbeat records (step, data, compute), each one `pwrite` in place; the
  metrics sinks write only every `metrics.log_interval` steps.
"""

import builtins
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dstrain.config.load import load_config
from dstrain.config.schema import LossScaleConfig
from dstrain.model.transformer import build_model
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
