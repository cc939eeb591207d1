"""The tokenizer's Prometheus metrics: its request states and readiness (read at scrape
time) and three request stages, each observed once per request:

- tokenize: ``TokenizerManager.prepare`` (chat template, tokenization, validation, ``n``
  expansion) of a Generate call;
- dispatch: from queueing a (sub-)request on the scheduler stream to gRPC accepting its
  write (time spent behind other messages or the scheduler's flow control);
- send: per Generate call that ended normally, the seconds its output writes to the client
  (the gateway) took, summed over the call (the client's back-pressure).

Readiness (``services.tokenizer.readiness``): ``ringserve:ready`` is 1 while this instance
can move a token through a replica; ``ringserve:replica_not_ready{replica, reason}`` is 1
for each reason a replica cannot now, 0 otherwise (every reason of every replica is
exported, so a series never vanishes).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ringserve.metrics import PREFIX, Read, ServiceMetrics
from services.tokenizer.links import SchedulerLink
from services.tokenizer.manager import TokenizerManager
from services.tokenizer.readiness import REASONS, ReadinessMonitor
from services.tokenizer.servicer import TokenizerServicer


class ReadinessCollector(Collector):
    """``ringserve:ready`` and ``ringserve:replica_not_ready``, read from the monitor at scrape time."""

    def __init__(self, model_name: str, readiness: ReadinessMonitor):
        self.model_name = model_name
        self.readiness = readiness

    def collect(self) -> Iterable[Metric]:
        ready = GaugeMetricFamily(PREFIX + "ready", "1 while this tokenizer can move a token through a replica.",
                                  labels=["model_name"])
        ready.add_metric([self.model_name], float(self.readiness.ready))
        yield ready
        family = GaugeMetricFamily(PREFIX + "replica_not_ready", "1 for each reason a replica cannot move a token.",
                                   labels=["model_name", "replica", "reason"])
        for replica in self.readiness.replicas:
            now = {r.reason for r in self.readiness.not_ready(replica)}
            for reason in REASONS:
                family.add_metric([self.model_name, replica.name, reason], float(reason in now))
        yield family


def install_tokenizer_metrics(metrics: ServiceMetrics, manager: TokenizerManager, links: Sequence[SchedulerLink],
                              servicer: TokenizerServicer, readiness: ReadinessMonitor | None = None) -> None:
    """Register the tokenizer's families in ``metrics.registry`` and hook the three stages
    (``links``: the scheduler stream of every replica; ``readiness``: the readiness families)."""
    manager.observe_tokenize = metrics.histogram(
        "request_tokenize_time_seconds", "Seconds to render, tokenize and validate a Generate call.").observe
    dispatch = metrics.histogram(
        "request_dispatch_time_seconds",
        "Seconds from queueing a request on the scheduler stream to its write being accepted.").observe
    for link in links:
        link.observe_dispatch = dispatch
    servicer.observe_send = metrics.histogram(
        "request_send_time_seconds",
        "Seconds a finished Generate call's output writes to its client took, summed over the call.").observe
    metrics.add_reads([
        Read("req_states", "Requests this tokenizer holds state for (ReqState).", "gauge",
             lambda: len(manager.rid_to_state)),
    ])
    if readiness is not None:
        metrics.registry.register(ReadinessCollector(metrics.model_name, readiness))
