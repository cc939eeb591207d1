"""The detokenizer's options: ``ringserve detokenizer`` (``DetokenizerConfig`` in
services/detokenizer/main.py subclasses these)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ringserve.grpcutil import Transport
from ringserve.internal_auth import InternalAuth
from ringserve.options.common import (
    BY_CHART,
    GRACE_PERIOD,
    HOST,
    INTERNAL_AUTH,
    LOG_REQUESTS,
    METRICS_PORT,
    MODEL,
    SERVED_MODEL_NAME,
    TRANSPORT,
    TracingOptions,
)
from ringserve.options.spec import option


@dataclass(frozen=True, kw_only=True)
class DetokenizerOptions:
    """One detokenizer: its vocabulary, where it listens, how many requests it decodes at once."""

    model: Path = MODEL.field()
    host: str = HOST.field()
    port: int = option("--port", 30030, not_in_chart=f"{BY_CHART}: ports.detokenizer",
                       help="gRPC port (0 picks a free port)")
    max_decode_states: int = option(
        "--max-decode-states", 65536, chart="config.detokenizer.maxDecodeStates",
        help="live per-request decode states kept at most; a request beyond it is aborted")
    grace_period_s: float = GRACE_PERIOD.field()
    transport: Transport = TRANSPORT.field()
    metrics_port: int | None = METRICS_PORT.field()
    served_model_name: str | None = SERVED_MODEL_NAME.field()
    internal_auth: InternalAuth = INTERNAL_AUTH.field()
    log_requests: bool = LOG_REQUESTS.field()
    tracing: TracingOptions = TracingOptions()
