"""From a config file and the command line's flags to a checked DeploySpec: the same load and
pre-flight as `dstrain check` for the target world size, then the placement rule."""

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dstrain.config.load import load_config, to_toml
from dstrain.config.validate import raise_if_errors
from dstrain.deploy.spec import DeploySpec, check_placement, resolve_spec
from dstrain.preflight.preflight import preflight


@dataclass
class Built:
    spec: DeploySpec
    warnings: list[str]


def build_spec(
    path: Path,
    overrides: list[str],
    *,
    nodes: int | None = None,
    gpus_per_node: int | None = None,
    allow_cross_node_ep: bool = False,
    **flags: Any,
) -> Built:
    """Load `path` with `overrides`; `nodes`/`gpus_per_node` (None = the cluster section's)
    are written into the config, so config.toml says the shape it runs on."""
    loaded = load_config(path, overrides)
    cluster = loaded.config.cluster
    # Assigning marks them as set, so check's cluster-vs-world rule sees them.
    cluster.nodes = nodes or cluster.nodes
    cluster.gpus_per_node = gpus_per_node or cluster.gpus_per_node
    raise_if_errors(preflight(loaded, world_size=cluster.nodes * cluster.gpus_per_node))
    warnings = check_placement(
        loaded.config, cluster.nodes, cluster.gpus_per_node, allow_cross_node_ep
    )
    spec = resolve_spec(loaded.config, to_toml(loaded.config), **flags)
    return Built(spec, warnings)
