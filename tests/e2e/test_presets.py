"""The three reference-cluster presets (docs/presets.md) as a user runs them: `dstrain check`
accepts each on its cluster, `dstrain plan --json` prices its layout there (the very layout of
the file, and it fits), the dry run of rank 0 and of the last rank fits the GPU's memory, and
`dstrain deploy` renders it for its cluster's natural target.

"Fits" for a dry run: what it measures (model states and the step's activation peak) plus what
no dry run sees, taken from the planner for the same layout: the allocator's fragmentation over
those activations, and the CUDA context, NCCL's buffers and cuBLAS's workspaces. The A100 preset
builds two tensor-parallel ranks in one process, which the dry run's DTensor caches once broke.
"""

import functools
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from dstrain.config.load import load_config
from dstrain.hardware import gpu_spec
from dstrain.planner.layout import layout_from_config
from dstrain.planner.overhead import FRAGMENTATION
from tests.conftest import REPO, run_cli

pytestmark = pytest.mark.slow

GiB = 2**30
EXAMPLES = REPO / "examples"


@dataclass(frozen=True)
class Preset:
    model: str  # the flavor the planner prices
    target: str  # the deploy target its cluster runs
    deploy_flags: tuple[str, ...] = ()


PRESETS = {
    "dev-4x-rtx4090": Preset("debug", "docker"),
    "a100-80gb-x8": Preset("deepseek-v2-lite", "k8s"),
    # ep 64 spans 4 of its 16-GPU nodes, as DeepSeek's spans 8 of its 8-GPU nodes
    "h800-128x16": Preset("deepseek-v3", "slurm", ("--allow-cross-node-ep",)),
}
FILES = {
    "docker": {"config.toml", "Dockerfile", "Dockerfile.dockerignore"},
    "k8s": {"config.toml", "dstrain.yaml"},
    "slurm": {"config.toml", "dstrain.sbatch", "launch.sh"},
}


def _path(name: str) -> Path:
    return EXAMPLES / f"{name}.toml"


def _config(name: str) -> Any:
    return load_config(_path(name)).config


def _world(config: Any) -> int:
    return config.cluster.nodes * config.cluster.gpus_per_node


def _plan_flags(name: str) -> list[str]:
    """`dstrain plan` flags for the preset's model on its cluster, every layout knob fixed."""
    config = _config(name)
    c, layout = config.cluster, layout_from_config(config, _world(config))
    flags = [
        "--model", PRESETS[name].model, "--gpu", c.gpu, "--num-gpus", _world(config),
        "--gpus-per-node", c.gpus_per_node, "--network", c.network,
        "--tp", layout.tp, "--pp", layout.pp, "--ep", layout.ep, "--cp", layout.cp,
        "--zero", layout.zero, "--micro-batch", layout.micro_batch,
        "--global-batch", layout.global_batch, "--seq-len", layout.seq_len,
        "--schedule", layout.schedule, "--recompute", layout.recompute,
        "--precision", layout.precision,
    ]  # fmt: skip
    if layout.sequence_parallel:
        flags.append("--sequence-parallel")
    return [str(f) for f in flags]


@functools.cache
def _priced(name: str) -> dict[str, Any]:
    """The planner's JSON for the preset's layout on its cluster."""
    result = run_cli("plan", *_plan_flags(name), "--json")
    assert result.code == 0, result.text
    return result.json()


@pytest.mark.parametrize("name", list(PRESETS))
def test_check_accepts_the_preset_on_its_cluster(name):
    result = run_cli("check", _path(name), "--json")
    assert result.code == 0, result.text
    assert not [f for f in result.json() if f["severity"] in ("error", "warning")], result.text


