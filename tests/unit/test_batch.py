"""The batch terms: global = micro x grad_accum x dp, the missing one inferred; under PP, with
nothing fixing the accumulation, enough micro-batches for the schedule. `check`, the trainer's
runtime and the planner resolve it through the same `run_batch`."""

import pytest

from dstrain.config.batch import run_batch
from dstrain.config.load import load_config
from dstrain.planner.layout import layout_from_config
from dstrain.preflight.preflight import preflight


def batch(*overrides: str, dp: int = 1):
    plan, findings = run_batch(load_config(None, list(overrides)).config, dp)
    assert plan is not None, findings
    return plan.micro_batch_size, plan.grad_accum_steps, plan.global_batch_size


def test_without_pp_the_default_is_16_sequences_per_rank():
    assert batch() == (16, 1, 16)
    assert batch(dp=2) == (16, 1, 32)
    assert batch("train.micro_batch_size=4") == (4, 1, 4)  # as DeepSpeed infers it
    assert batch("train.global_batch_size=32", "train.micro_batch_size=4", dp=2) == (4, 4, 32)


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        # Issue 17's command: 4 micro-batches of 4, the 16 sequences a rank takes without PP.
        (("train.micro_batch_size=4",), (4, 4, 16)),
        ((), (8, 2, 16)),  # nothing given: the fewest micro-batches 1F1B takes, 16 sequences
        (("train.micro_batch_size=32",), (32, 2, 64)),  # never below pp micro-batches
        (("parallel.pp_schedule=dualpipev", "parallel.num_virtual_stages=2"), (4, 4, 16)),
        (("parallel.num_microbatches=8",), (2, 8, 16)),  # an explicit count is the accumulation
        (("train.global_batch_size=32", "train.micro_batch_size=2"), (2, 16, 32)),  # given: kept
        (("train.grad_accum_steps=3",), (16, 3, 48)),  # given: kept
    ],
)
def test_under_pp_the_accumulation_gives_the_schedule_its_micro_batches(overrides, expected):
    assert batch("parallel.pp=2", *overrides) == expected


@pytest.mark.parametrize(
    "overrides",
    [
        ("parallel.pp=2", "train.micro_batch_size=4"),
        ("parallel.pp=2", "parallel.pp_schedule=dualpipev", "parallel.num_virtual_stages=2"),
        ("parallel.pp=4", "parallel.pp_schedule=gpipe", "train.micro_batch_size=1"),
    ],
)
def test_check_and_the_planner_agree_and_accept_it(overrides):
    loaded = load_config(None, list(overrides))
    config = loaded.config
    world = config.parallel.pp
    assert [f for f in preflight(loaded, world) if f.severity == "error"] == []
    plan, _ = run_batch(config, 1)
    layout = layout_from_config(config, world)
    assert (layout.micro_batch, layout.global_batch) == (
        plan.micro_batch_size,
        plan.global_batch_size,
    )
