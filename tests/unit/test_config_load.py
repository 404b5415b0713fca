"""Loading configs from TOML/YAML/JSON, overrides and their precedence, and TOML round-trips."""

import json
from pathlib import Path

import pytest

from dstrain.config.load import load_config, to_toml
from dstrain.config.overrides import apply_overrides, parse_override
from dstrain.config.schema import DstrainConfig
from dstrain.errors import UserError

TOML = """
[parallel]
tp = 2
dp_shard = 2

[train]
steps = 50
seq_len = 64
"""


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("run.toml", TOML),
        ("run.yaml", "parallel:\n  tp: 2\n  dp_shard: 2\ntrain:\n  steps: 50\n  seq_len: 64\n"),
        (
            "run.json",
            json.dumps(
                {"parallel": {"tp": 2, "dp_shard": 2}, "train": {"steps": 50, "seq_len": 64}}
            ),
        ),
        ("run.conf", TOML),  # no known extension: sniffed
    ],
)
def test_every_format_loads_the_same_config(tmp_path, name, text):
    loaded = load_config(_write(tmp_path, name, text))
    assert loaded.findings == []
    assert loaded.source == "dstrain"
    assert loaded.config.parallel.tp == 2
    assert loaded.config.parallel.dp_shard == 2
    assert loaded.config.train.steps == 50
    assert loaded.config.optim.lr == DstrainConfig().optim.lr  # default kept


def test_precedence_cli_over_file_over_defaults(tmp_path):
    path = _write(tmp_path, "run.toml", TOML)
    loaded = load_config(path, ["parallel.tp=4", "optim.lr=3e-4", "model.flavor=deepseek-v3"])
    c = loaded.config
    assert c.parallel.tp == 4  # CLI beats file
    assert c.parallel.dp_shard == 2  # file beats default
    assert c.optim.lr == 3e-4  # CLI beats default
    assert c.train.precision == "fp32"  # default
    assert c.model.flavor == "deepseek-v3"


def test_later_override_wins_and_values_are_typed():
    data = apply_overrides(
        {},
        [
            "train.steps=5",
            "train.steps=7",
            "optim.betas=[0.8, 0.9]",
            "train.deterministic=true",
            "run.name=my-run",
        ],
    )
    assert data == {
        "train": {"steps": 7, "deterministic": True},
        "optim": {"betas": [0.8, 0.9]},
        "run": {"name": "my-run"},
    }


@pytest.mark.parametrize("bad", ["parallel.tp", "=3", "parallel..tp=2", ".tp=1"])
def test_malformed_override_is_a_user_error(bad):
    with pytest.raises(UserError, match="section.key=value"):
        parse_override(bad)


def test_resolved_config_round_trips_through_toml(tmp_path):
    original = load_config(
        _write(tmp_path, "run.toml", TOML),
        [
            "model.num_layers=6",
            "optim.betas=[0.8, 0.99]",
            "checkpoint.model_only_interval=5",
            "cluster.gpu=H100",
            "train.loss_scale.initial_scale_power=12",
        ],
    ).config
    dumped = _write(tmp_path, "resolved.toml", to_toml(original))
    again = load_config(dumped)
    assert again.findings == []
    assert again.config == original
    assert to_toml(again.config) == to_toml(original)


def test_unknown_keys_are_errors_with_suggestions(tmp_path):
    path = _write(
        tmp_path,
        "run.toml",
        "[parallel]\ntpp = 2\n[train]\nsteps = 10\nseq_lenght = 5\n[optimiser]\nlr = 1\n",
    )
    loaded = load_config(path)
    messages = {f.key: f.message for f in loaded.findings}
    assert "did you mean `tp`" in messages["parallel.tpp"]
    assert "did you mean `seq_len`" in messages["train.seq_lenght"]
    assert "did you mean `optim`" in messages["optimiser"]
    assert all(f.severity == "error" for f in loaded.findings)
    # The rest of the file still took effect: every problem is reported at once.
    assert loaded.config.train.steps == 10


def test_wrong_types_are_reported_per_key_and_defaults_fill_in(tmp_path):
    path = _write(
        tmp_path, "run.toml", '[train]\nsteps = "many"\nseq_len = -3\n[parallel]\ntp = 2\n'
    )
    loaded = load_config(path)
    keys = sorted(f.key for f in loaded.findings)
    assert keys == ["train.seq_len", "train.steps"]
    assert loaded.config.parallel.tp == 2
    assert loaded.config.train.steps == DstrainConfig().train.steps


@pytest.mark.parametrize(
    ("name", "text", "line"),
    [
        # a missing comma mid-line (one at a line's end DeepSpeed's hjson reader accepts)
        ("bad.json", '{"train_batch_size": 8 "steps_per_print": 1}\n', 1),
        ("bad.toml", "[train]\nsteps = = 3\n", 2),
        ("bad.yaml", "train:\n  steps: 3\n   seq_len: [\n", 3),
    ],
)
def test_syntax_errors_give_line_and_column(tmp_path, name, text, line):
    with pytest.raises(UserError) as info:
        load_config(_write(tmp_path, name, text))
    assert f"line {line}" in info.value.message
    assert "column" in info.value.message
    assert info.value.exit_code == 2


def test_missing_file_and_directory_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="not found"):
        load_config(tmp_path / "nope.toml")
    with pytest.raises(UserError, match="directory"):
        load_config(tmp_path)


def test_top_level_must_be_a_table(tmp_path):
    with pytest.raises(UserError, match="top level is a list"):
        load_config(_write(tmp_path, "list.json", "[1, 2]"))


def test_empty_files_mean_defaults(tmp_path):
    for name in ("empty.toml", "empty.yaml"):
        loaded = load_config(_write(tmp_path, name, ""))
        assert loaded.config == DstrainConfig()
        assert loaded.findings == []


def test_another_engines_file_is_refused_with_the_commands_that_read_it(tmp_path, cli):
    """load_config reads dstrain's own config only (the trainer carries no engine catalogue):
    a DeepSpeed JSON or a launch script gets one message naming check and convert."""
    ds = tmp_path / "ds_config.json"
    ds.write_text('{"train_batch_size": 8, "zero_optimization": {"stage": 2}}')
    script = tmp_path / "pretrain.sh"
    script.write_text("torchrun pretrain_gpt.py --num-layers 8\n")
    for path in (ds, script):
        result = cli("train", path)
        assert result.code == 2, result.text
        assert "is not a dstrain config" in result.err and "Traceback" not in result.text
        assert f"dstrain convert {path} -o run.toml" in result.err
        assert cli("check", path).code in (0, 1), path  # check still reads it
