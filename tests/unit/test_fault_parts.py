"""The fault-tolerance parts that need no process group: the numerics guard, heartbeats and the
timeout explanation, the goodput clock, the fault variable, and `dstrain status`."""

import json
import time

import pytest
import torch

from dstrain.config.schema import GuardConfig
from dstrain.errors import UserError
from dstrain.train.faults import fault_from_env
from dstrain.train.goodput import RunClock
from dstrain.train.guard import NumericsGuard
from dstrain.train.heartbeat import Heartbeat, explain_timeout, laggards, read_heartbeats


def _allow(guard: NumericsGuard, loss: float, norm: float = 1.0) -> bool:
    return guard.allow(torch.tensor(loss), torch.tensor(norm))


def test_guard_refuses_non_finite_and_spikes_and_stops_after_too_many():
    guard = NumericsGuard(GuardConfig(spike_factor=2.0, spike_warmup_steps=3), fp16=False)
    assert all(_allow(guard, 4.0) for _ in range(3))
    assert not _allow(guard, float("nan")) and guard.last_reason == "loss is nan"
    assert not _allow(guard, 4.0, norm=float("inf")) and "gradient norm" in guard.last_reason
    assert not _allow(guard, 9.0) and "spike" in guard.last_reason
    assert _allow(guard, 4.5) and guard.events == 3
    for _ in range(5):
        _allow(guard, float("inf"))
    with pytest.raises(UserError, match="6 bad steps in a row"):
        _allow(guard, float("inf"))


def test_guard_leaves_fp16_overflows_to_the_loss_scaler_and_stop_policy_stops():
    assert _allow(NumericsGuard(GuardConfig(), fp16=True), 3.0, norm=float("inf"))
    with pytest.raises(UserError, match="numerics guard: loss is inf"):
        _allow(NumericsGuard(GuardConfig(policy="stop"), fp16=False), float("inf"))


def test_guard_state_round_trips():
    guard = NumericsGuard(GuardConfig(), fp16=False)
    _allow(guard, 2.0)
    other = NumericsGuard(GuardConfig(), fp16=False)
    other.load_state_dict(guard.state_dict())
    assert other.mean == 2.0 and other.judged == 1


def test_the_rank_behind_is_named_in_a_timeout(tmp_path):
    for rank, (step, phase) in enumerate([(4, "compute"), (4, "step"), (4, "compute")]):
        Heartbeat(tmp_path, rank, attempt=0).beat(step, phase)
    beats = read_heartbeats(tmp_path)
    assert [b["rank"] for b in laggards(beats, me=0)] == [1]
    error = explain_timeout(RuntimeError("Timed out waiting 5000ms for recv"), tmp_path, 0, 5)
    assert "held up by rank 1 at step 5 (step)" in error.message
    assert explain_timeout(RuntimeError("shape mismatch"), tmp_path, 0, 5) is None
    Heartbeat(tmp_path, 1, attempt=0).beat(4, "compute")
    error = explain_timeout(RuntimeError("Connection closed by peer"), tmp_path, 0, 5)
    assert "no rank stands out" in error.message


def test_goodput_clock_counts_restarts_and_recomputed_steps(tmp_path):
    clock = RunClock(tmp_path, is_main=True, fresh=False)
    clock.add(3.0)
    again = RunClock(tmp_path, is_main=True, fresh=False)
    assert again.resumed(step=4, steps_done_before=6) == 2
    summary = again.summary()
    assert summary["restarts"] == 1 and summary["recomputed_steps"] == 2
    assert json.loads((tmp_path / "run_state.json").read_text())["starts"] == 2
    assert RunClock(tmp_path, is_main=True, fresh=True).summary()["restarts"] == 0


def test_fault_variable_is_parsed_or_refused(monkeypatch):
    monkeypatch.setenv("DSTRAIN_INJECT_FAULT", "kill:rank=1:step=5")
    fault = fault_from_env()
    assert (fault.kind, fault.rank, fault.step) == ("kill", 1, 5)
    assert not fault.fires(0, 5) and fault.fires(1, 5) and not fault.fires(1, 5)  # once
    for bad in (
        "explode:rank=1:step=2",
        "hang:rank=x:step=2",
        "hang:rank=1",
        "nan:rank=1:step=2:x=3",
    ):
        monkeypatch.setenv("DSTRAIN_INJECT_FAULT", bad)
        with pytest.raises(UserError, match="DSTRAIN_INJECT_FAULT"):
            fault_from_env()


def test_status_shows_each_rank_and_the_one_behind(cli, tmp_path):
    Heartbeat(tmp_path, 0, attempt=1).beat(7, "compute")
    Heartbeat(tmp_path, 1, attempt=1).beat(6, "data")
    result = cli("status", str(tmp_path))
    assert result.code == 0 and "behind the others" in result.out
    rows = cli("status", str(tmp_path), "--json").json()
    assert [r["behind"] for r in rows] == [False, True]
    assert rows[0]["age_s"] < 60 and time.time() - rows[1]["time"] < 60
    missing = cli("status", str(tmp_path / "nope"))
    assert missing.code == 2 and "no heartbeats" in missing.err
