"""The Prometheus exporter: names, labels, base units and metric types as scraped over HTTP, the
port's life cycle, and the Grafana dashboard against the series the exporter writes.
(tests/unit/test_promtool.py has Prometheus' own linter judge the names.)"""

import itertools
import json
import re
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from dstrain.errors import UserError
from dstrain.metrics.prometheus import PrometheusSink, prometheus_name
from tests.conftest import REPO

DASHBOARD = REPO / "dashboards" / "grafana" / "dstrain.json"
AXES = ("dp", "tp", "ep", "pp", "cp", "world")


def exposition(port: int) -> str:
    """The text the exporter serves at /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return response.read().decode()


def families(port: int) -> list:
    return list(text_string_to_metric_families(exposition(port)))


def scrape(port: int) -> dict[tuple[str, frozenset], float]:
    """{(name, labels): value} for every sample the exporter serves."""
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in families(port)
        for sample in family.samples
    }


def series(name: str, value: float, **labels: str) -> tuple[tuple[str, frozenset], float]:
    return (name, frozenset({"run": "t", "rank": "3", **labels}.items())), value


@pytest.fixture
def sink():
    sink = PrometheusSink(0, run="t", rank=3)
    yield sink
    sink.close()


def test_every_kind_of_key_is_named_and_labelled(sink):
    sink.write(
        40,
        {
            "loss/main": 2.5,
            "throughput/mfu": 0.41,
            "moe/layer1/cv": 0.2,
            "moe/layer1/tokens_per_expert": [4.0, 0.0, 2.0],
            "moe/max_over_mean": 1.7,
            "moe/dead_experts": 1.0,
            "comm/ep/exposed_fraction": 0.12,
            "comm/world/bytes_per_step": 1e6,
            "comm/exposed_fraction": 0.2,
            "comm/exposed_fraction_max": 0.3,
            "new-thing/odd.key": 7.0,
        },
    )
    scraped = scrape(sink.port)
    heartbeat = scraped.pop(series("dstrain_step_timestamp_seconds", 0)[0])
    assert scraped == dict(
        [
            series("dstrain_loss_main", 2.5),
            series("dstrain_throughput_mfu", 0.41),
            series("dstrain_moe_cv", 0.2, layer="layer1"),
            series("dstrain_moe_tokens_per_expert", 4.0, layer="layer1", expert="0"),
            series("dstrain_moe_tokens_per_expert", 0.0, layer="layer1", expert="1"),
            series("dstrain_moe_tokens_per_expert", 2.0, layer="layer1", expert="2"),
            series("dstrain_moe_max_over_mean", 1.7, layer="all"),
            series("dstrain_moe_dead_experts", 1.0, layer="all"),
            series("dstrain_comm_exposed_fraction", 0.12, axis="ep"),
            series("dstrain_comm_bytes_per_step", 1e6, axis="world"),
            series("dstrain_comm_exposed_fraction", 0.2, axis="all"),
            series("dstrain_comm_exposed_fraction_max", 0.3, axis="all"),
            series("dstrain_new_thing_odd_key", 7.0),
            series("dstrain_step", 40),
        ]
    )
    assert time.time() - 60 < heartbeat <= time.time()


# Prometheus wants base units (seconds, bytes, FLOP/s) and `_total` on counters; dstrain's keys
# keep their own units (MiB, ms, s, TFLOP/s), so the exporter renames and converts.
UNITS = [
    ("time/step_s", 0.5, series("dstrain_time_step_seconds", 0.5)),
    ("time/data_s", 0.25, series("dstrain_time_data_seconds", 0.25)),
    ("memory/rss_mb", 3.0, series("dstrain_memory_rss_bytes", 3 * 2**20)),
    ("memory/model_states_mb", 0.5, series("dstrain_memory_model_states_bytes", 2**19)),
    ("pipeline/time_b_ms", 12.0, series("dstrain_pipeline_action_seconds", 0.012, action="B")),
    ("pipeline/time_w_ms", 4.0, series("dstrain_pipeline_action_seconds", 0.004, action="W")),
    ("throughput/tokens_per_s", 900.0, series("dstrain_throughput_tokens_per_second", 900.0)),
    (
        "throughput/tokens_per_s_per_device",
        450.0,
        series("dstrain_throughput_tokens_per_second_per_device", 450.0),
    ),
    (
        "throughput/tflops_per_device",
        1.5,
        series("dstrain_throughput_flops_per_second_per_device", 1.5e12),
    ),
    ("guard/bad_steps", 2.0, series("dstrain_guard_bad_steps_total", 2.0)),
]


def test_units_become_base_units(sink):
    sink.write(7, {key: value for key, value, _ in UNITS})
    scraped = scrape(sink.port)
    for key, _, ((name, labels), converted) in UNITS:
        assert scraped[name, labels] == pytest.approx(converted, rel=1e-12), key
        assert prometheus_name(key) == (name, dict(labels - {("run", "t"), ("rank", "3")}))


def test_cumulative_keys_are_counters_and_the_rest_gauges(sink):
    sink.write(3, {"guard/bad_steps": 1.0, "loss/main": 2.0})
    types = {family.name: family.type for family in families(sink.port)}
    assert types["dstrain_guard_bad_steps"] == "counter"  # the parser strips `_total`
    assert {types[n] for n in ("dstrain_loss_main", "dstrain_step")} == {"gauge"}
    assert types["dstrain_step_timestamp_seconds"] == "gauge"


def test_a_later_write_replaces_the_values_and_rewind_keeps_them(sink):
    sink.write(10, {"loss/main": 3.0, "moe/layer2/tokens_per_expert": [1.0, 1.0]})
    sink.write(20, {"loss/main": 2.0, "moe/layer2/tokens_per_expert": [0.0, 2.0]})
    sink.rewind(10)
    scraped = scrape(sink.port)
    assert dict([series("dstrain_loss_main", 2.0), series("dstrain_step", 20)]).items() <= (
        scraped.items()
    )
    assert scraped[series("dstrain_moe_tokens_per_expert", 0, layer="layer2", expert="1")[0]] == 2


def test_two_keys_with_one_name_and_other_labels_warn_and_keep_the_first(sink):
    sink.write(1, {"moe_cv": 1.0})
    with pytest.warns(UserWarning, match="dstrain_moe_cv"):
        sink.write(2, {"moe/layer1/cv": 2.0})
    assert scrape(sink.port)[series("dstrain_moe_cv", 0)[0]] == 1.0


def test_close_frees_the_port():
    first = PrometheusSink(0, run="t", rank=0)
    port = first.port
    first.close()
    second = PrometheusSink(port, run="t", rank=0)
    second.write(1, {"loss/main": 1.0})
    assert scrape(port)[series("dstrain_loss_main", 1.0, rank="0")[0]] == 1.0
    second.close()
    second.close()  # twice is harmless


def test_a_port_in_use_is_a_user_error_naming_it(sink):
    with pytest.raises(UserError) as caught:
        PrometheusSink(sink.port, run="t", rank=1)
    assert str(sink.port) in caught.value.message
    assert "metrics.prometheus_port" in caught.value.fix
    assert caught.value.__cause__ is None and caught.value.__suppress_context__


def test_an_address_not_on_this_machine_is_a_user_error():
    with pytest.raises(UserError, match="203.0.113.1") as caught:
        PrometheusSink(0, "203.0.113.1", run="t", rank=0)  # TEST-NET-3: never local
    assert "metrics.prometheus_host" in caught.value.fix


# The dashboard cannot drift: every series it queries, with every label it filters on, is one the
# exporter writes for the documented keys.


def documented_keys() -> list[str]:
    """Every key in the key tables of docs/observability.md and docs/pipeline.md, placeholders
    filled in (`<layer>` -> layer1, `<axis>` -> each axis, `{f,b}` -> f and b)."""
    sections = [("observability.md", "## Keys"), ("pipeline.md", "## Measured bubble")]
    keys = []
    for doc, heading in sections:
        section = (REPO / "docs" / doc).read_text().split(heading, 1)[1].split("\n## ", 1)[0]
        for line in section.splitlines():
            if line.startswith("| `"):
                for key in re.findall(r"`([a-z_]+/[^`]+)`", line.split(" | ")[0]):
                    keys.extend(_expand(key))
    return sorted({key for key in keys if "*" not in key})


def _expand(key: str) -> list[str]:
    key = key.replace("<layer>", "layer1")
    choices = [
        AXES if part == "<axis>" else part[1:-1].split(",") if part.startswith("{") else [part]
        for part in re.split(r"(<axis>|\{[a-z,]+\})", key)
    ]
    return ["".join(parts) for parts in itertools.product(*choices)]


def test_the_documented_keys_are_found():
    keys = documented_keys()
    assert {"loss/main", "comm/tp/bytes_per_step", "moe/layer1/cv"} <= set(keys)
    assert {"pipeline/time_w_ms", "pipeline/bubble_fraction_theory", "guard/bad_steps"} <= set(keys)
    assert all(prometheus_name(key)[0].startswith("dstrain_") for key in keys)


def exported_labels() -> dict[str, set[str]]:
    """{series name: its label names} when every documented key is logged."""
    metrics = {
        key: [1.0, 2.0] if key.endswith("tokens_per_expert") else 1.0 for key in documented_keys()
    }
    sink = PrometheusSink(0, run="t", rank=0)
    try:
        sink.write(1, metrics)
        scraped = scrape(sink.port)
    finally:
        sink.close()
    labels: dict[str, set[str]] = {}
    for name, pairs in scraped:
        labels.setdefault(name, set()).update(label for label, _ in pairs)
    return labels


def dashboard_queries(dashboard: dict) -> list[str]:
    exprs = [t["expr"] for panel in all_panels(dashboard) for t in panel.get("targets", [])]
    variables = dashboard["templating"]["list"]
    return exprs + [v["definition"] for v in variables if v["type"] == "query"]


def all_panels(dashboard: dict) -> list[dict]:
    return [p for top in dashboard["panels"] for p in [top, *top.get("panels", [])]]


def test_the_dashboard_queries_only_exported_series_and_labels():
    exported = exported_labels()
    queries = dashboard_queries(json.loads(DASHBOARD.read_text()))
    names = {name for q in queries for name in re.findall(r"dstrain_[a-z0-9_]+", q)}
    assert names - set(exported) == set(), "the dashboard queries series the exporter never writes"
    for q in queries:
        for name, selector in re.findall(r"(dstrain_[a-z0-9_]+)\{([^}]*)\}", q):
            used = set(re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", selector))
            assert used <= exported[name], f"{q}: {name} has no label {used - exported[name]}"


def test_the_dashboard_is_an_importable_shape():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["schemaVersion"] >= 36 and dashboard["title"] and dashboard["uid"]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for name in ("run", "rank"):
        assert variables[name]["type"] == "query"
        assert variables[name]["definition"].startswith("label_values(")
    panels = all_panels(dashboard)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    cells = set()
    for panel in dashboard["panels"]:
        pos = panel["gridPos"]
        assert set(pos) == {"h", "w", "x", "y"} and pos["x"] + pos["w"] <= 24, panel["title"]
        cell = {(pos["x"] + i, pos["y"] + j) for i in range(pos["w"]) for j in range(pos["h"])}
        assert not cells & cell, f"{panel['title']} overlaps another panel"
        cells |= cell
    for panel in panels:
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"], panel["title"]
        assert len({t["refId"] for t in panel["targets"]}) == len(panel["targets"])
        assert all(
            t["expr"] and t["datasource"]["uid"] == "${datasource}" for t in panel["targets"]
        )


@pytest.mark.parametrize(
    ("title", "line"), [("Comm exposed fraction", 0.15), ("Pipeline bubble", 0.05)]
)
def test_the_dashboard_draws_the_threshold_lines(title, line):
    panel = next(p for p in all_panels(json.loads(DASHBOARD.read_text())) if p["title"] == title)
    defaults = panel["fieldConfig"]["defaults"]
    assert defaults["custom"]["thresholdsStyle"]["mode"].startswith("line")
    assert line in [step["value"] for step in defaults["thresholds"]["steps"]]
