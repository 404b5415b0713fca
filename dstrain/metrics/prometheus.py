"""The Prometheus exporter: each rank serves its latest metrics at http://HOST:PORT/metrics.

Every key of docs/observability.md becomes a series labelled `run` and `rank`, created the first
time the key is logged. Names follow Prometheus' conventions (base units, `_total` on counters),
which `tests/unit/test_promtool.py` checks with `promtool check metrics`:

- any key: `dstrain_` + the key with each character outside `[a-zA-Z0-9_]` turned into `_`
  (`loss/main` -> `dstrain_loss_main`, `throughput/mfu` -> `dstrain_throughput_mfu`);
- units become base units, the value converted with them: `_mb` (MiB) -> `_bytes`, `_ms` and
  `_s` -> `_seconds`, `per_s` -> `per_second`, `tflops` -> `flops_per_second`
  (`time/step_s` -> `dstrain_time_step_seconds`, `memory/rss_mb` -> `dstrain_memory_rss_bytes`);
- a cumulative key (`guard/bad_steps`) is a counter and ends in `_total`; every other is a gauge;
- `moe/<layer>/<stat>` -> `dstrain_moe_<stat>{layer="<layer>"}`, and the list
  `moe/<layer>/tokens_per_expert` -> `dstrain_moe_tokens_per_expert{layer=.., expert="0".."E-1"}`;
- `moe/<stat>` (the whole model: `moe/max_over_mean`, `moe/dead_experts`) ->
  `dstrain_moe_<stat>{layer="all"}`;
- `comm/<axis>/<stat>` -> `dstrain_comm_<stat>{axis="<axis>"}`;
- `pipeline/time_<a>_ms` (a = f, b, i, w) -> `dstrain_pipeline_action_seconds{action="F"}` etc.;
- `comm/<stat>` (`comm/exposed_fraction`, `comm/exposed_fraction_max`) ->
  `dstrain_comm_<stat>{axis="all"}`;
- `dstrain_step`: the step of the last write, and `dstrain_step_timestamp_seconds`: when it was
  written (Unix time), the heartbeat the alerting rules of dashboards/prometheus/ watch.

Why `layer="all"` and `axis="all"`: the whole-model figure shares its name with the per-layer
(per-axis) one, and a Prometheus name keeps one label set; so every `dstrain_moe_*` series has a
`layer` label and every `dstrain_comm_*` series an `axis` label. Filter `layer!="all"` before
summing over layers. A list under any other key gets an `index` label instead of `expert`.
The JSONL and TensorBoard keys keep dstrain's own units; only these exposition names change.
"""

import errno
import functools
import re
import threading
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from dstrain.errors import UserError
from dstrain.metrics.sinks import Metrics

PREFIX = "dstrain_"
WHOLE = "all"  # the layer / axis label of a whole-model moe/ or comm/ figure
_SCOPE_LABEL = {"moe": "layer", "comm": "axis"}
_INVALID = re.compile(r"[^a-zA-Z0-9_]")
# dstrain's unit words (one `_`-separated word of a key) -> the Prometheus base unit and the factor
# that converts the value. MB in dstrain is MiB (2**20 bytes: dstrain/metrics/processor.py).
_BASE_UNITS = {
    "mb": ("bytes", 2**20),
    "ms": ("seconds", 1e-3),
    "s": ("seconds", 1.0),
    "tflops": ("flops_per_second", 1e12),
}
# `pipeline/time_<a>_ms`, one key per schedule action (F, B, I, W), is one series with an
# `action` label: a dimension belongs in a label, and promtool reads a lone `b` as a unit (bits).
_ACTION_TIME = re.compile(r"pipeline/time_([a-z])_ms")
# Keys that only grow during a run (a restarted process starts again, which is a counter reset).
COUNTERS = frozenset({"guard/bad_steps"})


@dataclass(frozen=True)
class Series:
    """Where one metrics key goes: its Prometheus name (as queried), the labels the key itself
    carries, the factor into base units, and the metric type."""

    name: str
    labels: dict[str, str]
    scale: float
    kind: str  # "gauge" or "counter"
    help: str


@functools.cache
def prometheus_series(key: str) -> Series:
    """How `key` is exported (docs/observability.md, "## Prometheus"); cached, keys repeat."""
    scope, *rest = key.split("/")
    action = _ACTION_TIME.fullmatch(key)
    if action:
        path, labels, about = (
            "pipeline/action_ms",
            {"action": action[1].upper()},
            "pipeline/time_<a>_ms",
        )
    elif scope in _SCOPE_LABEL and rest:
        label = _SCOPE_LABEL[scope]
        where, stat = (rest[0], rest[1:]) if len(rest) > 1 else (WHOLE, rest)
        path, labels = "/".join([scope, *stat]), {label: where}
        about = f"{scope}/<{label}>/{'/'.join(stat)}, {label}={WHOLE!r} for {path}"
    else:
        path, labels, about = key, {}, key
    name, scale = _base_units(_INVALID.sub("_", path))
    kind = "counter" if key in COUNTERS else "gauge"
    if kind == "counter":
        name += "_total"
    unit = f", times {scale:g} into base units" if scale != 1 else ""
    return Series(PREFIX + name, labels, scale, kind, f"dstrain metrics key {about}{unit}")


