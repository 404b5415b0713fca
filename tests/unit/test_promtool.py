"""Prometheus' own tool judges what dstrain ships for Prometheus: `promtool check metrics` lints the
exporter's real output (base units, `_total` on counters, help text), `promtool check rules` and
`promtool test rules` the alerting rules of dashboards/prometheus/, and `promtool check rules` the
Grafana dashboard's PromQL, written out as recording rules. promtool comes with Prometheus
(Debian `prometheus`, which scripts/install-test-deps.sh installs)."""

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from dstrain.metrics.prometheus import PrometheusSink
from tests.conftest import REPO
from tests.tools import require_tool
from tests.unit.test_prometheus_sink import (
    DASHBOARD,
    dashboard_queries,
    documented_keys,
    exposition,
)

RULES = REPO / "dashboards" / "prometheus"
ALERTS = RULES / "alerts.yml"
ALERT_TESTS = RULES / "alerts_test.yml"


@pytest.fixture(scope="module")
def promtool() -> str:
    return require_tool("promtool")


def run(promtool: str, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [promtool, *args], input=stdin, capture_output=True, text=True, timeout=60
    )


# The exporter's names.


def exporter_output() -> str:
    """What one rank serves after logging every documented key."""
    metrics = {
        key: [1.0, 2.0] if key.endswith("tokens_per_expert") else 1.0 for key in documented_keys()
    }
    sink = PrometheusSink(0, run="t", rank=0)
    try:
        sink.write(1, metrics)
        return exposition(sink.port)
    finally:
        sink.close()


def test_promtool_finds_nothing_to_say_about_the_exporters_names(promtool):
    text = exporter_output()
    checked = run(promtool, "check", "metrics", stdin=text)
    assert (checked.returncode, checked.stdout + checked.stderr) == (0, "")
    families = re.findall(r"^# TYPE (\S+) (\S+)", text, re.M)
    assert len(families) >= 35 and ("dstrain_guard_bad_steps_total", "counter") in families


def test_promtool_would_flag_the_old_names(promtool):
    """The lint is live: dstrain's own units (the names before the exporter converted them)
    are each flagged."""
    old = ["dstrain_time_step_s", "dstrain_memory_rss_mb", "dstrain_throughput_tokens_per_s"]
    text = "".join(f"# HELP {n} h\n# TYPE {n} gauge\n{n} 1\n" for n in old)
    checked = run(promtool, "check", "metrics", stdin=text)
    assert checked.returncode != 0
    assert [line.split()[0] for line in checked.stderr.splitlines()] == sorted(old)


# The alerting rules.


def test_the_alerting_rules_pass_promtool_check_rules(promtool):
    checked = run(promtool, "check", "rules", str(ALERTS))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {len(alert_names())} rules found" in checked.stdout


def test_the_alerting_rules_pass_their_unit_tests(promtool):
    tested = run(promtool, "test", "rules", str(ALERT_TESTS))
    assert tested.returncode == 0, tested.stdout + tested.stderr
    assert "SUCCESS" in tested.stdout


def alert_names() -> list[str]:
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return [rule["alert"] for group in groups for rule in group["rules"] if "alert" in rule]


def test_every_alert_is_tested_both_firing_and_quiet():
    cases = [
        case
        for test in yaml.safe_load(ALERT_TESTS.read_text())["tests"]
        for case in test["alert_rule_test"]
    ]
    fires = {case["alertname"] for case in cases if case["exp_alerts"]}
    quiet = {case["alertname"] for case in cases if not case["exp_alerts"]}
    names = set(alert_names())
    assert names == {
        "DstrainNoStepProgress",
        "DstrainRankHeartbeatStale",
        "DstrainLossNotFinite",
        "DstrainLossSpike",
        "DstrainGuardRefusedSteps",
        "DstrainThroughputDrop",
        "DstrainMfuDrop",
        "DstrainCommExposedHigh",
        "DstrainPipelineBubbleHigh",
    }
    assert fires == names and quiet == names


