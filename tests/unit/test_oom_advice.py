"""The out-of-memory advice without a run: which errors count, the allocation a message names,
the budget a measurement sets, the `--set` flags of the nearest layouts (applied to the config,
they give the layout the planner estimated), and `dstrain plan` on a layout that does not fit.
The runs themselves are tests/e2e/test_oom_advice.py."""

import json

import pytest
import torch

from dstrain.config.flavors import flavor_args
from dstrain.config.overrides import apply_overrides
from dstrain.config.schema import DstrainConfig
from dstrain.hardware import gpu_spec
from dstrain.planner.advice import MIN_SAVING, Measured, advise, memory_budget
from dstrain.planner.estimate import estimate_memory
from dstrain.planner.layout import Cluster, Layout, layout_from_config
from dstrain.planner.legal import to_config
from dstrain.planner.memory import GiB
from dstrain.planner.nearest import changes, nearest_fitting, set_flags
from dstrain.train.faults import fault_from_env
from dstrain.train.oom import claim_record, is_out_of_memory, requested_bytes
from tests.conftest import run_cli

V3 = flavor_args("deepseek-v3")
H800 = Cluster(gpu_spec("H800"), 256, 8, 50.0)
TOO_BIG = Layout(dp=32, pp=8, ep=8, zero=1, micro_batch=4, global_batch=2048, seq_len=4096)
PLAN_TOO_BIG = (
    "plan",
    "--model",
    "deepseek-v3",
    "--gpu",
    "H800",
    "--num-gpus",
    "256",
    "--tp",
    "1",
    "--pp",
    "8",
    "--ep",
    "8",
    "--micro-batch",
    "4",
    "--global-batch",
    "2048",
)


def test_what_counts_as_out_of_memory():
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"))
    assert is_out_of_memory(MemoryError())
    cpu = "[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory: you "
    assert is_out_of_memory(RuntimeError(cpu + "tried to allocate 4194304 bytes."))
    assert is_out_of_memory(RuntimeError("not enough memory: you tried to allocate 64 bytes."))
    assert not is_out_of_memory(RuntimeError("Connection closed by peer"))
    assert not is_out_of_memory(ValueError("out of memory"))  # not an allocator's error


def test_the_failed_allocation_is_read_from_either_allocator():
    cuda = (
        "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.11 "
        "GiB of which 1.50 GiB is free."
    )
    assert requested_bytes(cuda) == 2 * GiB
    assert requested_bytes("Tried to allocate 20.00 MiB.") == 20 * 2**20
    assert requested_bytes("DefaultCPUAllocator: you tried to allocate 4194304 bytes.") == 4194304
    assert requested_bytes("out of memory injected") is None


def test_the_oom_fault_raises_a_real_out_of_memory_error(monkeypatch):
    monkeypatch.setenv("DSTRAIN_INJECT_FAULT", "oom:rank=1:step=3")
    fault = fault_from_env()
    fault.maybe_fire(rank=0, step=3)  # another rank: nothing
    fault.maybe_fire(rank=1, step=2)  # another step: nothing
    with pytest.raises(torch.OutOfMemoryError, match="injected"):
        fault.maybe_fire(rank=1, step=3)


def _measured(total: float, capacity: float, requested: float | None) -> Measured:
    return Measured(0, 3, "device memory", "x", total, 0.0, 0.0, 0.0, 0.0, capacity, requested)


def test_a_measurement_asks_a_layout_to_save_what_the_run_lacked():
    e = estimate_memory(V3, TOO_BIG.with_(pp=16, micro_batch=1, recompute="full"), H800)
    capacity = e.hbm_bytes
    assert memory_budget(e, None) == capacity
    # The planner thought it fits; the run lacked 3 GiB: 3 GiB under the estimate.
    short = _measured(capacity - GiB, capacity, 4 * GiB)
    assert memory_budget(e, short) == pytest.approx(e.memory.peak - 3 * GiB)
    # Nothing measurably lacking (no size in the message): still 1 % under the estimate.
    unknown = _measured(capacity - GiB, capacity, None)
    assert memory_budget(e, unknown) == pytest.approx((1 - MIN_SAVING) * e.memory.peak)


