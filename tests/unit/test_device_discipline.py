"""Every tensor handed to a collective lives on the run's device: NCCL serves only CUDA tensors.
Checked without a GPU (`tests/device_check.py`): the run's device is `meta` (not the CPU), the
process group torch's fake one, and every collective's tensor devices are recorded. Covers the
training step (token counts, loss sums, gradient clipping, the loss scaler's overflow agreement,
the MoE loads), an expert-parallel step's dispatch, a tensor-parallel step's DTensor
collectives, a pipeline step's sends and receives, the pipeline's loss, load and tied-embedding
reductions, the pipeline timer, the metrics processor's gather, and the step's overflow and
preemption agreement."""

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage

from dstrain.config.load import load_config
from dstrain.config.schema import LossScaleConfig
from dstrain.metrics.pipeline_timer import PipelineTimer
from dstrain.metrics.probes import Probes
from dstrain.metrics.processor import MetricsProcessor, StepFigures, Throughput, Window
from dstrain.model import moe
from dstrain.model.transformer import build_model
from dstrain.parallel.context_parallel import ContextShard, apply_context_parallel
from dstrain.parallel.distributed import World
from dstrain.parallel.expert_parallel import apply_ep
from dstrain.parallel.pipeline import TiedEmbedding
from dstrain.train.agreement import agree
from dstrain.train.loss_scale import LossScaler
from dstrain.train.pipeline_step import _gather_loads, pipeline_step
from dstrain.train.runtime import build_runtime
from dstrain.train.step import DataParallel, train_step
from tests.device_check import DEVICE, device_check
from tests.unit.test_hot_path import _BalancedRouting
from tests.unit.tiny import tiny_args


def _on_device(model: torch.nn.Module) -> torch.nn.Module:
    # bf16, as GPU runs are: the routed experts then run as one grouped GEMM, as on DEVICE.
    return model.to(torch.bfloat16)


def _step_settings(dp: DataParallel, fp16: bool = False) -> dict:
    """What the trainer passes a step, besides the model, optimizer and batches."""
    return dict(
        scaler=LossScaler(LossScaleConfig(), enabled=fp16),
        precision="fp32",
        grad_clip=1.0,
        mtp_weight=0.3,
        num_mtp=1,
        bias_update_speed=1e-3,
        dp=dp,
    )


