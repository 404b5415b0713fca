"""A planner layout as the config the trainer runs, and the trainer's own verdict on it: the same
rules `dstrain check` applies (and `dstrain train` before it starts), so a layout the planner
calls legal is one the trainer accepts."""

from pathlib import Path

from dstrain.config.findings import Finding
from dstrain.config.model_args import ModelArgs
from dstrain.config.schema import DstrainConfig
from dstrain.hardware import GPUSpec
from dstrain.planner.layout import Cluster, Layout
from dstrain.preflight.rules import CheckTarget, run_rules


def to_config(
    layout: Layout, cluster: Cluster, *, flavor: str | None, hf_config: Path | None
) -> DstrainConfig:
    """The config for `layout`: the model by flavor or HF config.json, the parallel and train
    sections, and the cluster."""
    model = {"hf_config": str(hf_config)} if hf_config else {"flavor": flavor or "debug"}
    return DstrainConfig.model_validate(
        {
            "model": model,
            "parallel": {
                "dp_shard": layout.dp,
                "tp": layout.tp,
                "pp": layout.pp,
                "ep": layout.ep,
                "cp": layout.cp,
                "zero_stage": layout.zero,
                "sequence_parallel": layout.sequence_parallel,
                "moe_tp": layout.moe_tp,
                "ep_overlap": layout.ep_overlap,
                "pp_overlap": layout.pp_overlap,
                "offload_optimizer": layout.offload,
                "pp_schedule": layout.schedule,
                "num_virtual_stages": virtual_stages(layout),
            },
            "train": {
                "micro_batch_size": layout.micro_batch,
                "global_batch_size": layout.global_batch,
                "seq_len": layout.seq_len,
                "precision": layout.precision if layout.precision != "fp32" else "bf16",
                "activation_checkpoint": layout.recompute,
            },
            "optim": {"moments": layout.adam_moments},
            "cluster": {
                "gpu": cluster.gpu.name,
                "nodes": cluster.nodes,
                "gpus_per_node": min(cluster.gpus_per_node, cluster.num_gpus),
                "inter_node_gbps": cluster.inter_node_gbps,
            },
        }
    )


def virtual_stages(layout: Layout) -> int:
    """The config's `parallel.num_virtual_stages` for the layout's schedule."""
    if layout.schedule in ("zbv", "dualpipev"):
        return 2
    return layout.virtual_stages if layout.schedule == "interleaved-1f1b" else 1


def trainer_errors(args: ModelArgs, layout: Layout, cluster: Cluster) -> list[Finding]:
    """The errors `dstrain check` would report for this layout (empty: legal)."""
    config = to_config(layout, cluster, flavor=None, hf_config=None)
    return config_errors(config, layout.world, args, cluster.gpu)


def config_errors(
    config: DstrainConfig, world: int, args: ModelArgs, gpu: GPUSpec | None
) -> list[Finding]:
    """The errors `dstrain check` would report for `config` on `world` ranks of `gpu` (None: a
    CPU host, or unknown), the data source aside (the planner reads none)."""
    target = CheckTarget(config, world, args, gpu)
    return [f for f in run_rules(target) if f.severity == "error" and f.key != "data.source"]
