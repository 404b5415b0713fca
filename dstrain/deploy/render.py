"""One entry point for every target: the files it writes, as name -> text. config.toml is in
every set: the launch files point at it, and it is exactly what runs."""

from dstrain.deploy import docker, kubernetes, slurm
from dstrain.deploy.spec import CONFIG_NAME, DeploySpec

# `bare` is launch.sh alone; `slurm` writes launch.sh too, so both share one torchrun command.
TARGETS = ("docker", "k8s", "slurm", "bare")
EXECUTABLE = {slurm.LAUNCH_NAME, slurm.SBATCH_NAME}


def render(target: str, spec: DeploySpec, pins: dict[str, str] | None = None) -> dict[str, str]:
    """The files of `target`. `pins` (docker only) are the dependency versions to pin; None =
    the versions installed here."""
    files = {CONFIG_NAME: spec.config_toml}
    if target == "docker":
        pins = docker.installed_pins() if pins is None else pins
        files[docker.DOCKERFILE] = docker.render_dockerfile(spec, pins)
        files[docker.DOCKERIGNORE] = docker.render_dockerignore()
    elif target == "k8s":
        files[kubernetes.MANIFEST] = kubernetes.render_manifests(spec)
    elif target == "slurm":
        files[slurm.SBATCH_NAME] = slurm.render_sbatch(spec)
        files[slurm.LAUNCH_NAME] = slurm.render_launch_sh(spec)
    elif target == "bare":
        files[slurm.LAUNCH_NAME] = slurm.render_launch_sh(spec)
    else:
        raise AssertionError(f"unknown target {target}")  # argparse's choices guard this
    return files
