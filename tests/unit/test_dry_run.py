"""The dry run: rank R's real runtime at any world size in this process, on torch's fake process
group with the model on meta. It agrees with the planner on model states (within 0.1 % on
DeepSeek-V3, to the byte on the small layouts but tp's 1.2 %), builds DeepSeek-V3's published
layout at 2048 ranks in seconds, and gives one verdict with `check` and the planner on a grid of
small layouts."""

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest

from dstrain.config.flavors import resolve_model_args
from dstrain.config.load import load_config
from dstrain.errors import UserError
from dstrain.hardware import gpu_spec
from dstrain.planner.layout import Cluster, layout_from_config
from dstrain.planner.legal import trainer_errors
from dstrain.planner.shape import rank_shapes
from dstrain.preflight.preflight import preflight
from dstrain.train.dry_run import dry_run_rank
from tests.conftest import REPO

V3_EXAMPLE = REPO / "examples" / "deepseek-v3-h800x2048.toml"
GiB = 2**30


def _config(path: Path | None, *overrides: str):
    return load_config(path, list(overrides)).config


def _planned_states(config, world: int, pp_rank: int) -> float:
    """The planner's model states for the pipeline rank `pp_rank` of this config."""
    from dstrain.planner.memory import _rank_memory

    args = resolve_model_args(config.model)
    layout = layout_from_config(config, world)
    shape = next(s for s in rank_shapes(args, layout) if s.rank == pp_rank)
    return _rank_memory(args, layout, shape).model_states


@pytest.mark.parametrize("rank", [0, 2047])
def test_deepseek_v3_at_2048_ranks_matches_the_planner(rank):
    config = _config(V3_EXAMPLE)
    report = dry_run_rank(config, 2048, rank, step=True)
    pp_rank = report.coords["pp"]
    assert pp_rank == (0 if rank == 0 else 15)
    assert report.groups["pp"] == 16 and report.groups["ep"] == 64 and report.groups["dp"] == 128
    planned = _planned_states(config, 2048, pp_rank)
    # Measured: +0.0003 % on rank 0, -0.011 % on rank 2047; bound 0.1 %.
    assert abs(report.model_states_bytes / planned - 1) < 1e-3, (report.model_states_bytes, planned)
    # No rank holds the whole model: the old path built 2.5 TiB of fp32 weights on each.
    assert report.full_model_bytes > 2400 * GiB
    assert report.build_peak_bytes < 2 * GiB
    assert [s["stage"] for s in report.stages] == ([0, 31] if rank == 0 else [15, 16])
    assert report.step.startswith("ran")
    assert report.activation_peak_bytes > 0
    assert report.seconds["total"] < 120


V3_128K = REPO / "examples" / "deepseek-v3-128k-h800x2048.toml"


def test_deepseek_v3_at_128k_with_context_parallelism_matches_the_planner():
    """V3's 128K stage: pp16 x cp8 x dp16 on 2048 ranks. Rank 2047 (pp 15, cp 7) holds 16K
    tokens of each sequence; its model states are the 4K layout's (cp shards with dp), and the
    planner's activation estimate, which counts the whole sequence's keys and values that the
    latent gather up-projects, is within 15% of the step the dry run measures (155 against
    178 GiB; 120 GiB before it counted them)."""
    from dstrain.planner.memory import activation_bytes

    config = _config(V3_128K)
    assert not [f for f in preflight(load_config(V3_128K), 2048) if f.severity == "error"]
    report = dry_run_rank(config, 2048, 2047, step=True)
    assert report.coords["pp"] == 15 and report.coords["cp"] == 7 and report.groups["cp"] == 8
    assert report.groups["ep"] == 64 and report.step.startswith("ran"), report.step
    planned = _planned_states(config, 2048, 15)
    # Measured: -0.011 %, as the 4K layout's rank 2047; bound 0.1 %.
    assert abs(report.model_states_bytes / planned - 1) < 1e-3, (report.model_states_bytes, planned)
    args, layout = resolve_model_args(config.model), layout_from_config(config, 2048)
    shape = next(s for s in rank_shapes(args, layout) if s.rank == 15)
    estimate = activation_bytes(args, layout, shape)
    assert abs(estimate / report.activation_peak_bytes - 1) < 0.15, (
        estimate / GiB,
        report.activation_peak_bytes / GiB,
    )


