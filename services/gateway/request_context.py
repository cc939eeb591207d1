"""Each HTTP request's id and trace: ``X-Request-Id`` in and out, the request's span, its SSE stream's span.

``RequestContextMiddleware`` wraps the whole app, outside Starlette's own error middleware, so
every response carries ``X-Request-Id``: 401, 413, 422 and 500 included. The id is the
request's ``X-Request-Id`` when it gives one (``ringserve.request_ids.check``; a bad one is a
400), else the body's ``rid`` once a generation route reads it (``adopt``), else a fresh
uuid4 hex. A generation's rid is that id: the tokenizer refuses it while in flight, every
service logs it, and every span carries it (``ringserve.rid``).

With tracing on (``ringserve.tracing``) the middleware continues the request's W3C
``traceparent`` (or starts a trace) in a SERVER span named ``{method} {route}`` (probes and
``/metrics`` excepted), current while the route runs, so the Generate call's metadata names it
as the tokenizer's parent. A ``text/event-stream`` response gets a child span ``sse stream``
from its first byte to its last. A status of 400 or more, an error event in the stream, or
a stream that ends without its last event (the client went away) end the spans with the
error status.

Log records written while a request is served carry ``[<rid>] `` (and ``trace=<id>`` when
traced) through ``RequestLogFilter``, installed on the gateway's log handler.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send
from starlette.types import Message as ASGIMessage

from ringserve import request_ids, tracing

from .errors import invalid

# What ``sse.error_event`` writes first: the stream reports an error.
ERROR_EVENT = b'data: {"error":'
# Probes and scrapes: an orchestrator calls them every few seconds, and a trace of each would
# bury the requests' traces (they still get X-Request-Id).
UNTRACED_PATHS = frozenset({"/health", "/health_generate", "/metrics"})
_UNSAMPLED = trace.NonRecordingSpan(trace.SpanContext(
    0x4E6F74A5A3B1E2D0C0FFEE0000000001, 0x50524F4245000001, is_remote=False, trace_flags=trace.TraceFlags(0)))
SSE_SPAN = "sse stream"


@dataclass
class RequestContext:
    """One HTTP request's id (``rid``: the one its response carries), whether the client gave
    it (``given``), and its span (None untraced)."""

    rid: str
    given: bool
    span: trace.Span | None = None


_CURRENT: ContextVar[RequestContext | None] = ContextVar("ringserve_http_request", default=None)


def current() -> RequestContext | None:
    """The context of the HTTP request being served here, None outside one."""
    return _CURRENT.get()


def adopt(body_rid: str | None, attributes: Callable[[], dict[str, Any]]) -> str:
    """The rid of a generation request: its ``X-Request-Id``, else ``body_rid``, else the fresh
    id its response carries; ``attributes()`` (GenAI request attributes) go on its span.

    Raises:
        GatewayError(400): the header and ``body_rid`` differ.
    """
    ctx = _CURRENT.get()
    if ctx is None:  # called outside an HTTP request (a test of the conversion alone)
        return body_rid or uuid.uuid4().hex
    if body_rid:
        if ctx.given and body_rid != ctx.rid:
            raise invalid(request_ids.conflict(ctx.rid, body_rid), "rid")
        ctx.rid = body_rid
    if ctx.span is not None:
        ctx.span.set_attributes({tracing.RID: ctx.rid, **attributes()})
    return ctx.rid


class RequestLogFilter(logging.Filter):
    """Gives every record ``request_tag``: ``"[<rid>] "`` (``"[<rid> trace=<id>] "`` when traced)
    while a request is served, else ``""`` (the gateway's log format prints it)."""

    def filter(self, record: logging.LogRecord) -> bool:
        ctx = _CURRENT.get()
        if ctx is None:
            record.request_tag = ""
        elif ctx.span is not None and ctx.span.is_recording():
            record.request_tag = f"[{ctx.rid} trace={tracing.trace_id(ctx.span)}] "
        else:
            record.request_tag = f"[{ctx.rid}] "
        return True


def _with_id(message: ASGIMessage, rid: str) -> ASGIMessage:
    header = (request_ids.HEADER.encode(), request_ids.header_value(rid).encode("latin-1"))
    return {**message, "headers": [*message.get("headers", ()), header]}


class RequestContextMiddleware:
    """Pure ASGI (it must not buffer SSE); see the module docstring."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        given = headers.get(request_ids.HEADER)
        error = request_ids.check(given) if given is not None else None
        ctx = RequestContext(given if given is not None and error is None else uuid.uuid4().hex,
                             given is not None and error is None)
        token = _CURRENT.set(ctx)
        try:
            if tracing.tracer is None:
                await self._serve(ctx, error, scope, receive, send)
            elif scope["path"] in UNTRACED_PATHS:
                # The generation probe's Generate call says "not sampled": no service traces it.
                attached = otel_context.attach(trace.set_span_in_context(_UNSAMPLED))
                try:
                    await self._serve(ctx, error, scope, receive, send)
                finally:
                    otel_context.detach(attached)
            else:
                await _Traced(self, ctx, headers).serve(error, scope, receive, send)
        finally:
            _CURRENT.reset(token)

    async def _serve(self, ctx: RequestContext, error: str | None, scope: Scope, receive: Receive,
                     send: Send) -> None:
        async def send_with_id(message: ASGIMessage) -> None:
            await send(_with_id(message, ctx.rid) if message["type"] == "http.response.start" else message)

        if error is not None:
            await invalid(error, "X-Request-Id").response()(scope, receive, send_with_id)
            return
        await self.app(scope, receive, send_with_id)


class _Traced:
    """One traced request: its SERVER span, current while the app runs, and its SSE span."""

    def __init__(self, middleware: RequestContextMiddleware, ctx: RequestContext, headers: Headers) -> None:
        self.middleware = middleware
        self.ctx = ctx
        self.headers = headers
        self.status = 500  # a response never started is Starlette's 500
        self.sse: trace.Span | None = None
        self.failure: str | None = None

    async def serve(self, error: str | None, scope: Scope, receive: Receive, send: Send) -> None:
        tracer = tracing.tracer
        assert tracer is not None
        method = scope["method"]
        span = tracer.start_span(
            f"{method} {scope['path']}", context=tracing.headers_context(self.headers), kind=trace.SpanKind.SERVER,
            attributes={"http.request.method": method, "url.path": scope["path"], tracing.RID: self.ctx.rid})
        self.ctx.span = span
        attached = otel_context.attach(trace.set_span_in_context(span))
        try:
            await self.middleware._serve(self.ctx, error, scope, receive, self._send(send))
        except BaseException as exc:
            span.record_exception(exc)
            self.failure = self.failure or f"{type(exc).__name__}: {exc}"
            raise
        finally:
            otel_context.detach(attached)
            route = getattr(scope.get("route"), "path", None)
            if route is not None:
                span.update_name(f"{method} {route}")
                span.set_attribute("http.route", route)
            span.set_attributes({"http.response.status_code": self.status, tracing.RID: self.ctx.rid})
            if self.sse is not None:  # the app returned before the stream's last event
                self._fail(self.sse, "the stream ended before its last event (the client went away)")
                self.sse.end()
            if self.failure is None and self.status >= 400:
                self.failure = f"HTTP {self.status}"
            if self.failure is not None:
                tracing.fail(span, self.failure)
            span.end()

    def _fail(self, span: trace.Span, message: str) -> None:
        tracing.fail(span, message)
        self.failure = self.failure or message

    def _send(self, send: Send) -> Send:
        async def traced_send(message: ASGIMessage) -> None:
            if message["type"] == "http.response.start":
                self.status = message["status"]
                if Headers(raw=message.get("headers", [])).get("content-type", "").startswith("text/event-stream"):
                    assert tracing.tracer is not None and self.ctx.span is not None
                    self.sse = tracing.tracer.start_span(SSE_SPAN, trace.set_span_in_context(self.ctx.span),
                                                         attributes={tracing.RID: self.ctx.rid})
            elif message["type"] == "http.response.body" and self.sse is not None:
                if message.get("body", b"").startswith(ERROR_EVENT):
                    self._fail(self.sse, "the stream reported an error event")
                if not message.get("more_body", False):
                    self.sse.end()
                    self.sse = None
            await send(message)

        return traced_send
