"""The detokenizer's Prometheus metrics: live decode states (read at scrape time) and the
time to detokenize one scheduler step (one ``BatchTokenIDOutput``), observed once per step."""

from __future__ import annotations

from ringserve.metrics import STEP_TIME_BUCKETS, Read, ServiceMetrics
from services.detokenizer.servicer import DetokenizerServicer


def install_detokenizer_metrics(metrics: ServiceMetrics, servicer: DetokenizerServicer) -> None:
    """Register the detokenizer's families in ``metrics.registry`` and hook its step."""
    servicer.observe_step = metrics.histogram(
        "detokenize_step_time_seconds",
        "Seconds to detokenize one scheduler step and route its text to the tokenizers.",
        STEP_TIME_BUCKETS).observe
    manager = servicer.manager
    metrics.add_reads([
        Read("decode_states", "Requests this detokenizer holds a DecodeStatus for.", "gauge",
             lambda: manager.num_decode_states),
    ])