def _train_step(model: torch.nn.Module, *, fp16: bool = False, context=None) -> None:
    """One step of two micro-batches on DEVICE, as rank 0 of dp 2 (the fake group's world)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = [torch.randint(0, 64, (2, 9), device=DEVICE) for _ in range(2)]
    dp = DataParallel(dist.group.WORLD, 2)
    train_step(model, optimizer, batches, context=context, **_step_settings(dp, fp16))


@pytest.mark.parametrize("fp16", [False, True], ids=["bf16", "fp16-scaler"])
def test_the_training_step_keeps_collectives_on_the_device(fp16):
    with device_check() as recorded:
        _train_step(_on_device(build_model(tiny_args(), device=None)), fp16=fp16)
    assert len(recorded.calls) >= 4  # counts, loss, mtp loss, expert loads (+ overflow)
    assert recorded.off_device() == []


def test_context_parallel_keeps_its_collectives_on_the_device():
    """cp2 with MTP and the balance loss: the latent's gather and its gradient's reduce-scatter,
    the balance loss's sums, and everything the split builds (positions, chunk masks, MTP's
    split depths and targets, the padded rows' mask) on the run's device."""
    with device_check() as recorded:
        model = _on_device(build_model(tiny_args(aux_loss_alpha=0.01), device=None))
        shard = ContextShard(dist.group.WORLD, 2, 0)
        apply_context_parallel(model, shard)
        _train_step(model, context=shard)
    names = {name for name, _ in recorded.calls}
    expected = {
        "_c10d_functional.all_gather_into_tensor",  # the latent's gather
        "_c10d_functional.reduce_scatter_tensor",  # its gradient
        "_c10d_functional.all_reduce",  # the balance loss's sums
    }
    assert expected <= names, names
    assert recorded.off_device() == []


def test_an_expert_parallel_step_keeps_its_dispatch_on_the_device(monkeypatch):
    """ep2: the tokens' all-to-all out to the experts' ranks and back (functional collectives,
    with their split sizes), beside the step's reductions, all on the run's device."""
    args = tiny_args()
    routing = _BalancedRouting(args.num_routed_experts, 2)
    monkeypatch.setattr(moe, "count_per_expert", routing.counting(moe.count_per_expert))
    with device_check(world_size=2, answer=routing.answer) as recorded:
        model = _on_device(build_model(args, device=None))
        apply_ep(model, DeviceMesh("cpu", [0, 1]))
        _train_step(model)
    names = [name for name, _ in recorded.calls]
    assert names.count("_c10d_functional.all_to_all_single") >= 4, names  # out and back, x2
    assert recorded.off_device() == []


def _runtime(*overrides: str):
    """Rank 0 of 2 as the training runtime builds it on DEVICE, micro-batches of 2 x 16 tokens
    (call inside `device_check`)."""
    sets = [*overrides, "train.seq_len=16", "train.micro_batch_size=2"]
    runtime = build_runtime(load_config(None, sets).config, World(0, 2, 0, DEVICE, "fake"))
    runtime.model.to(torch.bfloat16)
    return runtime


def _batches(count: int) -> list[torch.Tensor]:
    return [torch.randint(0, 64, (2, 17), device=DEVICE) for _ in range(count)]


def test_a_tensor_parallel_step_keeps_dtensors_collectives_on_the_device():
    """tp2 with sequence parallelism: DTensor's own collectives (the sequence shards' gathers and
    reduce-scatters, the row-parallel all-reduces) and the step's reductions, all on the run's
    device."""
    with device_check(world_size=2) as recorded:
        runtime = _runtime(
            "parallel.tp=2", "parallel.sequence_parallel=true", "train.global_batch_size=4"
        )
        del recorded.calls[:]
        train_step(runtime.model, runtime.optimizer, _batches(2), **_step_settings(runtime.dp))
    names = {name for name, _ in recorded.calls}
    expected = {
        "_c10d_functional.all_gather_into_tensor",
        "_c10d_functional.reduce_scatter_tensor",
        "_c10d_functional.all_reduce",
    }
    assert expected <= names, names
    assert recorded.off_device() == []


def test_a_pipeline_step_keeps_its_sends_and_receives_on_the_device():
    """Rank 0 of pp2 under 1f1b: each micro-batch's activations sent on and its gradient
    received back (c10d p2p), then the step's loss, clipping and load reductions, all on the
    run's device."""
    with device_check(world_size=2) as recorded:
        runtime = _runtime(
            "parallel.pp=2", "parallel.pp_schedule=1f1b", "train.global_batch_size=8"
        )
        pipe = runtime.pipeline
        # Upstream infers the stages' shapes by exchanging them as pickled objects, which the
        # fake group cannot carry: the first stage is given them (static metadata) instead.
        stage, tokens = pipe.stages[0], torch.randint(0, 64, (2, 16), device=DEVICE)
        stage._user_meta = PipelineStage(
            stage.submod,
            0,
            2,
            DEVICE,
            input_args=tokens,
            output_args=stage.submod(tokens),
            group=pipe.group,
        )._user_meta
        del recorded.calls[:]
        pipeline_step(
            pipe,
            runtime.optimizer,
            _batches(4),
            num_experts=runtime.model_args.num_routed_experts,
            timer=PipelineTimer(pipe.group, device=DEVICE),
            **_step_settings(runtime.dp),
        )
    names = [name for name, _ in recorded.calls]
    # 4 micro-batches: 4 activations out, 4 gradients back (+ the stages' warm-up vote)
    assert names.count("c10d.send") >= 4 and names.count("c10d.recv_") >= 4, names
    assert "c10d.allreduce_" in names, names
    assert recorded.off_device() == []


def test_the_overflow_and_preemption_agreement_stays_on_the_device():
    with device_check() as recorded:
        param = torch.nn.Parameter(torch.ones(4, device=DEVICE))
        param.grad = torch.ones(4, device=DEVICE)
        overflow = LossScaler(LossScaleConfig(), enabled=True).unscale([param], DEVICE)
        one = torch.ones((), device=DEVICE)
        agree(one, one, overflow, preempting=True)
    assert recorded.calls == [("c10d.allreduce_", ("meta",))]


def test_the_pipeline_timer_reduces_on_the_device():
    with device_check() as recorded:
        timer = PipelineTimer(dist.group.WORLD, device=DEVICE)
        timer.start()
        timer.stop()
        timer.collect("1f1b", 4, 1)
    assert recorded.calls and recorded.off_device() == []


def test_the_pipelines_reductions_stay_on_the_device():
    with device_check() as recorded:
        pipe = SimpleNamespace(group=dist.group.WORLD, router_names=["layers.1.ffn.router"])
        _gather_loads({"layers.1.ffn.router": torch.ones(8, device=DEVICE)}, pipe, 8, DEVICE)
        embed = torch.nn.Embedding(4, 2, device=DEVICE)
        embed.weight.grad = torch.ones(4, 2, device=DEVICE)
        TiedEmbedding(embed, None, dist.group.WORLD).sum_grads()
    assert len(recorded.calls) == 2 and recorded.off_device() == []


def test_the_metrics_processor_gathers_on_the_device(monkeypatch):
    for name in ("max_memory_allocated", "max_memory_reserved"):  # no DEVICE runtime here
        monkeypatch.setattr(torch.cuda, name, lambda device=None: 0)
    with device_check() as recorded:
        model = _on_device(build_model(tiny_args(), device=None))
        processor = MetricsProcessor(model, Throughput(2, 1e6, 1e12), Probes(DEVICE), DEVICE)
        window = Window()
        window.start()
        window.stop(128)
        one = torch.ones((), device=DEVICE)
        processor.collect(StepFigures(loss=one, grad_norm=one, local_loss=one, lr=1e-3), window)
    assert recorded.calls and recorded.off_device() == []
