"""Property test: whatever the config and shape, `deploy` writes its files or answers with one
message and a non-zero exit, never a traceback."""

import tempfile
from pathlib import Path

import tomli_w
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.e2e.test_deploy_cli import deploy_cli
from tests.unit.test_never_traceback import native

SETTINGS = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@SETTINGS
@given(
    data=native,
    target=st.sampled_from(["docker", "k8s", "slurm", "bare"]),
    nodes=st.integers(1, 5),
    gpus=st.integers(1, 9),
)
def test_deploy_answers_any_config(data, target, nodes, gpus):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "run.toml"
        try:
            path.write_text(tomli_w.dumps(data))
        except (TypeError, ValueError):  # a value TOML cannot hold (None)
            return
        out = Path(tmp) / "out"
        args = (target, path, "-o", out, "--nodes", nodes, "--gpus-per-node", gpus)
        done = deploy_cli(*args, "--allow-cross-node-ep", "--k8s-kind", "pytorchjob")
        assert "Traceback" not in done.text
        if done.code == 0:
            assert (out / "config.toml").is_file()
        else:
            assert "error" in done.err and not out.exists()