LONG = ["train.seq_len=1024", "model.max_seq_len=1024"]
SMALL = {  # world 8 unless a layout says otherwise; the debug model in bf16
    "ddp": ["parallel.dp_shard=8", "parallel.zero_stage=0"],
    "zero1": ["parallel.dp_shard=8", "parallel.zero_stage=1"],
    "zero2": ["parallel.dp_shard=8", "parallel.zero_stage=2"],
    "zero3": ["parallel.dp_shard=8", "parallel.zero_stage=3"],
    "dp4_tp2_zero1": ["parallel.dp_shard=4", "parallel.tp=2", "parallel.zero_stage=1"],
    "dp8_ep4_zero1": ["parallel.dp_shard=8", "parallel.ep=4", "parallel.zero_stage=1"],
    "pp2_dp4_zero1": [
        "parallel.pp=2",
        "parallel.dp_shard=4",
        "parallel.zero_stage=1",
        "train.micro_batch_size=2",
    ],
    "dp4_cp2_zero1": ["parallel.dp_shard=4", "parallel.cp=2", "parallel.zero_stage=1"],
    "pp2_dp2_ep2_zero1_dualpipev": [
        "parallel.pp=2",
        "parallel.dp_shard=4",
        "parallel.ep=2",
        "parallel.zero_stage=1",
        "parallel.pp_schedule=dualpipev",
        "parallel.num_virtual_stages=2",
        "train.micro_batch_size=1",
    ],
}


@pytest.mark.parametrize("name", list(SMALL))
def test_small_layouts_match_the_planner(name):
    config = _config(None, "train.precision=bf16", "train.global_batch_size=32", *SMALL[name])
    for rank in (0, 7):
        report = dry_run_rank(config, 8, rank, step=False)
        planned = _planned_states(config, 8, report.coords["pp"])
        if name == "dp4_tp2_zero1":
            # Measured: -1.2 % (12,222,432 against 12,369,888 bytes); bound 2 %.
            assert abs(report.model_states_bytes / planned - 1) < 0.02, (name, rank, planned)
        else:
            # Measured: equal to the byte; both count the same tensors' whole bytes.
            assert report.model_states_bytes == planned, (name, rank, planned)


def test_a_step_runs_under_fake_tensors_with_expert_parallelism():
    config = _config(None, "train.precision=bf16", *SMALL["dp8_ep4_zero1"])
    report = dry_run_rank(config, 8, 3, step=True)
    assert report.step.startswith("ran") and report.activation_peak_bytes > 0


def test_a_step_runs_under_fake_tensors_with_context_parallelism():
    """cp2 x dp_shard2 against dp_shard4: the step runs on the fake backend (the latent's
    gather, MTP's split depths, the expert-load counts of padded positions all traced with static
    shapes), and a cp rank's activations, half a sequence's, are well under a dp rank's."""
    sets = ("train.precision=bf16",)
    dp = dry_run_rank(_config(None, *sets, "parallel.dp_shard=4"), 4, 3, step=True)
    cp = dry_run_rank(_config(None, *sets, "parallel.dp_shard=2", "parallel.cp=2"), 4, 3, step=True)
    assert cp.step.startswith("ran") and cp.coords["cp"] == 1, cp.step
    print(f"activation peak: cp2 {cp.activation_peak_bytes / 2**20:.1f} MiB, dp "
          f"{dp.activation_peak_bytes / 2**20:.1f} MiB")  # fmt: skip
    assert cp.activation_peak_bytes < 0.75 * dp.activation_peak_bytes


def test_pipeline_stages_run_under_fake_tensors_with_context_parallelism():
    """pp2 x cp2 under DualPipeV: rank 0 holds the first stage (the tokens' part) and the last
    (MTP's split depths and every depth's targets), and its activations fall below pp2 x dp2's."""
    sets = ("train.precision=bf16", "parallel.pp=2", "parallel.pp_schedule=dualpipev")
    dp = dry_run_rank(_config(None, *sets, "parallel.dp_shard=2"), 4, 0, step=True)
    cp = dry_run_rank(_config(None, *sets, "parallel.cp=2"), 4, 0, step=True)
    assert cp.step.startswith("ran") and "stages 0, 3" in cp.step, cp.step
    assert cp.loss_peak_bytes < 0.75 * dp.loss_peak_bytes
    assert cp.activation_peak_bytes < 0.75 * dp.activation_peak_bytes


