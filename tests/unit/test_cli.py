"""The CLI as a user meets it: help, version, exit codes, JSON, and no tracebacks."""

import json
import subprocess
import sys

import pytest

from dstrain import __version__
from tests.conftest import run_cli


def test_version(cli):
    result = cli("--version")
    assert result.code == 0 and __version__ in result.out


def test_help_lists_every_subcommand(cli):
    result = cli("--help")
    assert result.code == 0
    for name in (
        "train",
        "check",
        "convert",
        "config",
        "plan",
        "schedule",
        "bench",
        "doctor",
        "deploy",
        "report",
        "ckpt",
        "loss-compare",
    ):
        assert name in result.out


def test_check_help_documents_exit_codes_and_world_size(cli):
    result = cli("check", "--help")
    assert result.code == 0
    for word in ("--world-size", "--nodes", "--gpus-per-node", "--json", "--set", "exit status"):
        assert word in result.out


def test_check_json_shape(cli, tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("[parallel]\ntp = 3\n")
    result = cli("check", path, "--world-size", "6", "--json")
    assert result.code == 1
    items = result.json()
    assert items and all(set(i) == {"severity", "key", "message", "fix"} for i in items)
    assert any(i["severity"] == "error" and i["key"] == "model.num_heads" for i in items)


def test_check_exit_codes(cli, tmp_path):
    clean = tmp_path / "clean.toml"
    clean.write_text("[train]\nsteps = 10\n")
    assert cli("check", clean, "--world-size", "1").code == 0
    warned = tmp_path / "warn.toml"
    warned.write_text("[optim]\nlr = 1e-9\n")
    assert cli("check", warned, "--world-size", "1").code == 0
    broken = tmp_path / "broken.toml"
    broken.write_text("[train\n")
    result = cli("check", broken)
    assert result.code == 2 and "line 1" in result.err
    assert cli("check", tmp_path / "missing.toml").code == 2
    as_json = cli("check", broken, "--json")
    assert as_json.code == 2
    assert as_json.json()[0]["severity"] == "error" and "line 1" in as_json.json()[0]["message"]


def test_check_nodes_times_gpus(cli, tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("[parallel]\ntp = 4\ndp_shard = 2\nzero_stage = 2\n")
    assert cli("check", path, "--nodes", "1", "--gpus-per-node", "8").code == 0
    assert cli("check", path, "--nodes", "2", "--gpus-per-node", "8").code == 1


def test_check_rules_listing(cli):
    result = cli("check", "--rules", "--json")
    names = [r["rule"] for r in result.json()]
    assert "batch" in names and "world_size" in names and "zero" in names
    assert all(r["description"] for r in result.json())


def test_bad_flags_are_short_errors(cli):
    result = cli("check", "x.toml", "--world-size", "zero")
    assert result.code == 2 and "invalid int value" in result.err
    result = cli("check", "x.toml", "--world-size", "0")
    assert result.code == 2 and ">= 1" in result.err
    result = cli("config", "--set", "novalue")
    assert result.code == 2 and "section.key=value" in result.err


def test_config_prints_resolved_toml_and_json(cli, tmp_path):
    result = cli("config", "--set", "parallel.tp=2", "--set", "run.name=x")
    assert result.code == 0
    assert "[parallel]" in result.out and "tp = 2" in result.out
    data = cli("config", "--set", "parallel.tp=2", "--json").json()
    assert data["parallel"]["tp"] == 2
    saved = tmp_path / "resolved.toml"
    saved.write_text(result.out)
    assert cli("config", saved).out == result.out


def test_config_refuses_a_broken_config(cli):
    result = cli("config", "--set", "parallel.tpp=2")
    assert result.code == 1 and "did you mean `tp`" in result.err


def test_explain_covers_every_key(cli):
    from dstrain.preflight.explain import explain

    docs = explain()
    assert all(d.description for d in docs), [d.key for d in docs if not d.description]
    result = cli("config", "--explain")
    assert result.code == 0
    for doc in docs:
        assert doc.key in result.out
    one = cli("config", "--explain", "parallel.ep")
    assert "dp_shard x cp x tp" in one.out and "parallel.tp " not in one.out
    assert "deepseek-v3" in cli("config", "--explain", "model").out


def test_explain_unknown_key_suggests(cli):
    result = cli("config", "--explain", "parallel.tpp")
    assert result.code == 1 and "parallel.tp" in result.err


def test_train_rejects_bad_config_before_anything(cli):
    result = cli("train", "--set", "parallel.tp=3")
    assert result.code == 1 and "parallel" in result.err and "Traceback" not in result.text


def _run(*args):
    return subprocess.run(
        [sys.executable, "-m", "dstrain", *args], capture_output=True, text=True, timeout=60
    )


def test_python_m_dstrain_and_check_never_imports_torch(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("[parallel]\ntp = 2\n")
    probe = (
        f"import sys; from dstrain.cli import main; code = main(['check', {str(path)!r}, "
        "'--world-size', '2']); print('torch' in sys.modules); sys.exit(code)"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("False")
    assert _run("--version").stdout.strip() == f"dstrain {__version__}"


def test_invalid_json_via_subprocess_has_no_traceback(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{"a": 1 "b": 2}')
    result = _run("check", str(path))
    assert result.returncode == 2
    assert "Traceback" not in result.stderr and "line 1, column 9" in result.stderr
    json.dumps(result.stderr)


@pytest.mark.parametrize("bad", ["5:3", "x", "0:2", "3"])
def test_train_refuses_a_malformed_profile_range(bad):
    result = run_cli("train", "--profile-steps", bad)
    assert result.code == 2 and "A:B with 1 <= A <= B" in result.err
    assert "Traceback" not in result.text