# Each edit loosens or breaks one alert; its unit test must notice.
MUTATIONS = [
    ("> 600", "> 6000"),
    ("> 300", "> 3000"),
    ("[30m])\n          ) > 300", "[1m])\n          ) > 300"),  # heartbeat forgets a lost rank
    (" or abs(dstrain_loss_main) == Inf", ""),  # infinite loss unnoticed
    ("> 1.3 * quantile_over_time", "> 1.5 * quantile_over_time"),
    ("increase(dstrain_guard_bad_steps_total[30m])) > 0", "dstrain_guard_bad_steps_total) > 1"),
    (
        "< 0.7 * quantile_over_time(0.5, dstrain_throughput_tokens",
        "< 0.4 * quantile_over_time(0.5, dstrain_throughput_tokens",
    ),
    ("dstrain_throughput_mfu < 0.7", "dstrain_throughput_mfu < 0.85"),  # `wobbly` would fire
    ('{axis="all"}) > 0.15', ") > 0.15"),  # one axis alone would fire
    ("dstrain_pipeline_bubble_fraction) > 0.05", "dstrain_pipeline_bubble_fraction) > 0.1"),
]


@pytest.mark.parametrize(("old", "new"), MUTATIONS, ids=[m[1] or m[0] for m in MUTATIONS])
def test_the_unit_tests_catch_a_changed_rule(promtool, tmp_path, old, new):
    shutil.copy(ALERT_TESTS, tmp_path)
    rules = ALERTS.read_text()
    assert rules.count(old) == 1, old
    (tmp_path / ALERTS.name).write_text(rules.replace(old, new))
    assert run(promtool, "check", "rules", str(tmp_path / ALERTS.name)).returncode == 0
    assert run(promtool, "test", "rules", str(tmp_path / ALERT_TESTS.name)).returncode == 1


# The dashboard's PromQL.

# Grafana's template variables and what each stands for in a plain PromQL query.
VARIABLES = {"$run": ".+", "$rank": ".+", "$layer": ".+"}


def dashboard_recording_rules() -> dict:
    """Every query of the dashboard (panel targets, and the selector inside each variable's
    `label_values(...)`) as a recording rule, the template variables filled in."""
    rules = []
    for i, query in enumerate(dashboard_queries(json.loads(DASHBOARD.read_text()))):
        variable = re.fullmatch(r"label_values\((.+), *\w+\)", query)
        expr = variable[1] if variable else query
        for name, value in VARIABLES.items():
            expr = expr.replace(name, value)
        assert "$" not in expr, f"a template variable the test does not know: {query}"
        rules.append({"record": f"dashboard:query_{i}", "expr": expr})
    return {"groups": [{"name": "dstrain-dashboard", "rules": rules}]}


def test_the_dashboards_promql_passes_promtool_check_rules(promtool, tmp_path):
    rules = dashboard_recording_rules()
    count = len(rules["groups"][0]["rules"])
    assert count >= 30  # 32 panel targets and 3 variables today
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump(rules, sort_keys=False))
    checked = run(promtool, "check", "rules", str(path))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {count} rules found" in checked.stdout


def test_promtool_check_rules_rejects_bad_promql(promtool, tmp_path):
    """The check reads the PromQL: a query Prometheus would refuse fails it."""
    broken = {
        "groups": [{"name": "g", "rules": [{"record": "r", "expr": "rate(dstrain_step[5m]"}]}]
    }
    path = tmp_path / "broken.yml"
    path.write_text(yaml.safe_dump(broken))
    assert run(promtool, "check", "rules", str(path)).returncode == 1


def test_the_example_scrape_config_loads_the_alerting_rules(promtool):
    checked = run(promtool, "check", "config", str(REPO / "dashboards" / "prometheus.yml"))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert Path(ALERTS).name in checked.stdout
