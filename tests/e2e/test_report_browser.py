"""`dstrain report`'s index.html as a user opens it: in headless Chromium every plot loads, the
page is not blank, and a deleted PNG shows as broken (so this test can fail)."""

import shutil
from pathlib import Path

import pytest

from dstrain.report.plots import FIGURE_NAMES
from tests.browser import MIN_PIXEL_STD, pixel_std, rendered_images
from tests.conftest import run_cli
from tests.synthetic_run import write_run
from tests.tools import require_tool

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def chromium() -> str:
    return require_tool("chromium")


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> tuple[Path, list[str]]:
    """A report of a synthetic run with every figure: its folder and the PNGs it wrote."""
    run = write_run(tmp_path_factory.mktemp("runs"))
    result = run_cli("report", run, "--json")
    assert result.code == 0, result.text
    answer = result.json()
    assert answer["plots"] == [f"{name}.png" for name in FIGURE_NAMES]
    return Path(answer["output"]), answer["plots"]


def test_every_plot_loads(chromium, report, tmp_path):
    out, plots = report
    images = rendered_images(chromium, tmp_path, out / "index.html")
    assert images.states == dict.fromkeys(plots, "loaded")
    assert images.visible_missing == 0


def test_the_page_is_not_blank(chromium, report, tmp_path):
    out, _ = report
    assert pixel_std(chromium, tmp_path, "about:blank") < MIN_PIXEL_STD  # the check can fail
    assert pixel_std(chromium, tmp_path, (out / "index.html").as_uri()) > MIN_PIXEL_STD


def test_a_deleted_plot_shows_as_broken(chromium, report, tmp_path):
    out, plots = report
    copy = shutil.copytree(out, tmp_path / "report")
    (copy / "mfu.png").unlink()
    images = rendered_images(chromium, tmp_path, copy / "index.html")
    assert images.states == {**dict.fromkeys(plots, "loaded"), "mfu.png": "broken"}
    assert images.visible_missing == 1
