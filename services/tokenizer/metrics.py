"""The tokenizer's Prometheus metrics: its request states (read at scrape time) and three
request stages, each observed once per request:

- tokenize: ``TokenizerManager.prepare`` (chat template, tokenization, validation, ``n``
  expansion) of a Generate call;
- dispatch: from queueing a (sub-)request on the scheduler stream to gRPC accepting its
  write (time spent behind other messages or the scheduler's flow control);
- send: per Generate call that ended normally, the seconds its output writes to the client
  (the gateway) took, summed over the call (the client's back-pressure).
"""

from __future__ import annotations

from collections.abc import Sequence

from ringserve.metrics import Read, ServiceMetrics
from services.tokenizer.links import SchedulerLink
from services.tokenizer.manager import TokenizerManager
from services.tokenizer.servicer import TokenizerServicer


def install_tokenizer_metrics(metrics: ServiceMetrics, manager: TokenizerManager, links: Sequence[SchedulerLink],
                              servicer: TokenizerServicer) -> None:
    """Register the tokenizer's families in ``metrics.registry`` and hook the three stages
    (``links``: the scheduler stream of every replica)."""
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
