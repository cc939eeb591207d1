"""The shared tracing helpers (ringserve/tracing.py) and request ids (ringserve/request_ids.py):
propagation through headers, gRPC metadata and a message's traceparent field, the off path,
the endpoint and sampler set-up, and request-id checks."""

from __future__ import annotations

import pytest
from opentelemetry import trace

from ringserve import request_ids, tracing
from ringserve.options.common import TracingOptions
from tests.helpers.otlp import recording

TRACE = "0af7651916cd43dd8448eb211c80319c"
PARENT = "b7ad6b7169203331"


def test_off_no_context_leaves_a_process():
    assert tracing.tracer is None  # off unless set up
    assert tracing.grpc_metadata() == ()
    assert tracing.traceparent() == ""


def test_endpoint_from_the_flag_or_the_environment(monkeypatch):
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    assert tracing.otlp_endpoint(TracingOptions()) is None
    assert tracing.setup("gateway", TracingOptions()) is None and tracing.tracer is None
    assert tracing.otlp_endpoint(TracingOptions(otlp_traces_endpoint="collector:4317")) == "http://collector:4317"
    assert tracing.otlp_endpoint(TracingOptions(otlp_traces_endpoint="https://c:4317")) == "https://c:4317"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://env:4317")
    assert tracing.otlp_endpoint(TracingOptions()) == "http://env:4317"


def test_setup_names_the_service_and_samples_parent_based(monkeypatch):
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    provider = tracing.setup("scheduler", TracingOptions(otlp_traces_endpoint="127.0.0.1:9",
                                                         otlp_traces_sample_ratio=0.25))
    try:
        assert provider is not None and tracing.tracer is not None
        assert provider.resource.attributes["service.name"] == "ringserve-scheduler"
        assert provider.sampler.get_description() == "ParentBased{root:TraceIdRatioBased{0.25}," \
            "remoteParentSampled:AlwaysOnSampler,remoteParentNotSampled:AlwaysOffSampler," \
            "localParentSampled:AlwaysOnSampler,localParentNotSampled:AlwaysOffSampler}"
    finally:
        tracing.use(None)
        assert provider is not None
        provider.shutdown()  # nothing was recorded: nothing waits on the unreachable collector
    monkeypatch.setenv("OTEL_SERVICE_NAME", "edge-gateway")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_off")
    provider = tracing.setup("gateway", TracingOptions(otlp_traces_endpoint="127.0.0.1:9"))
    tracing.use(None)
    assert provider is not None
    provider.shutdown()
    assert provider.resource.attributes["service.name"] == "edge-gateway"
    assert provider.sampler.get_description() == "AlwaysOffSampler"


def test_headers_continue_a_valid_traceparent_only():
    assert tracing.headers_context({}) is None
    assert tracing.headers_context({"traceparent": "garbage"}) is None
    ctx = tracing.headers_context({"traceparent": f"00-{TRACE}-{PARENT}-01", "tracestate": "k=v"})
    sc = trace.get_current_span(ctx).get_span_context()
    assert (trace.format_trace_id(sc.trace_id), trace.format_span_id(sc.span_id)) == (TRACE, PARENT)
    assert sc.trace_state.get("k") == "v"


def test_metadata_and_row_fields_carry_the_span_to_the_next_hop():
    with recording() as exporter:
        tracer = tracing.tracer
        assert tracer is not None
        parent = tracing.headers_context({"traceparent": f"00-{TRACE}-{PARENT}-01"})
        span = tracer.start_span("gateway", parent)
        metadata = dict(tracing.grpc_metadata(span))
        own = trace.format_span_id(span.get_span_context().span_id)
        assert metadata == {"traceparent": f"00-{TRACE}-{own}-01"}
        # The callee's span from the metadata, then a row's field from that span.
        callee = tracer.start_span("tokenizer", tracing.metadata_context(list(metadata.items())))
        row = tracing.traceparent(callee)
        scheduler = tracer.start_span("scheduler", tracing.row_context(row))
        for s in (scheduler, callee, span):
            s.end()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert {format(s.context.trace_id, "032x") for s in spans.values()} == {TRACE}
    assert format(spans["gateway"].parent.span_id, "016x") == PARENT
    assert spans["tokenizer"].parent.span_id == spans["gateway"].context.span_id
    assert spans["scheduler"].parent.span_id == spans["tokenizer"].context.span_id


def test_rows_of_unsampled_or_untraced_requests_have_no_parent():
    assert tracing.row_context("") is None
    assert tracing.row_context(f"00-{TRACE}-{PARENT}-00") is None  # not sampled: nothing to record
    assert tracing.row_context("00-00000000000000000000000000000000-b7ad6b7169203331-01") is None
    assert tracing.row_context(f"00-{TRACE}-{PARENT}-01") is not None
    assert tracing.metadata_context([("authorization", "Bearer k")]) is None


@pytest.mark.parametrize(("value", "error"), [
    ("abc-123_X.y", None),
    ("", "X-Request-Id must not be empty"),
    ("a b", "X-Request-Id 'a b' must be visible ASCII characters without spaces"),
    ("café", "X-Request-Id 'café' must be visible ASCII characters without spaces"),
])
def test_request_id_check(value, error):
    assert request_ids.check(value) == error


def test_a_rid_outside_visible_ascii_goes_back_percent_encoded():
    assert request_ids.header_value("abc-1%") == "abc-1%"
    assert request_ids.header_value("café au lait") == "caf%C3%A9%20au%20lait"
    assert request_ids.conflict("h", "b") == "X-Request-Id 'h' and the request's rid 'b' differ; give one, " \
                                             "or the same in both"