def prometheus_name(key: str) -> tuple[str, dict[str, str]]:
    """The Prometheus name of a metrics key (as queried) and the labels the key itself carries."""
    series = prometheus_series(key)
    return series.name, dict(series.labels)


def _base_units(name: str) -> tuple[str, float]:
    words, scale = name.split("_"), 1.0
    for i, word in enumerate(words):
        if word in _BASE_UNITS:
            unit, factor = _BASE_UNITS[word]
            per = i > 0 and words[i - 1] == "per"  # tokens_per_s: a rate, singular
            words[i], scale = ("second" if per and word == "s" else unit), scale * factor
    return "_".join(words), scale


@dataclass
class _Family:
    kind: str
    help: str
    label_names: tuple[str, ...]
    values: dict[tuple[str, ...], float] = field(default_factory=dict)


class _Latest(Collector):
    """The latest value of every series. `collect` runs on the HTTP server's thread, so a write
    and a scrape take turns under one lock: a scrape never sees half a log line."""

    def __init__(self) -> None:
        self.families: dict[str, _Family] = {}
        self.lock = threading.Lock()

    def collect(self) -> Iterator[Metric]:
        with self.lock:
            families = [
                (n, f.kind, f.help, f.label_names, dict(f.values)) for n, f in self.families.items()
            ]
        for name, kind, help_text, label_names, values in families:
            metric_type = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            metric = metric_type(name, help_text, labels=label_names)
            for label_values, value in values.items():
                metric.add_metric(label_values, value)
            yield metric


class PrometheusSink:
    """Serves the metrics in its own registry (several sinks may share a process) from a daemon
    thread; `close()` stops the server and frees the port."""

    def __init__(self, port: int, host: str = "127.0.0.1", *, run: str, rank: int) -> None:
        self.labels = {"run": run, "rank": str(rank)}
        self.latest = _Latest()
        self.registry = CollectorRegistry()
        self.registry.register(self.latest)
        self._clashes: set[str] = set()
        self.server: WSGIServer | None
        self.server, self.thread = _serve(port, host, self.registry)
        self.port: int = self.server.server_port  # the bound port, when `port` is 0

    def write(self, step: int, metrics: Metrics) -> None:
        with self.latest.lock:
            for key, value in metrics.items():
                series = prometheus_series(key)
                if isinstance(value, list | tuple):
                    item = "expert" if key.startswith("moe/") else "index"
                    for i, item_value in enumerate(value):
                        self._set(series, {**series.labels, item: str(i)}, item_value)
                else:
                    self._set(series, series.labels, value)
            self._set(_STEP, {}, step)
            self._set(_HEARTBEAT, {}, time.time())

    def rewind(self, step: int) -> None:
        """Nothing to forget: a gauge holds only the latest value, and the recomputed steps
        overwrite it. The scraper's history keeps what it saw before the rollback."""

    def close(self) -> None:
        if self.server is None:
            return
        self.server.shutdown()  # waits for the serving loop to notice (up to 0.5 s)
        self.server.server_close()
        self.thread.join()
        self.server = None

    def _set(self, series: Series, labels: dict[str, str], value: float) -> None:
        labels = {**self.labels, **labels}
        family = self.latest.families.setdefault(
            series.name, _Family(series.kind, series.help, tuple(labels))
        )
        if family.label_names != tuple(labels) or family.kind != series.kind:
            self._warn_clash(series.name)  # another key took this name (`a/b` and `a_b`)
            return
        family.values[tuple(labels.values())] = float(value) * series.scale

    def _warn_clash(self, name: str) -> None:
        if name not in self._clashes:
            self._clashes.add(name)
            warnings.warn(
                f"Prometheus: two metrics keys map to `{name}` with different labels; "
                "only the first is exported",
                stacklevel=4,
            )


_STEP = Series(PREFIX + "step", {}, 1.0, "gauge", "the step of the last log line")
_HEARTBEAT = Series(
    PREFIX + "step_timestamp_seconds", {}, 1.0, "gauge", "Unix time of the last log line"
)


def _serve(
    port: int, host: str, registry: CollectorRegistry
) -> tuple[WSGIServer, threading.Thread]:
    try:
        return start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise UserError(
                f"the Prometheus exporter cannot listen on {host}:{port}: the port is in use "
                "(another run, another rank on this machine, or another program)",
                "set metrics.prometheus_port to another value; rank r serves on "
                "metrics.prometheus_port + its local rank, so leave one free port per local rank",
                exit_code=1,
            ) from None
        raise UserError(
            f"the Prometheus exporter cannot listen on {host}:{port}: {exc.strerror or exc}",
            "set metrics.prometheus_host to an address of this machine (127.0.0.1, or 0.0.0.0 "
            "for every interface) and metrics.prometheus_port to a free port above 1023",
            exit_code=1,
        ) from None
