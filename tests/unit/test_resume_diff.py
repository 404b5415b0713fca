"""`checkpoint/resume.compare`: what a checkpoint's recorded layout becomes under a new config,
axis by axis (what `dstrain ckpt diff` prints and the trainer logs on a resume)."""

from dstrain.checkpoint.resume import compare
from dstrain.config.load import load_config


def _axes(old_layout: dict, *overrides: str, world: int) -> dict[str, str]:
    config = load_config(None, list(overrides)).config
    diff = compare({"layout": old_layout, "step": 4, "world_size": 4}, config, world)
    return {a.axis: a.status for a in diff.axes}


LAYOUT = {"dp_replicate": 1, "dp_shard": 4, "cp": 1, "tp": 1, "pp": 1, "ep": 1, "zero_stage": 2}


def test_a_shrinking_axis_reshards_and_an_equal_one_stays():
    axes = _axes({**LAYOUT, "pp_schedule": "1f1b"}, "parallel.dp_shard=2", world=2)
    assert axes["dp_shard"] == "reshards"  # 4 -> 2: fewer is a change too
    assert axes["zero_stage"] == "same" and axes["tp"] == "same"


def test_the_data_line_names_a_change_of_data_parallel_size():
    def data(*overrides: str, world: int) -> str:
        meta = {"layout": LAYOUT, "step": 4, "world_size": 4, "tokens_seen": 4096}
        return compare(meta, load_config(None, list(overrides)).config, world).data

    assert "dp 4 -> 2 only changes how each step's samples are split" in data(world=2)
    assert "dp 4 -> 8" in data(world=8)
    assert "dp" not in data(world=4) and "4,096 tokens seen" in data(world=4)


def test_pipeline_settings_matter_only_where_a_side_has_a_pipeline():
    gpipe = {**LAYOUT, "pp_schedule": "gpipe"}
    # neither side pipelined: the schedule is a setting nothing reads
    assert _axes(gpipe, world=4)["pp_schedule"] == "unused"
    # a checkpoint that does not record pp (an older version's) had none
    unrecorded = {k: v for k, v in gpipe.items() if k != "pp"}
    assert _axes(unrecorded, world=4)["pp_schedule"] == "unused"
    # the checkpoint's pp2 ran gpipe; this run has no pipeline: the layout does change
    assert _axes({**gpipe, "pp": 2, "dp_shard": 2}, world=4)["pp_schedule"] == "reshards"
    # and the other way round
    assert _axes(gpipe, "parallel.pp=2", world=4)["pp_schedule"] == "reshards"
