"""A real Prometheus server scrapes two ranks' exporters; its query API returns every rank's series
with the run, rank, layer, expert and axis labels, in base units, typed as the exporter says."""

import json
import time
import urllib.request

import pytest

from dstrain.metrics.prometheus import PrometheusSink
from tests.prometheus_server import prometheus_server, query, wait_for_series

pytestmark = pytest.mark.slow


def rank_metrics(rank: int) -> dict:
    return {
        "loss/main": 2.5 + rank,
        "moe/layer1/max_over_mean": 1.25,
        "moe/layer1/tokens_per_expert": [6.0, 0.0, 2.0],
        "comm/ep/exposed_fraction": 0.1 * (rank + 1),
        "comm/exposed_fraction": 0.3,
        "time/step_s": 0.5 * (rank + 1),
        "memory/rss_mb": 100.0,
        "pipeline/time_f_ms": 20.0,
        "guard/bad_steps": 2.0,
    }


def values(result: list, *labels: str) -> dict[tuple[str, ...], float]:
    return {tuple(s["metric"][label] for label in labels): float(s["value"][1]) for s in result}


def test_prometheus_scrapes_every_rank(tmp_path):
    sinks = [PrometheusSink(0, run="e2e", rank=rank) for rank in (0, 1)]
    try:
        for rank, sink in enumerate(sinks):
            sink.write(100, rank_metrics(rank))
        with prometheus_server([f"127.0.0.1:{sink.port}" for sink in sinks], tmp_path) as url:
            loss = wait_for_series(url, 'dstrain_loss_main{run="e2e"}', timeout_s=20, count=2)
            assert values(loss, "rank") == {("0",): 2.5, ("1",): 3.5}
            assert {s["metric"]["job"] for s in loss} == {"dstrain"}

            load = query(url, 'dstrain_moe_tokens_per_expert{run="e2e", rank="1"}')
            assert values(load, "layer", "expert") == {
                ("layer1", "0"): 6.0,
                ("layer1", "1"): 0.0,
                ("layer1", "2"): 2.0,
            }
            imbalance = query(url, 'dstrain_moe_max_over_mean{layer="layer1"}')
            assert values(imbalance, "rank") == {("0",): 1.25, ("1",): 1.25}
            comm = query(url, 'dstrain_comm_exposed_fraction{run="e2e"}')
            assert values(comm, "rank", "axis") == {
                ("0", "ep"): 0.1,
                ("1", "ep"): 0.2,
                ("0", "all"): 0.3,
                ("1", "all"): 0.3,
            }
            assert values(query(url, "dstrain_step"), "rank") == {("0",): 100, ("1",): 100}
            beats = values(query(url, "time() - dstrain_step_timestamp_seconds"), "rank")
            assert set(beats) == {("0",), ("1",)} and all(0 <= v < 60 for v in beats.values())

            # dstrain's units become base units on the way out: s, MiB, ms.
            step = query(url, 'dstrain_time_step_seconds{run="e2e"}')
            assert values(step, "rank") == {("0",): 0.5, ("1",): 1.0}
            rss = query(url, 'dstrain_memory_rss_bytes{run="e2e"}')
            assert values(rss, "rank") == {("0",): 100 * 2**20, ("1",): 100 * 2**20}
            action = query(url, 'dstrain_pipeline_action_seconds{run="e2e", rank="0"}')
            assert values(action, "action") == {("F",): 0.02}
            bad = query(url, 'dstrain_guard_bad_steps_total{run="e2e"}')
            assert values(bad, "rank") == {("0",): 2, ("1",): 2}
            assert metric_types(url, "dstrain_guard_bad_steps", "dstrain_time_step_seconds") == {
                "dstrain_guard_bad_steps": "counter",
                "dstrain_time_step_seconds": "gauge",
            }
    finally:
        for sink in sinks:
            sink.close()


def metric_types(url: str, *families: str) -> dict[str, str]:
    """The type Prometheus recorded for each family, from its metadata API (filled at the first
    scrape, so it may trail the samples by a moment)."""
    deadline = time.monotonic() + 10
    while True:
        with urllib.request.urlopen(f"{url}/api/v1/metadata", timeout=5) as response:
            metadata = json.load(response)["data"]
        found = {name: metadata[name][0]["type"] for name in families if name in metadata}
        if len(found) == len(families) or time.monotonic() > deadline:
            return found
        time.sleep(0.2)
