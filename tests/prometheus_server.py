"""A real Prometheus server for end-to-end tests: it scrapes the given targets every second, and
`query` / `wait_for_series` read back what it stored through its HTTP API. The first scrape comes
about 5 s after start (Prometheus hands new targets to its scrapers on a 5 s tick), so give
`wait_for_series` 20 s or so; it returns as soon as the series are there.

    with prometheus_server(["127.0.0.1:9400"], tmp_path) as base_url:
        series = wait_for_series(base_url, 'dstrain_loss_main{run="e2e"}', timeout_s=20)
"""

import contextlib
import json
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from tests.distributed.harness import free_port
from tests.tools import require_tool

SCRAPE_INTERVAL_S = 1


@contextlib.contextmanager
def prometheus_server(targets: list[str], tmp_path: Path) -> Iterator[str]:
    """Run Prometheus (job `dstrain`, scraping `targets`, "host:port" each) until the block ends;
    yields its base URL. Its config, data and log live in tmp_path/prometheus/."""
    binary = require_tool("prometheus")
    folder = tmp_path / "prometheus"
    folder.mkdir()
    config = folder / "prometheus.yml"
    config.write_text(_config(targets))
    for _ in range(3):  # the free port may be taken before Prometheus binds it
        port = free_port()
        process = _start(binary, config, folder, port)
        base_url = f"http://127.0.0.1:{port}"
        try:
            if _wait_ready(base_url, process, timeout_s=30):
                yield base_url
                return
            if process.poll() is None:
                break  # running but never ready: not a port clash, retrying will not help
        finally:
            _stop(process)
    raise RuntimeError(f"Prometheus did not start; its log:\n{_log_tail(folder)}")


def query(base_url: str, promql: str) -> list:
    """The result vector of an instant query: [{"metric": {labels}, "value": [time, "value"]}]."""
    url = f"{base_url}/api/v1/query?{urllib.parse.urlencode({'query': promql})}"
    with urllib.request.urlopen(url, timeout=5) as response:
        body = json.load(response)
    assert body["status"] == "success", body
    return body["data"]["result"]


def wait_for_series(base_url: str, promql: str, timeout_s: float, *, count: int = 1) -> list:
    """Polls `promql` until it returns at least `count` series (the targets are scraped once a
    second), and returns them; fails the test after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = query(base_url, promql)
        if len(result) >= count:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(
                f"{promql} gave {len(result)} series after {timeout_s} s, wanted {count}: "
                f"{result}\ntargets: {_targets(base_url)}"
            )
        time.sleep(0.2)


def _config(targets: list[str]) -> str:
    listed = ", ".join(json.dumps(target) for target in targets)  # JSON strings are YAML
    return (
        "global:\n"
        f"  scrape_interval: {SCRAPE_INTERVAL_S}s\n"
        f"  scrape_timeout: {SCRAPE_INTERVAL_S}s\n"
        f"  evaluation_interval: {SCRAPE_INTERVAL_S}s\n"
        "scrape_configs:\n"
        "  - job_name: dstrain\n"
        f"    static_configs:\n      - targets: [{listed}]\n"
    )


def _start(binary: str, config: Path, folder: Path, port: int) -> subprocess.Popen:
    with (folder / "prometheus.log").open("a") as log:
        return subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={folder / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
                "--storage.tsdb.retention.time=1h",
                "--query.lookback-delta=30s",  # a stopped target's series vanish sooner
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )


def _wait_ready(base_url: str, process: subprocess.Popen, timeout_s: float) -> bool:
    """True once /-/ready answers 200; False if the process exits first (port taken)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            return False
        with (
            contextlib.suppress(OSError),  # refused, reset, or 503 while the TSDB opens
            urllib.request.urlopen(f"{base_url}/-/ready", timeout=1) as response,
        ):
            if response.status == 200:
                return True
        time.sleep(0.1)
    return False


def _stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _targets(base_url: str) -> list[dict]:
    """What Prometheus says about each target (health, last error): the first thing to read
    when a series does not come back."""
    with urllib.request.urlopen(f"{base_url}/api/v1/targets", timeout=5) as response:
        active = json.load(response)["data"]["activeTargets"]
    return [{key: t.get(key) for key in ("scrapeUrl", "health", "lastError")} for t in active]


def _log_tail(folder: Path) -> str:
    return "\n".join((folder / "prometheus.log").read_text().splitlines()[-20:])
