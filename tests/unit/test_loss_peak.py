"""The dry run reports the loss's own peak (`loss_peak_bytes`), and under TP the loss is
vocab-parallel: the rank holding the head holds a vocabulary shard of the logits and the loss
over it, not the whole (issue 30). Debug model, bf16, world 8, the rank that holds the head."""

from dstrain.config.load import load_config
from dstrain.train.dry_run import dry_run_rank

COMMON = [
    "train.precision=bf16",
    "train.global_batch_size=32",
    "train.micro_batch_size=4",
    "parallel.zero_stage=1",
]


def _loss_peak(*sets: str) -> float:
    config = load_config(None, [*COMMON, *sets]).config
    report = dry_run_rank(config, 8, 0, step=True)
    assert report.step.startswith("ran"), report.step
    return report.loss_peak_bytes


def test_tp_splits_the_loss_peak_over_the_vocabulary():
    whole = _loss_peak("parallel.dp_shard=8")
    split = _loss_peak("parallel.dp_shard=4", "parallel.tp=2")
    # measured: 25.0 MB without TP (24 bytes per logit, two heads), 8.4 MB at tp 2 (16 bytes
    # per local logit); the old head, which all-gathered the logits, gave 25.0 MB at tp 2 too
    assert 0 < split < 0.5 * whole, (split, whole)


def test_a_rank_without_the_head_reports_no_loss_peak():
    config = load_config(None, [*COMMON, "parallel.pp=2", "parallel.dp_shard=4"]).config
    report = dry_run_rank(config, 8, 0, step=True)  # pp rank 0 of 1f1b: the first stage only
    assert report.step.startswith("ran") and report.loss_peak_bytes is None