def test_routed_experts_split_over_tp_on_the_fake_backend_save_less():
    # 8 ranks: dp4 x tp2 with the experts over ep4 (two dp x tp pairs): the token split's DTensor
    # redistributions run on fake tensors at full world size, and the step's activation peak
    # falls below the repeated routing's (the routed copies are half as many per rank). One
    # process per dry run: a second TP step in a process whose fake groups were torn down and
    # rebuilt finds a stale group name in upstream's caches.
    layout = ["parallel.dp_shard=4", "parallel.tp=2", "parallel.ep=4", "parallel.zero_stage=1"]
    peaks = {}
    for mode in ("split_tokens", "repeat"):
        sets = [f"--set={o}" for o in ("train.precision=bf16", f"parallel.moe_tp={mode}", *layout)]
        done = subprocess.run(
            [sys.executable, "-m", "dstrain", "train", "--dry-run", "--world-size", "8"]
            + ["--rank", "5", "--json", *sets],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        report = json.loads(done.stdout)
        report = report[0] if isinstance(report, list) else report
        assert report["step"].startswith("ran"), report["step"]
        peaks[mode] = report["activation_peak_bytes"]
    assert peaks["split_tokens"] < peaks["repeat"], peaks


def test_fp32_experts_cannot_be_traced_and_say_why():
    config = _config(None, "parallel.dp_shard=2")
    report = dry_run_rank(config, 2, 0, step=True)
    assert report.step.startswith("not run") and "bf16" in report.step
    assert report.activation_peak_bytes is None


def test_cli_json_and_an_illegal_layout(cli):
    result = cli(
        "train", V3_EXAMPLE, "--dry-run", "--world-size", "2048", "--rank", "0", "--json",
        "--no-step",
    )  # fmt: skip
    assert result.code == 0, result.text
    data = result.json()
    assert data["model_states_bytes"] > 0 and data["build_peak_bytes"] > 0
    bad = cli("train", V3_EXAMPLE, "--dry-run", "--world-size", "1000")
    assert bad.code == 1
    assert "parallel" in bad.err and "Traceback" not in bad.text
    outside = cli("train", "--dry-run", "--world-size", "2", "--rank", "5")
    assert outside.code == 1 and "0..1" in outside.err


# ---- one truth: check, plan and the runtime agree on what is legal --------------------------

GRID_AXES = {
    "world": [2, 4],
    "tp": [1, 2],
    "pp": [1, 2],
    "ep": [1, 2],
    "zero": [0, 1, 2, 3],
    "schedule": ["1f1b", "dualpipev"],
}


def _grid():
    for world, tp, pp, ep, zero, schedule in itertools.product(*GRID_AXES.values()):
        if pp == 1 and schedule != "1f1b":
            continue
        if world % (tp * pp):
            continue
        sets = [
            f"parallel.tp={tp}",
            f"parallel.pp={pp}",
            f"parallel.ep={ep}",
            f"parallel.zero_stage={zero}",
            f"parallel.pp_schedule={schedule}",
            "parallel.dp_shard=-1",
            "train.micro_batch_size=2",
            "train.global_batch_size=16",
        ]
        if schedule == "dualpipev":
            sets.append("parallel.num_virtual_stages=2")
        yield pytest.param(world, sets, id=f"w{world}-tp{tp}-pp{pp}-ep{ep}-z{zero}-{schedule}")


# Context parallelism with what the trainer runs it (dp_shard, tp, ep, pp under 1F1B and
# DualPipeV), at 8 ranks. (HSDP is not here: the planner's layouts have no dp_replicate.)
CP_GRID = [
    ["parallel.cp=2"],
    ["parallel.cp=2", "parallel.tp=2"],
    ["parallel.cp=2", "parallel.ep=2", "parallel.zero_stage=3"],
    ["parallel.cp=2", "parallel.tp=2", "parallel.ep=4"],
    ["parallel.cp=2", "parallel.pp=2"],
    ["parallel.cp=2", "parallel.pp=2", "parallel.pp_schedule=dualpipev", "parallel.ep=2"],
]
CP_COMMON = ["parallel.dp_shard=-1", "train.micro_batch_size=2", "train.global_batch_size=16"]


@pytest.mark.parametrize(
    "world, sets",
    [
        *_grid(),
        *(pytest.param(8, [*c, *CP_COMMON], id="w8-" + "-".join(c)) for c in CP_GRID),
    ],
)
def test_check_plan_and_runtime_agree_on_what_is_legal(world, sets):
    loaded = load_config(None, sets)
    check_errors = [f for f in preflight(loaded, world) if f.severity == "error"]
    config = loaded.config
    args = resolve_model_args(config.model)
    cluster = Cluster(gpu_spec("H100"), num_gpus=world, gpus_per_node=world)
    plan_errors = trainer_errors(args, layout_from_config(config, world), cluster)
    try:
        dry_run_rank(config, world, world - 1, step=False)
        runtime_error = None
    except UserError as exc:
        runtime_error = exc.message
    verdicts = (not check_errors, not plan_errors, runtime_error is None)
    assert verdicts in ((True, True, True), (False, False, False)), (
        [f.message for f in check_errors],
        [f.message for f in plan_errors],
        runtime_error,
    )


@pytest.mark.parametrize(
    ("name", "extra", "within"),
    [
        ("zero1", [], 0.10),  # measured: estimate 1.03x the dry run's peak
        ("dp8_ep4_zero1", [], 0.10),  # 1.03x
        # 1.08x: the loss vocab-parallel over tp, its peak moved to the MTP block's backward
        ("dp4_tp2_zero1", [], 0.10),
        # 1.16x, 1.16x and 1.19x: in this step the loss's backward holds ~4-8 bytes per logit
        # less when the blocks are checkpointed (selectively or whole) than without it
        ("zero1", ["train.activation_checkpoint=selective"], 0.20),
        ("dp8_ep4_zero1", ["train.activation_checkpoint=selective"], 0.20),
        ("zero1", ["train.activation_checkpoint=full"], 0.25),
        # 1.14x: under DualPipeV's split backward the same per-op policy as above (1.04x when
        # the trainer checkpointed attention and the FFN there as whole modules)
        ("pp2_dp2_ep2_zero1_dualpipev", ["train.activation_checkpoint=selective"], 0.20),
        # context parallelism at seq 1024: every layer holds the whole sequence's keys and
        # values, up-projected from the gathered latent (the planner's `_gathered_kv_bytes`,
        # without which the estimate falls below the peak: 340 against 360 MiB)
        ("dp4_cp2_zero1", [*LONG, "train.activation_checkpoint=none"], 0.01),  # 1.002x
        ("dp4_cp2_zero1", [*LONG, "train.activation_checkpoint=selective"], 0.20),  # 1.15x
        ("dp4_cp2_zero1", [*LONG, "train.activation_checkpoint=full"], 0.20),  # 1.10x
    ],
)
def test_the_activation_estimate_brackets_the_dry_runs_peak(name, extra, within):
    """The planner's activation estimate against the dry run's measured activation peak (the
    step on fake tensors, debug model, bf16): the floor (fused kernels, fused loss) lies below
    what dstrain's eager step holds, the estimate above it, and without recompute close."""
    from dstrain.planner.memory import activation_bytes

    config = _config(
        None, "train.precision=bf16", "train.global_batch_size=32", *SMALL[name], *extra
    )
    report = dry_run_rank(config, 8, 0, step=True)
    args = resolve_model_args(config.model)
    layout = layout_from_config(config, 8)
    shape = next(s for s in rank_shapes(args, layout) if s.rank == report.coords["pp"])
    measured = report.activation_peak_bytes
    floor = activation_bytes(args, layout, shape, floor=True)
    estimate = activation_bytes(args, layout, shape)
    assert floor < measured <= estimate, (floor, measured, estimate)
    if within is not None:
        assert estimate / measured - 1 < within, (estimate, measured)


def _recomputed(activation_checkpoint: str) -> float:
    config = _config(
        None,
        "train.precision=bf16",
        "train.global_batch_size=32",
        *SMALL["pp2_dp2_ep2_zero1_dualpipev"],
        f"train.activation_checkpoint={activation_checkpoint}",
    )
    report = dry_run_rank(config, 8, 0, step=True)
    assert report.step.startswith("ran"), report.step
    return report.recompute_flops_per_step


def test_selective_recomputes_a_fraction_of_full_under_dualpipev():
    """The dry run's recomputed FLOPs per step (`recompute_flops_per_step`) under DualPipeV, the
    schedule that splits backwards: `selective` keeps its per-op policy there (the matmuls'
    outputs kept), so it runs again a small part of what `full` runs again, not the whole
    attention and FFN."""
    selective, full = _recomputed("selective"), _recomputed("full")
    # measured 0.32 (the routed experts and elementwise ops); whole modules gave 0.88
    assert 0 < selective < 0.5 * full