def test_the_nearest_layouts_fit_and_their_flags_rebuild_them():
    config = to_config(TOO_BIG, H800, flavor="deepseek-v3", hf_config=None)
    found = nearest_fitting(V3, H800, config, TOO_BIG, H800.gpu.hbm_gb * 1e9)
    assert found, "a layout within three settings fits 256 H800s"
    distances = [len(s.changes) for s in found]
    assert distances == sorted(distances)  # fewest changed settings first
    for s in found:
        assert s.estimate.memory.peak <= H800.gpu.hbm_gb * 1e9
        patched = DstrainConfig.model_validate(
            apply_overrides(config.model_dump(mode="json", exclude_unset=True), s.flags)
        )
        again = layout_from_config(patched, 256)
        assert not changes(again, s.estimate.layout) and again.dp == s.estimate.layout.dp
        assert s.command_line().startswith("--set ")


def test_flags_keep_the_global_batch_of_a_config_that_infers_it():
    """A config that gives micro-batch and accumulation (the global batch inferred) gets the
    terms that keep the global batch when the micro-batch changes; dp_shard = -1 needs none."""
    config = DstrainConfig.model_validate(
        {"train": {"micro_batch_size": 8, "grad_accum_steps": 2, "seq_len": 128}}
    )
    current = layout_from_config(config, 4)
    target = current.with_(micro_batch=2, recompute="selective", tp=2, dp=2)
    flags = set_flags(config, current, target)
    assert "train.activation_checkpoint=selective" in flags and "parallel.tp=2" in flags
    assert not any(f.startswith("parallel.dp_shard") for f in flags)
    patched = DstrainConfig.model_validate(
        apply_overrides(config.model_dump(mode="json", exclude_unset=True), flags)
    )
    again = layout_from_config(patched, 4)
    assert (again.micro_batch, again.global_batch, again.dp) == (2, current.global_batch, 2)
    none = set_flags(config.model_copy(), target, current)
    assert 'train.activation_checkpoint="none"' in none  # a bare none would read as None


def test_the_advice_prints_the_estimate_and_numbered_set_lines():
    config = to_config(TOO_BIG, H800, flavor="deepseek-v3", hf_config=None)
    measured = _measured(70 * GiB, H800.gpu.hbm_gb * 1e9, 2 * GiB)
    text = "\n".join(advise(V3, H800, config, TOO_BIG, measured, top=2).lines())
    assert "measured (rank 0)" in text and "planner's estimate" in text
    assert "weights" in text and "activations" in text and "other" in text
    assert "  1. --set " in text and "  2. --set " in text and "  3. " not in text


def test_plan_prints_the_advice_for_a_layout_that_does_not_fit():
    result = run_cli(*PLAN_TOO_BIG)
    assert result.code == 1 and "DOES NOT FIT" in result.out
    assert "nearest layouts that fit" in result.out and "  1. --set " in result.out
    data = json.loads(run_cli(*PLAN_TOO_BIG, "--json").out)
    first = data["advice"]["nearest"][0]
    assert first["memory_gib"] <= data["memory_gib_per_gpu"]["capacity"]
    assert all("=" in flag for flag in first["flags"])
    fixed = ("--micro-batch", "1", "--recompute", "selective", "--pp", "32")
    fits = json.loads(run_cli(*PLAN_TOO_BIG, *fixed, "--json").out)
    assert fits["fits"] and "advice" not in fits


class _Advice:
    def to_json(self) -> dict:
        return {"nearest": []}


def test_the_first_rank_to_run_out_speaks_and_writes_the_record(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert claim_record(tmp_path, _Advice()) and claim_record(tmp_path, _Advice())  # one process
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "launch-1")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert claim_record(tmp_path, _Advice())
    assert not claim_record(tmp_path, _Advice())  # another rank of the same attempt
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert claim_record(tmp_path, _Advice())  # the restarted group's first
    assert json.loads((tmp_path / "oom.json").read_text())["exit_code"] == 3
