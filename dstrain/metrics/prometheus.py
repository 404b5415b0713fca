"""The Prometheus exporter: each rank serves its latest metrics at http://HOST:PORT/metrics.

Every key of docs/observability.md becomes a gauge, created the first time the key is logged and
labelled `run` and `rank`. Names:

- any key: `dstrain_` + the key with each character outside `[a-zA-Z0-9_]` turned into `_`
  (`loss/main` -> `dstrain_loss_main`, `throughput/mfu` -> `dstrain_throughput_mfu`);
- `moe/<layer>/<stat>` -> `dstrain_moe_<stat>{layer="<layer>"}`, and the list
  `moe/<layer>/tokens_per_expert` -> `dstrain_moe_tokens_per_expert{layer=.., expert="0".."E-1"}`;
- `moe/<stat>` (the whole model: `moe/max_over_mean`, `moe/dead_experts`) ->
  `dstrain_moe_<stat>{layer="all"}`;
- `comm/<axis>/<stat>` -> `dstrain_comm_<stat>{axis="<axis>"}`;
- `comm/<stat>` (`comm/exposed_fraction`, `comm/exposed_fraction_max`) ->
  `dstrain_comm_<stat>{axis="all"}`;
- `dstrain_step`: the step of the last write.

Why `layer="all"` and `axis="all"`: the whole-model figure shares its name with the per-layer
(per-axis) one, and a Prometheus name keeps one label set; so every `dstrain_moe_*` series has a
`layer` label and every `dstrain_comm_*` series an `axis` label. Filter `layer!="all"` before
summing over layers. A list under any other key gets an `index` label instead of `expert`.
"""

import errno
import re
import threading
import warnings
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Gauge, start_http_server

from dstrain.errors import UserError
from dstrain.metrics.sinks import Metrics

PREFIX = "dstrain_"
WHOLE = "all"  # the layer / axis label of a whole-model moe/ or comm/ figure
_SCOPE_LABEL = {"moe": "layer", "comm": "axis"}
_INVALID = re.compile(r"[^a-zA-Z0-9_]")


def prometheus_name(key: str) -> tuple[str, dict[str, str]]:
    """The Prometheus name of a metrics key and the labels the key itself carries (layer, axis)."""
    scope, *rest = key.split("/")
    if scope not in _SCOPE_LABEL or not rest:
        return _sanitize(key), {}
    where, stat = (rest[0], rest[1:]) if len(rest) > 1 else (WHOLE, rest)
    return _sanitize("/".join([scope, *stat])), {_SCOPE_LABEL[scope]: where}


def _sanitize(key: str) -> str:
    return PREFIX + _INVALID.sub("_", key)


class PrometheusSink:
    """Serves the metrics in its own registry (several sinks may share a process) from a daemon
    thread; `close()` stops the server and frees the port."""

    def __init__(self, port: int, host: str = "127.0.0.1", *, run: str, rank: int) -> None:
        self.labels = {"run": run, "rank": str(rank)}
        self.registry = CollectorRegistry()
        self.gauges: dict[str, Gauge] = {}
        self._clashes: set[str] = set()
        self.server: WSGIServer | None
        self.server, self.thread = _serve(port, host, self.registry)
        self.port: int = self.server.server_port  # the bound port, when `port` is 0

    def write(self, step: int, metrics: Metrics) -> None:
        for key, value in metrics.items():
            name, labels = prometheus_name(key)
            if isinstance(value, list | tuple):
                item = "expert" if key.startswith("moe/") else "index"
                for i, item_value in enumerate(value):
                    self._set(name, {**labels, item: str(i)}, item_value)
            else:
                self._set(name, labels, value)
        self._set(PREFIX + "step", {}, step)

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

    def _set(self, name: str, labels: dict[str, str], value: float) -> None:
        labels = {**self.labels, **labels}
        gauge = self.gauges.get(name)
        if gauge is None:
            gauge = Gauge(name, f"dstrain metric {name}", list(labels), registry=self.registry)
            self.gauges[name] = gauge
        try:
            series = gauge.labels(**labels)
        except ValueError:  # another key took this name with other labels (`a/b` and `a_b`)
            self._warn_clash(name)
            return
        series.set(float(value))

    def _warn_clash(self, name: str) -> None:
        if name not in self._clashes:
            self._clashes.add(name)
            warnings.warn(
                f"Prometheus: two metrics keys map to `{name}` with different labels; "
                "only the first is exported",
                stacklevel=3,
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
