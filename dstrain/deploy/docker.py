"""The container image: a CUDA base matching torch's CUDA build, dependencies pinned to what is
installed here, dstrain from the source tree, and torchrun as the entry point.

Why these bases: torch's CUDA wheels bundle their own CUDA runtime, cuBLAS, cuDNN and NCCL as
pip packages, so the base image only has to agree with them (same CUDA major.minor, so tools and
extensions compiled in the image link against the same runtime) and fix the host driver floor.
nvidia/cuda's `-cudnn-runtime-ubuntu24.04` tags are the smallest official images with the CUDA
runtime and a Python 3.12 distribution.
"""

import re
import tomllib
from importlib import metadata
from pathlib import Path

from dstrain.deploy.spec import CONFIG_NAME, DeploySpec

# torch CUDA build -> (pinned nvidia/cuda tag, minimum host driver from NVIDIA's CUDA notes)
CUDA_BUILDS = {
    "cu126": ("nvidia/cuda:12.6.3-cudnn-runtime-ubuntu24.04", "560"),
    "cu128": ("nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04", "570"),
    "cu130": ("nvidia/cuda:13.0.1-cudnn-runtime-ubuntu24.04", "580"),
}
TORCH_INDEX = "https://download.pytorch.org/whl/{cuda}"
CONFIG_DIR = "/etc/dstrain"
WORKDIR = "/workspace"
DOCKERFILE = "Dockerfile"
DOCKERIGNORE = "Dockerfile.dockerignore"  # BuildKit reads <Dockerfile>.dockerignore beside it


def runtime_requirements() -> list[str]:
    """dstrain's runtime requirements: from the source tree's pyproject.toml when there is one
    (it is the image's build context, and an editable install's metadata can be stale), else
    from the installed distribution's metadata."""
    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    if pyproject.is_file():
        return list(tomllib.loads(pyproject.read_text())["project"]["dependencies"])
    return metadata.requires("dstrain") or []


def installed_pins(requirements: list[str] | None = None) -> dict[str, str]:
    """The runtime requirements and everything they pull in, at the versions installed here
    (local tags such as torch's `+cpu` dropped: the image takes torch from the CUDA index)."""
    todo = [_name(r) for r in (runtime_requirements() if requirements is None else requirements)]
    pins: dict[str, str] = {}
    while todo:
        name = todo.pop()
        if name is None or name.lower() in {p.lower() for p in pins}:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # an optional platform dependency not installed here: left to pip
        pins[dist.metadata["Name"]] = dist.version.split("+", 1)[0]
        todo.extend(_name(r) for r in dist.requires or [])
    return pins


def _name(requirement: str) -> str | None:
    """The distribution name of a requirement string; None for an extra's requirement."""
    spec, _, marker = requirement.partition(";")
    if "extra" in marker:
        return None
    match = re.match(r"[A-Za-z0-9._-]+", spec.strip())
    assert match, requirement
    return match.group(0)


def render_dockerfile(spec: DeploySpec, pins: dict[str, str]) -> str:
    base, driver = CUDA_BUILDS[spec.cuda]
    cuda = base.split(":")[1].split("-")[0]
    constraints = "\n".join(
        f"{n}=={v}" for n, v in sorted(pins.items(), key=lambda p: p[0].lower())
    )
    return f"""# syntax=docker/dockerfile:1
# dstrain training image, rendered by `dstrain deploy docker` for job "{spec.job_name}".
# Build it from the dstrain source tree:  docker build -f <DIR>/{DOCKERFILE} -t {spec.image} .
# Base: CUDA {cuda} to match torch's {spec.cuda} wheels (they bundle their own CUDA libraries
# and NCCL; the base keeps the system CUDA the same); host driver >= {driver}.
FROM {base}

ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 \\
    VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH
# Distribution packages float within the pinned base image's release: an exact apt version
# pin breaks the build as soon as Ubuntu's archive moves on (hadolint DL3008).
# hadolint ignore=DL3008
RUN apt-get update \\
 && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \\
 && rm -rf /var/lib/apt/lists/* \\
 && python3 -m venv /opt/venv

# dstrain's dependencies, pinned to the versions installed where this was rendered.
COPY <<'CONSTRAINTS' /opt/constraints.txt
{constraints}
CONSTRAINTS

# torch from the {spec.cuda} index (PyPI's default wheel may target another CUDA).
RUN pip install -c /opt/constraints.txt torch --index-url {TORCH_INDEX.format(cuda=spec.cuda)}

WORKDIR /opt/dstrain
COPY . .
RUN pip install -c /opt/constraints.txt . && python3 -c "import dstrain.config"

WORKDIR {WORKDIR}
# The resolved config is mounted at {CONFIG_DIR}/{CONFIG_NAME} (Kubernetes: a ConfigMap;
# docker run: -v <DIR>:{CONFIG_DIR}:ro), so one image serves every run.
ENTRYPOINT ["python3", "-m", "torch.distributed.run"]
CMD ["--standalone", "--nproc-per-node={spec.gpus_per_node}", "-m", "dstrain.train", \\
     "{CONFIG_DIR}/{CONFIG_NAME}"]
"""


def render_dockerignore() -> str:
    return """# Keep the build context to the package source: no runs, caches, venvs or VCS data.
.git
**/__pycache__
**/*.pyc
.venv
venv
runs
.cache
.pytest_cache
.ruff_cache
deploy
tests
benchmarks
"""