@pytest.mark.parametrize("name", list(PRESETS))
def test_plan_prices_the_presets_own_layout_and_it_fits(name):
    config = _config(name)
    answer, layout = _priced(name), layout_from_config(config, _world(config))
    priced = answer["layout"]
    for knob in ("dp", "tp", "pp", "ep", "cp", "zero", "micro_batch", "global_batch", "seq_len"):
        assert priced[knob] == getattr(layout, knob), (knob, priced[knob], layout)
    for knob in ("schedule", "recompute", "precision", "sequence_parallel"):
        assert priced[knob] == getattr(layout, knob), (knob, priced[knob], layout)
    assert answer["legal"] and answer["fits"], answer["illegal_reasons"]
    memory = answer["memory_gib_per_gpu"]
    assert memory["peak"] <= memory["capacity"] == gpu_spec(config.cluster.gpu).hbm_gb * 1e9 / GiB
    assert answer["step_time_s"] > 0 and 0 < answer["mfu"] < 1


def _device_peak(report: dict[str, Any], memory: dict[str, float]) -> float:
    """Bytes on the device: the dry run's model states and activation peak, the allocator's
    fragmentation over those activations, and the planner's overhead outside both (the CUDA
    context, NCCL's buffers, cuBLAS's workspaces)."""
    activations = report["activation_peak_bytes"]
    unseen = (memory["overhead"] - memory["fragmentation"]) * GiB
    return report["model_states_bytes"] + activations * (1 + FRAGMENTATION) + unseen


@pytest.mark.parametrize("name", list(PRESETS))
def test_the_dry_run_of_the_first_and_last_rank_fits_the_gpu(name):
    config = _config(name)
    world = _world(config)
    done = run_cli("train", _path(name), "--dry-run", "--json")  # ranks 0 and world - 1
    assert done.code == 0, done.text
    reports = done.json()
    assert [r["rank"] for r in reports] == [0, world - 1]
    capacity = gpu_spec(config.cluster.gpu).hbm_gb * 1e9
    memory = _priced(name)["memory_gib_per_gpu"]
    for report in reports:
        assert report["step"].startswith("ran"), report["step"]
        peak = _device_peak(report, memory)
        print(
            f"{name} rank {report['rank']}: model states "
            f"{report['model_states_bytes'] / GiB:.1f} GiB + activations "
            f"{report['activation_peak_bytes'] / GiB:.1f} GiB = "
            f"{(report['model_states_bytes'] + report['activation_peak_bytes']) / GiB:.1f} GiB, "
            f"{peak / GiB:.1f} GiB on the device of {capacity / GiB:.1f}; "
            f"{report['seconds']['total']:.1f} s"
        )
        assert peak <= capacity, (report["rank"], peak / GiB, capacity / GiB)


@pytest.mark.parametrize("name", list(PRESETS))
def test_deploy_renders_the_preset_for_its_target(name, tmp_path):
    preset, config = PRESETS[name], _config(name)
    out = tmp_path / preset.target
    done = run_cli("deploy", preset.target, _path(name), "-o", out, *preset.deploy_flags, "--json")
    assert done.code == 0, done.text
    facts = done.json()
    assert {Path(p).name for p in facts["files"]} == FILES[preset.target]
    assert (facts["nodes"], facts["gpus_per_node"], facts["world_size"]) == (
        config.cluster.nodes,
        config.cluster.gpus_per_node,
        _world(config),
    )
    assert facts["network"] == config.cluster.network
    rendered = tomllib.loads((out / "config.toml").read_text())
    assert rendered["parallel"]["ep"] == config.parallel.ep
    assert rendered["parallel"]["tp"] == config.parallel.tp


def test_the_h800_preset_is_the_published_v3_layout_on_16_gpu_nodes():
    """Only the cluster differs from examples/deepseek-v3-h800x2048.toml (256 x 8), so the
    model-state parity of tests/unit/test_dry_run.py at 2048 ranks holds for it too."""
    preset = tomllib.loads(_path("h800-128x16").read_text())
    published = tomllib.loads((EXAMPLES / "deepseek-v3-h800x2048.toml").read_text())
    for section in ("model", "parallel", "train", "optim", "lr"):
        assert preset[section] == published[section], section
    cluster = preset["cluster"]
    assert (cluster["nodes"], cluster["gpus_per_node"], cluster["network"]) == (128, 16, "ib-ndr")
