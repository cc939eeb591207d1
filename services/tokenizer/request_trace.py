"""One Generate call's request id, span and log lines (the servicer's side of tracing).

- ``x-request-id`` metadata names the rid (``ringserve.request_ids``): it fills an empty
  ``rid``; one that differs from the rid given is INVALID_ARGUMENT.
- Traced (``ringserve.tracing`` on): a SERVER span ``generate`` continuing the call's
  ``traceparent`` metadata (the gateway's request span), current while the call runs, so
  the manager's ``template + tokenize`` span is its child and every choice dispatched
  carries its ``traceparent`` to the scheduler and the detokenizer
  (``trace_prepared``). At the end: the GenAI usage and finish reasons, and the error status
  for a call that failed, was cancelled, or ended with an abort.
- ``--log-requests``: one line when the call ends, under the rid, with its tokens and finish
  reasons or its error (never prompt or output text).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace

from ringserve import request_ids, tracing
from ringserve.v1 import common_pb2, tokenizer_pb2
from services.tokenizer.errors import RequestError, invalid
from services.tokenizer.prepare import Prepared

logger = logging.getLogger(__name__)

TOKENIZE_SPAN = "template + tokenize"


def request_id(request: tokenizer_pb2.GenerateReqInput, metadata: Sequence[tuple[str, Any]] | None) -> None:
    """Set ``request.rid`` from ``x-request-id`` metadata when the call has it.

    Raises:
        RequestError: INVALID_ARGUMENT for an empty or non-ASCII id, or one that differs
            from ``request.rid``.
    """
    given = next((v for k, v in metadata or () if k == request_ids.HEADER), None)
    if given is None:
        return
    where = f"{request_ids.HEADER} metadata"
    error = request_ids.check(given, where) if isinstance(given, str) else f"{where} must be text"
    if error is not None:
        raise invalid(error, "rid")
    if request.rid and request.rid != given:
        raise invalid(request_ids.conflict(given, request.rid, where), "rid")
    request.rid = given


def trace_prepared(prepared: Prepared, started_ns: int) -> None:
    """Traced: the ``template + tokenize`` span (from ``started_ns``, a ``time.time_ns()``, the
    clock the SDK stamps spans with, so the span never starts before its parent) under the
    current span, and that span's ``traceparent`` on every choice to dispatch."""
    assert tracing.tracer is not None
    now = time.time_ns()
    span = tracing.tracer.start_span(
        TOKENIZE_SPAN, start_time=started_ns,
        attributes={tracing.RID: prepared.rid, tracing.GEN_AI_USAGE_INPUT_TOKENS: prepared.prompt_len,
                    "ringserve.choices": len(prepared.subs)})
    span.end(now)
    parent = tracing.traceparent()
    for sub in prepared.subs:
        sub.traceparent = parent


class GenerateRecord:
    """What one Generate call reports: its span (None untraced) and, with ``log``, its log line.

    Args:
        request: the call's request (its rid already set).
        metadata: the call's invocation metadata (``traceparent`` continues the caller's trace).
        model: the served model name.
        log: ``--log-requests``.
    """

    def __init__(self, request: tokenizer_pb2.GenerateReqInput, metadata: Sequence[tuple[str, Any]] | None,
                 model: str, log: bool) -> None:
        self.rid = request.rid
        self.log = log
        self.prompt_tokens = 0
        self.output_tokens: dict[int, int] = {}  # choice index -> completion tokens
        self.finish_reasons: list[str] = []
        self.abort: str | None = None  # the message of a choice that ended FINISH_ABORT
        self.span: trace.Span | None = None
        if tracing.tracer is not None:
            p = request.sampling_params
            attrs: dict[str, Any] = {tracing.RID: self.rid, tracing.GEN_AI_REQUEST_MODEL: model,
                                     "rpc.system": "grpc", "rpc.method": "Generate"}
            if p.HasField("max_new_tokens"):
                attrs[tracing.GEN_AI_REQUEST_MAX_TOKENS] = p.max_new_tokens
            if p.HasField("temperature"):
                attrs[tracing.GEN_AI_REQUEST_TEMPERATURE] = p.temperature
            self.span = tracing.tracer.start_span("generate", tracing.metadata_context(metadata),
                                                  kind=trace.SpanKind.SERVER, attributes=attrs)

    @contextmanager
    def current(self) -> Iterator[None]:
        """The call's span as the current one (nothing untraced)."""
        if self.span is None:
            yield
            return
        token = otel_context.attach(trace.set_span_in_context(self.span))
        try:
            yield
        finally:
            otel_context.detach(token)

    def output(self, out: tokenizer_pb2.GenerateOutput) -> None:
        """Count one output (the usage and finish reasons come from the last of each choice)."""
        self.prompt_tokens = out.prompt_tokens
        self.output_tokens[out.index] = out.completion_tokens
        kind = out.finish_reason.type
        if kind != common_pb2.FINISH_NONE:
            self.finish_reasons.append(tracing.FINISH_REASONS[kind])
            if kind == common_pb2.FINISH_ABORT:
                self.abort = out.finish_reason.message or "aborted"

    def end(self, error: RequestError | None = None, cancelled: bool = False) -> None:
        """The call ended: normally, with ``error``, or ``cancelled`` by its caller."""
        failure = error.message if error is not None else "the caller cancelled the call" if cancelled else self.abort
        output_tokens = sum(self.output_tokens.values())
        if self.span is not None:
            self.span.set_attributes({
                tracing.GEN_AI_RESPONSE_ID: self.rid, tracing.GEN_AI_USAGE_INPUT_TOKENS: self.prompt_tokens,
                tracing.GEN_AI_USAGE_OUTPUT_TOKENS: output_tokens,
                tracing.GEN_AI_RESPONSE_FINISH_REASONS: self.finish_reasons})
            if failure is not None:
                tracing.fail(self.span, failure)
            self.span.end()
        if self.log:
            if failure is not None:
                logger.info("request %s failed: %s", self.rid, failure)
            else:
                logger.info("request %s finished: %d prompt tokens, %d output tokens, finish reasons %s",
                            self.rid, self.prompt_tokens, output_tokens, ",".join(self.finish_reasons))
