"""Prometheus exposition shared by the gRPC services (tokenizer, scheduler, detokenizer).

Each service keeps its metric families in its own ``CollectorRegistry`` (several services
can then live in one test process) and serves it with prometheus_client's HTTP server on
``--metrics-port``: unset = no endpoint, 0 = a free port (logged), N = that port. Every
family is named ``ringserve:<name>`` and carries a ``model_name`` label; docs/metrics.md
lists them all.

Some scrape-time families are also exported under the names the Kubernetes endpoint pickers
and autoscalers read (the Gateway API Inference Extension's model server protocol, which
names vLLM's metrics): ``ALIASES`` maps a family to those names, with the same type, labels
and value, so a picker configured for vLLM reads ringserve unchanged.

Occupancy is read from the live objects at scrape time (``ScrapeCollector``), so the hot
paths pay nothing for gauges; latencies are histograms observed once per request or per
step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

PREFIX = "ringserve:"

# A scrape-time family (its name without the prefix) -> the other names it is exported under.
# The model server protocol's metrics, as vLLM names them: queued and running requests, KV
# cache usage 0-1 (and the name vLLM used for it before v0.10, which older pickers still
# read), and the KV cache's geometry as labels of a gauge of 1. A family added here must have
# the same type and meaning as vLLM's.
ALIASES: dict[str, tuple[str, ...]] = {
    "num_requests_waiting": ("vllm:num_requests_waiting",),
    "num_requests_running": ("vllm:num_requests_running",),
    "kv_cache_usage_perc": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "cache_config_info": ("vllm:cache_config_info",),
    "lora_requests_info": ("vllm:lora_requests_info",),
}

# Per-request stage latencies (seconds): vLLM's request_*_time_seconds buckets.
REQUEST_TIME_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0,
                        30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# Per-step or per-message work (seconds): 50 us to 10 s.
STEP_TIME_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                     1.0, 2.5, 5.0, 10.0)


@dataclass(frozen=True)
class Read:
    """One family read at scrape time.

    Attributes:
        name: without the prefix; a counter's name without ``_total`` (the exposition adds it).
        doc: help text, with the unit.
        kind: "gauge" or "counter".
        value: returns the current value (an int or float); called from the HTTP server's
            thread, so it must only read (lengths, ints) what another thread mutates.
        labels: returns labels the sample carries beside ``model_name`` (an info-style
            gauge: ``cache_config_info{block_size,num_gpu_blocks} 1``); None: none.
    """

    name: str
    doc: str
    kind: str
    value: Callable[[], float]
    labels: Callable[[], dict[str, str]] | None = None


class ScrapeCollector(Collector):
    """Gauges and counters whose values are read from live objects at each scrape.

    Args:
        model_name: the ``model_name`` label of every sample.
        reads: the families.

    Raises:
        ValueError: a ``kind`` other than "gauge" or "counter".
    """

    def __init__(self, model_name: str, reads: Sequence[Read]):
        for r in reads:
            if r.kind not in ("gauge", "counter"):
                raise ValueError(f"{r.name}: kind must be 'gauge' or 'counter', got {r.kind!r}")
        self.model_name = model_name
        self.reads = tuple(reads)

    def collect(self) -> Iterable[Metric]:
        for r in self.reads:
            cls = GaugeMetricFamily if r.kind == "gauge" else CounterMetricFamily
            extra = r.labels() if r.labels is not None else {}
            value = float(r.value())
            for name in (PREFIX + r.name, *ALIASES.get(r.name, ())):
                family = cls(name, r.doc, labels=["model_name", *extra])
                family.add_metric([self.model_name, *extra.values()], value)
                yield family


class ServiceMetrics:
    """A service's registry (with the process collector: CPU, RSS, open fds) and its HTTP
    endpoint.

    Args:
        model_name: the ``model_name`` label value.
    """

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        self.port: int | None = None
        self._server: WSGIServer | None = None

    def histogram(self, name: str, doc: str, buckets: Sequence[float] = REQUEST_TIME_BUCKETS):
        """A histogram ``ringserve:<name>`` with its ``model_name`` label bound (observe it directly)."""
        return Histogram(PREFIX + name, doc, ["model_name"], registry=self.registry,
                         buckets=buckets).labels(self.model_name)

    def add_reads(self, reads: Sequence[Read]) -> None:
        """Register scrape-time gauges and counters (see ``ScrapeCollector``)."""
        self.registry.register(ScrapeCollector(self.model_name, reads))

    def serve(self, host: str, port: int | None) -> int | None:
        """Serve ``GET /metrics`` on ``host:port`` in a daemon thread; returns the bound port,
        or None when ``port`` is None (no endpoint). Port 0 picks a free one.

        Raises:
            OSError: the port could not be bound.
        """
        if port is None:
            return None
        self._server, _thread = start_http_server(port, addr=host, registry=self.registry)
        self.port = self._server.server_port
        log.info("Prometheus metrics on http://%s:%d/metrics", host, self.port)
        return self.port

    def stop(self) -> None:
        """Stop the HTTP endpoint (no-op without one)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


def ignore_seconds(_seconds: float) -> None:
    """The default latency hook of a component that no metrics object observes."""
