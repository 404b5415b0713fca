"""`dstrain deploy`: Docker, Kubernetes, Slurm and bare-metal launch files from one config.

Pure Python (no torch): a resolved `DeploySpec` (spec.py) goes through one renderer per target
and comes out as a mapping of file names to text; write.py puts them into the output folder.
Every target runs the same torchrun command line (launch.py) on the same config.toml.
"""

from dstrain.deploy.render import TARGETS, render
from dstrain.deploy.spec import DeploySpec, resolve_spec

__all__ = ["TARGETS", "DeploySpec", "render", "resolve_spec"]
