"""`dstrain ckpt inspect` and `dstrain ckpt diff` on a run directory written by the store."""

import subprocess
import sys

import pytest
import torch

from dstrain.checkpoint import store
from dstrain.config.flavors import flavor_args

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

LAYOUT = {
    "dp_replicate": 1,
    "dp_shard": 2,
    "cp": 1,
    "tp": 1,
    "pp": 1,
    "ep": 1,
    "zero_stage": 2,
    "pp_schedule": "1f1b",
    "num_virtual_stages": 1,
}


def _meta(step: int) -> dict:
    """What the trainer records: the default config's run on 2 ranks."""
    return {
        "tokens_seen": 4096 * step,
        "world_size": 2,
        "layout": LAYOUT,
        "model": flavor_args("debug").model_dump(),
        "optimizer": "adamw",
        "dstrain_version": "test",
    }


@pytest.fixture
def run(tmp_path):
    """runs/default with full checkpoints at steps 10, 20, 30 and a model-only one at 20."""
    run = tmp_path / "default"
    run.mkdir()
    (run / "config.toml").write_text("")
    writer = store.CheckpointWriter(
        run / "checkpoints", keep_last_k=0, async_save=False, is_main=True
    )
    for step in (10, 20, 30):
        writer.save(step, {"model": {"w": torch.full((8,), float(step))}}, _meta(step))
    writer.save(20, {"model": {"w": torch.zeros(8)}}, _meta(20), kind="model")
    writer.close()
    return run


@pytest.fixture
def new_toml(tmp_path):
    path = tmp_path / "new.toml"
    path.write_text("")  # the defaults, as the fixture run used
    return path


def _corrupt(path):
    shard = next(path.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))


def test_inspect_lists_every_checkpoint_and_the_resume_pick(cli, run):
    result = cli("ckpt", "inspect", run)
    assert result.code == 0, result.text
    lines = result.out.splitlines()
    assert "3 full, 1 model-only" in lines[0]
    rows = {line.split()[0]: line for line in lines[1:-1]}
    assert list(rows) == ["step-10", "step-20", "step-30", "model/step-20"]
    assert "2 ranks dp_shard=2 zero=2" in rows["step-10"]
    assert "122.9K tokens" in rows["step-30"] and "valid (sha256 checked)" in rows["step-30"]
    assert rows["step-30"].endswith("<- auto-resume")
    assert "auto-resume" not in rows["model/step-20"]
    assert lines[-1] == f"auto-resume would pick: {run / 'checkpoints' / 'step-30'}"


def test_inspect_json_shows_why_a_checkpoint_is_invalid(cli, run):
    _corrupt(run / "checkpoints" / "step-30")
    result = cli("ckpt", "inspect", run / "checkpoints", "--json")
    assert result.code == 0, result.text
    data = result.json()
    by_name = {c["name"]: c for c in data["checkpoints"]}
    bad = by_name["step-30"]
    assert not bad["valid"] and "does not match its sha256" in bad["reason"]
    assert bad["step"] == 30 and bad["tokens_seen"] == 30 * 4096 and bad["layout"] == LAYOUT
    assert bad["size_bytes"] > 0 and bad["optimizer"] == "adamw"
    assert data["auto_resume"] == str(run / "checkpoints" / "step-20")
    assert by_name["step-20"]["auto_resume"] and not by_name["model/step-20"]["auto_resume"]
    assert by_name["model/step-20"]["kind"] == "model"


def test_inspect_one_checkpoint_and_one_written_before_manifests(cli, run):
    (run / "checkpoints" / "step-30" / "manifest.json").unlink()
    result = cli("ckpt", "inspect", run / "checkpoints" / "step-30", "--full")
    assert result.code == 0, result.text
    assert "INVALID: no manifest.json: written before integrity manifests" in result.out
    assert "auto-resume would pick" in result.out and "step-20" in result.out.splitlines()[-1]


@pytest.mark.parametrize("path", ["nope", "config-only-file"], ids=["missing", "not-a-run-dir"])
def test_inspect_and_diff_bad_path(cli, tmp_path, new_toml, path):
    (tmp_path / "config-only-file").write_text("x")
    for args in (("inspect",), ("diff", "--config", new_toml)):
        result = cli("ckpt", args[0], tmp_path / path, *args[1:])
        assert result.code == 2, result.text
        assert "Traceback" not in result.text and result.out == ""
        assert result.err.count("error:") == 1 and "fix: pass runs/<name>" in result.err


def test_diff_same_layout_can_resume(cli, run, new_toml):
    result = cli("ckpt", "diff", run, "--config", new_toml)
    assert result.code == 0, result.text
    assert (
        "step-30 (step 30, 2 ranks)" in result.out
        and "on 2 ranks (from the checkpoint)" in result.out
    )
    for axis in ("dp_shard", "tp", "pp", "ep", "zero_stage", "pp_schedule"):
        assert f"{axis} " in result.out
    assert "reshards" not in result.out and "same (2)" in result.out
    assert "CAN RESUME: same layout" in result.out


