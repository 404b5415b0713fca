"""Headless Chromium for the report tests: the DOM it renders (each <img>'s load state) and a
screenshot's pixel spread (a blank page is ~0)."""

import subprocess
from html.parser import HTMLParser
from pathlib import Path

import matplotlib.image

FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--virtual-time-budget=5000",
)
MIN_PIXEL_STD = 0.02  # a white page is 0; the report's page is ~0.1


class Images(HTMLParser):
    """Each <img>'s src -> data-state, and the "plot missing" notes left visible."""

    def __init__(self) -> None:
        super().__init__()
        self.states: dict[str, str | None] = {}
        self.visible_missing = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = dict(attrs)
        if tag == "img":
            self.states[found["src"]] = found.get("data-state")
        elif tag == "p" and found.get("class") == "missing" and "hidden" not in found:
            self.visible_missing += 1


def run_chromium(chromium: str, tmp: Path, url: str, *args: str) -> str:
    profile = tmp / "profile"
    command = [chromium, *FLAGS, f"--user-data-dir={profile}", *args, url]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def rendered_images(chromium: str, tmp: Path, page: Path) -> Images:
    parser = Images()
    parser.feed(run_chromium(chromium, tmp, page.as_uri(), "--dump-dom"))
    return parser


def pixel_std(chromium: str, tmp: Path, url: str) -> float:
    shot = tmp / "page.png"
    run_chromium(chromium, tmp, url, f"--screenshot={shot}", "--window-size=1200,2000")
    return float(matplotlib.image.imread(shot)[..., :3].std())
