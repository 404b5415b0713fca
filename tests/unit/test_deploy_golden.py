"""Golden files: every target rendered from examples/debug.toml on 2 nodes x 8 GPUs, compared
byte for byte with tests/golden/deploy/<variant>/. A change to the output must be looked at:
DSTRAIN_UPDATE_GOLDEN=1 pytest tests/unit/test_deploy_golden.py rewrites them."""

import os
import shutil
from pathlib import Path

import pytest

from dstrain.deploy import render
from dstrain.deploy.build import build_spec

REPO = Path(__file__).resolve().parents[2]
GOLDEN = REPO / "tests" / "golden" / "deploy"
DEBUG = REPO / "examples" / "debug.toml"
# The image pins whatever is installed where it is rendered; the golden files use fixed ones.
PINS = {"torch": "2.13.0", "pydantic": "2.14.4", "PyYAML": "6.0.4", "numpy": "2.4.6"}
IMAGE = "registry.example.com/dstrain:0.1.0"

VARIANTS = {
    "docker": ("docker", {}),
    "k8s": ("k8s", {"pvc": "dstrain-runs"}),
    "k8s-pytorchjob-volcano": (
        "k8s",
        {"k8s_kind": "pytorchjob", "gang": "volcano", "node_selector": {"pool": "h100"}},
    ),
    "slurm": ("slurm", {"partition": "gpu", "time": "48:00:00"}),
    "bare": ("bare", {}),
}


def rendered(variant: str) -> dict[str, str]:
    target, flags = VARIANTS[variant]
    built = build_spec(DEBUG, [], nodes=2, gpus_per_node=8, image=IMAGE, max_restarts=3, **flags)
    return render(target, built.spec, pins=PINS)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_rendered_files_match_the_golden_ones(variant):
    files = rendered(variant)
    folder = GOLDEN / variant
    if os.environ.get("DSTRAIN_UPDATE_GOLDEN") == "1":
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        for name, text in files.items():
            (folder / name).write_text(text)
    assert folder.is_dir(), f"no golden files: run with DSTRAIN_UPDATE_GOLDEN=1 to write {folder}"
    assert {p.name for p in folder.iterdir()} == set(files)
    for name, text in files.items():
        assert text == (folder / name).read_text(), (
            f"{variant}/{name} differs from the golden file; if the change is intended, "
            "rerun with DSTRAIN_UPDATE_GOLDEN=1 and review the diff"
        )


def test_every_target_ships_the_same_config():
    configs = {variant: rendered(variant)["config.toml"] for variant in VARIANTS}
    assert len(set(configs.values())) == 1
