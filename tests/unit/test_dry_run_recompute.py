"""The dry run's recomputed FLOPs per step (`train/dry_run.py`, `recompute_flops_per_step`) under
DualPipeV, the schedule that splits backwards: `selective` keeps its per-op policy there (the
matmuls' outputs kept), so it runs again a small part of what `full` runs again, not the whole
attention and FFN."""

from dstrain.config.load import load_config
from dstrain.train.dry_run import dry_run_rank

DUALPIPEV = [  # the debug model in bf16, world 8: DeepSeek-V3's layout in small
    "train.precision=bf16",
    "train.global_batch_size=32",
    "parallel.pp=2",
    "parallel.dp_shard=4",
    "parallel.ep=2",
    "parallel.zero_stage=1",
    "parallel.pp_schedule=dualpipev",
    "parallel.num_virtual_stages=2",
    "train.micro_batch_size=1",
]


def _recomputed(ac: str) -> float:
    config = load_config(None, [*DUALPIPEV, f"train.activation_checkpoint={ac}"]).config
    report = dry_run_rank(config, 8, 0, step=True)
    assert report.step.startswith("ran"), report.step
    return report.recompute_flops_per_step


def test_selective_recomputes_a_fraction_of_full_under_dualpipev():
    selective, full = _recomputed("selective"), _recomputed("full")
    # measured 0.32 (the routed experts and elementwise ops); whole modules gave 0.88
    assert 0 < selective < 0.5 * full
