"""OpenTelemetry tracing shared by the four services: the tracer, and the trace context on each hop.

Off unless ``--otlp-traces-endpoint`` (or ``$OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) names a
collector. While off, ``tracer`` is None and every caller checks that one module attribute
before doing anything: no span objects, no metadata, no parsing.

``setup`` builds the SDK's ``TracerProvider`` for one service: resource ``service.name``
(``ringserve-gateway``, ``-tokenizer``, ``-scheduler``, ``-detokenizer``; ``$OTEL_SERVICE_NAME``
overrides it), a parent-based ratio sampler (``--otlp-traces-sample-ratio``; without it the
SDK's own ``$OTEL_TRACES_SAMPLER`` / ``$OTEL_TRACES_SAMPLER_ARG``), and a batch span
processor with the OTLP/gRPC exporter (``$OTEL_BSP_*`` and ``$OTEL_EXPORTER_OTLP_TRACES_*``
apply). Export runs on the processor's own thread; spans past its queue are dropped, so a
collector that cannot be reached costs the serving path nothing but the spans.

How the context travels (W3C Trace Context, the ``traceparent`` / ``tracestate`` pair):

- HTTP client -> gateway: the request's headers (``headers_context``);
- gateway -> tokenizer (one call per request): gRPC metadata (``grpc_metadata`` /
  ``metadata_context``);
- tokenizer -> scheduler -> detokenizer: long-lived streams carrying batches, so each row
  carries its request's ``traceparent`` in the message (``TokenizedGenerateReqInput`` and the
  detokenizer's ``RowInit``); ``row_context`` turns it back into a parent.

Span attributes follow the OpenTelemetry GenAI semantic conventions (the ``GEN_AI_*`` names).
"""

from __future__ import annotations

import atexit
import os
import threading
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

    from ringserve.options.common import TracingOptions

# None: tracing is off (the one check every caller makes first).
tracer: trace.Tracer | None = None

SERVICE_NAMES = {name: f"ringserve-{name}" for name in ("gateway", "tokenizer", "scheduler", "detokenizer")}
# Seconds spans still queued get at exit to reach the collector; a collector that is down
# must not hold a stopping service for the exporter's whole timeout.
EXIT_FLUSH_S = 2.0

# OpenTelemetry GenAI semantic conventions (gen-ai-spans.md).
GEN_AI_OPERATION = "gen_ai.operation.name"
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
GEN_AI_RESPONSE_ID = "gen_ai.response.id"
GEN_AI_RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
GEN_AI_USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
# gen_ai.response.finish_reasons values by FinishReasonType (common.proto): none, stop, length, abort.
FINISH_REASONS = ("", "stop", "length", "abort")
# ringserve's own: the rid (the X-Request-Id; ``<rid>-<i>`` for choice i of n > 1).
RID = "ringserve.rid"

TRACEPARENT = "traceparent"
_PROPAGATOR = TraceContextTextMapPropagator()
_FIELDS = ("traceparent", "tracestate")


def otlp_endpoint(options: TracingOptions) -> str | None:
    """The collector the options (else ``$OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) name, with a
    scheme: ``host:port`` alone is plaintext (``http://``), as a collector's 4317 port is by
    default; None: tracing is off."""
    endpoint = options.otlp_traces_endpoint or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    if not endpoint:
        return None
    return endpoint if "://" in endpoint else f"http://{endpoint}"


def setup(service: str, options: TracingOptions) -> TracerProvider | None:
    """Turn tracing on for ``service`` (a key of ``SERVICE_NAMES``) when ``options`` name a
    collector: its provider, or None (off). Called once, from the service's ``main``."""
    endpoint = otlp_endpoint(options)
    if endpoint is None:
        return None
    # The SDK is imported only when tracing is on: a service without it never loads it.
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    ratio = options.otlp_traces_sample_ratio
    provider = TracerProvider(
        resource=Resource.create({SERVICE_NAME: os.environ.get("OTEL_SERVICE_NAME") or SERVICE_NAMES[service]}),
        sampler=ParentBased(TraceIdRatioBased(ratio)) if ratio is not None else None,  # None: $OTEL_TRACES_SAMPLER
        shutdown_on_exit=False,
    )
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    atexit.register(_flush, provider, EXIT_FLUSH_S)
    use(provider)
    return provider


def _flush(provider: TracerProvider, timeout_s: float) -> None:
    """Send the spans still queued, waiting ``timeout_s`` at most: the SDK's own flush timeout
    does not bound an export retrying a collector that refuses connections (measured: 32 s)."""
    flusher = threading.Thread(target=provider.force_flush, name="otel-flush", daemon=True)
    flusher.start()
    flusher.join(timeout_s)


def use(provider: TracerProvider | None) -> None:
    """Trace through ``provider`` (tests: an in-memory exporter's), or turn tracing off (None)."""
    global tracer
    tracer = provider.get_tracer("ringserve") if provider is not None else None


# ---- the trace context on each hop ----------------------------------------------------------

def headers_context(headers: Mapping[str, str]) -> Context | None:
    """The W3C context of an HTTP request's headers (lower-case names), None without a
    valid ``traceparent`` (the request then starts a trace)."""
    if TRACEPARENT not in headers:
        return None
    return _extract({k: headers[k] for k in _FIELDS if k in headers})


def metadata_context(metadata: Iterable[tuple[str, Any]] | None) -> Context | None:
    """The W3C context of a gRPC call's invocation metadata, None without a valid ``traceparent``."""
    carrier = {k: v for k, v in metadata or () if k in _FIELDS and isinstance(v, str)}
    return _extract(carrier) if TRACEPARENT in carrier else None


def row_context(traceparent: str) -> Context | None:
    """The parent of a row's spans from the ``traceparent`` a message carries; None when the
    row is not traced (empty) or its trace is not sampled (no span of it is recorded anyway)."""
    if not traceparent:
        return None
    context = _extract({TRACEPARENT: traceparent})
    if context is None or not trace.get_current_span(context).get_span_context().trace_flags.sampled:
        return None
    return context


def _extract(carrier: dict[str, str]) -> Context | None:
    context = _PROPAGATOR.extract(carrier)
    return context if trace.get_current_span(context).get_span_context().is_valid else None


def grpc_metadata(span: Span | None = None) -> tuple[tuple[str, str], ...]:
    """``traceparent`` (and ``tracestate``) metadata naming ``span`` (default: the current
    span) as the callee's parent; empty when tracing is off or there is no span."""
    if tracer is None:
        return ()
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, trace.set_span_in_context(span) if span is not None else None)
    return tuple(carrier.items())


def traceparent(span: Span | None = None) -> str:
    """The ``traceparent`` value naming ``span`` (default: the current span); "" when tracing
    is off or there is none (what a message's ``traceparent`` field carries)."""
    for key, value in grpc_metadata(span):
        if key == TRACEPARENT:
            return value
    return ""


def trace_id(span: Span) -> str:
    """``span``'s trace id as the 32 hex digits a trace viewer searches by."""
    return trace.format_trace_id(span.get_span_context().trace_id)


def fail(span: Span, message: str) -> None:
    """End-state of a failed or aborted request: the span's status ERROR with ``message``."""
    span.set_status(Status(StatusCode.ERROR, message))
