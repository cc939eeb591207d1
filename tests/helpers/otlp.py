"""Spans for tests: an OTLP/gRPC receiver for launched services, and in-process recording.

``otlp_receiver()`` serves the collector's ``TraceService/Export`` on a free loopback port,
keeping every span; a ring launched with ``--otlp-traces-endpoint <its address>`` exports its
spans there. ``recording()`` turns ``ringserve.tracing`` on in this process, into memory.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.trace.v1 import trace_pb2
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from ringserve import tracing

ERROR = trace_pb2.Status.STATUS_CODE_ERROR


def _value(v: common_pb2.AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


@dataclass(frozen=True)
class Span:
    """One exported span, its ids as hex (``parent`` "" for a root) and its times in ns."""

    service: str
    name: str
    trace_id: str
    span_id: str
    parent: str
    start: int
    end: int
    attributes: dict[str, Any]
    error: str | None  # the status message when the status is ERROR
    events: tuple[tuple[str, int], ...]  # (name, time)


class OtlpReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """Keeps every span exported to it (``spans``), from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: list[Span] = []

    def Export(self, request: trace_service_pb2.ExportTraceServiceRequest,
               context: grpc.ServicerContext) -> trace_service_pb2.ExportTraceServiceResponse:
        got = []
        for rs in request.resource_spans:
            service = next((_value(a.value) for a in rs.resource.attributes if a.key == "service.name"), "")
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append(Span(
                        service, s.name, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(),
                        s.start_time_unix_nano, s.end_time_unix_nano,
                        {a.key: _value(a.value) for a in s.attributes},
                        s.status.message or "error" if s.status.code == ERROR else None,
                        tuple((e.name, e.time_unix_nano) for e in s.events)))
        with self._lock:
            self._spans.extend(got)
        return trace_service_pb2.ExportTraceServiceResponse()

    @property
    def spans(self) -> list[Span]:
        with self._lock:
            return list(self._spans)

    def wait_for(self, done: Callable[[list[Span]], bool], timeout_s: float = 15.0) -> list[Span]:
        """The spans once ``done(spans)`` holds.

        Raises:
            AssertionError: it does not within ``timeout_s``, naming the spans there are.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            spans = self.spans
            if done(spans):
                return spans
            if time.monotonic() > deadline:
                raise AssertionError("spans not exported in time; got "
                                     + ", ".join(f"{s.service}/{s.name}" for s in spans))
            time.sleep(0.05)


@contextmanager
def otlp_receiver() -> Iterator[tuple[str, OtlpReceiver]]:
    """A receiver serving on a free loopback port until the block ends: (its address, it)."""
    receiver = OtlpReceiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}", receiver
    finally:
        server.stop(None)


@contextmanager
def recording() -> Iterator[InMemorySpanExporter]:
    """Tracing on in this process until the block ends, every span kept by the exporter yielded
    (``get_finished_spans()``); off again after."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.use(provider)
    try:
        yield exporter
    finally:
        tracing.use(None)
        provider.shutdown()