def test_diff_reshards_dp_tp_pp_ep(cli, run, new_toml):
    result = cli(
        "ckpt", "diff", run, "--config", new_toml, "--world-size", "16",
        "--set", "parallel.tp=2", "--set", "parallel.pp=2", "--set", "parallel.ep=2",
        "--set", "parallel.zero_stage=3",
    )  # fmt: skip
    assert result.code == 0, result.text
    for line in (
        "dp_shard            reshards: 2 -> 4",
        "tp                  reshards: 1 -> 2",
        "pp                  reshards: 1 -> 2",
        "ep                  reshards: 1 -> 2",
        "zero_stage          reshards: 2 -> 3",
        "dp_replicate        same (1)",
    ):
        assert line in result.out
    assert "dp 2 -> 4 only changes how each step's samples are split" in result.out
    assert "122,880 tokens seen" in result.out
    assert "CAN RESUME: DCP reshards the model and optimizer state" in result.out


def test_diff_json(cli, run, new_toml):
    result = cli("ckpt", "diff", run, "--config", new_toml, "--world-size", "4", "--json")
    assert result.code == 0, result.text
    data = result.json()
    assert data["can_resume"] and data["blockers"] == []
    assert data["checkpoint"] == str(run / "checkpoints" / "step-30")
    assert data["world_size_from"] == "--world-size" and data["new_world_size"] == 4
    axes = {a["axis"]: a for a in data["axes"]}
    assert axes["dp_shard"] == {"axis": "dp_shard", "old": 2, "new": 4, "status": "reshards"}


@pytest.mark.parametrize(
    ("override", "field"),
    [("model.dim=256", "model.dim"), ("model.num_routed_experts=16", "model.num_routed_experts")],
)
def test_diff_architecture_change_cannot_resume(cli, run, new_toml, override, field):
    result = cli("ckpt", "diff", run, "--config", new_toml, "--set", override)
    assert result.code == 1, result.text
    assert "CANNOT RESUME (1):" in result.out
    assert f"{field}: " in result.out and "the weights cannot carry over" in result.out


def test_an_older_versions_zero1_checkpoint_can_resume(cli, tmp_path, new_toml):
    """ZeRO-1 used to refuse checkpoints; one written by an older dstrain (or by ZeRO-1 at dp 1,
    which it allowed) reads like any other: same names, same manifest format."""
    run = tmp_path / "old"
    writer = store.CheckpointWriter(
        run / "checkpoints", keep_last_k=0, async_save=False, is_main=True
    )
    meta = _meta(10) | {"dstrain_version": "0.1.0", "layout": {**LAYOUT, "zero_stage": 1}}
    writer.save(10, {"model": {"w": torch.ones(8)}}, meta)
    writer.close()
    result = cli("ckpt", "diff", run, "--config", new_toml, "--set", "parallel.zero_stage=1")
    assert result.code == 0, result.text
    assert "CAN RESUME" in result.out


def test_diff_names_every_blocker(cli, run, new_toml):
    result = cli(
        "ckpt", "diff", run / "checkpoints" / "step-20", "--config", new_toml, "--json",
        "--world-size", "3", "--set", "parallel.tp=2", "--set", "optim.name=sgd",
        "--set", "parallel.zero_stage=1", "--set", "model.num_layers=6",
    )  # fmt: skip
    assert result.code == 1, result.text
    keys = [b["key"] for b in result.json()["blockers"]]
    # ZeRO-1 checkpoints reshard like every other stage: no blocker.
    assert keys == ["model.num_layers", "optim.name", "parallel.dp_shard"]


def test_diff_model_only_or_invalid_checkpoints_cannot_resume(cli, run, new_toml):
    model_only = cli(
        "ckpt", "diff", run / "checkpoints" / "model" / "step-20", "--config", new_toml
    )
    assert model_only.code == 1 and "kind: a model-only checkpoint" in model_only.out
    _corrupt(run / "checkpoints" / "step-30")
    picked = cli("ckpt", "diff", run, "--config", new_toml)
    assert picked.code == 0 and "step-20 (step 20" in picked.out  # as auto-resume would
    named = cli("ckpt", "diff", run / "checkpoints" / "step-30", "--config", new_toml)
    assert named.code == 1 and "step-30 cannot resume: " in named.err
    assert "Traceback" not in named.text


def test_diff_unreadable_config(cli, run, tmp_path):
    result = cli("ckpt", "diff", run, "--config", tmp_path / "missing.toml")
    assert result.code == 2 and "Traceback" not in result.text


def test_inspect_and_diff_import_no_torch(run, new_toml):
    code = (
        "import sys; from dstrain.cli import main; "
        f"main(['ckpt', 'inspect', {str(run)!r}]); "
        f"main(['ckpt', 'diff', {str(run)!r}, '--config', {str(new_toml)!r}]); "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_export_hf_is_still_registered(cli):
    result = cli("ckpt", "export-hf", "--help")
    assert result.code == 0 and "safetensors" in result.out
