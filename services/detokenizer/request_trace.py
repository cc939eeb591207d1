"""The detokenizer's span and log line per request, from the scheduler's steps as they pass.

Installed on the servicer when tracing is on or ``--log-requests`` is given; otherwise nothing
here runs and the decode path is untouched.

- Traced: a ``detokenize`` span per rid whose ``RowInit`` carries a sampled ``traceparent``
  (the tokenizer's ``generate`` span is its parent), from the step holding its first row to the
  step holding its last; GenAI output tokens and finish reason; the error status for an abort,
  or when its scheduler's stream ends first.
- ``--log-requests``: one line per rid when its last row passes (finish reason, tokens); no text.
"""

from __future__ import annotations

import logging
import time

from opentelemetry import trace

from ringserve import tracing
from ringserve.v1 import common_pb2, detokenizer_pb2

log = logging.getLogger(__name__)

SPAN = "detokenize"


class RequestTracer:
    """Args: log_requests: write a line per finished rid."""

    def __init__(self, log_requests: bool) -> None:
        self.log_requests = log_requests
        self.spans: dict[str, trace.Span] = {}  # rid -> its open span

    def observe(self, batch: detokenizer_pb2.BatchTokenIDOutput) -> None:
        """One scheduler step, after it was decoded: open spans of new rids, end those of finished ones."""
        tracer = tracing.tracer
        if tracer is not None and batch.inits:
            now = time.time_ns()
            for init in batch.inits:
                parent = tracing.row_context(init.traceparent)
                rid = batch.rids[init.row]
                if parent is not None and rid not in self.spans:
                    self.spans[rid] = tracer.start_span(SPAN, parent, start_time=now, attributes={tracing.RID: rid})
        if not (self.spans or self.log_requests):
            return
        for i, fr in enumerate(batch.finish_reasons):
            if fr.type != common_pb2.FINISH_NONE:
                self._finish(batch.rids[i], fr, batch.completion_tokens[i] if batch.completion_tokens else 0)

    def _finish(self, rid: str, fr: common_pb2.FinishReason, output_tokens: int) -> None:
        reason = tracing.FINISH_REASONS[fr.type]
        span = self.spans.pop(rid, None)
        if span is not None:
            span.set_attributes({tracing.GEN_AI_USAGE_OUTPUT_TOKENS: output_tokens,
                                 tracing.GEN_AI_RESPONSE_FINISH_REASONS: [reason]})
            if fr.type == common_pb2.FINISH_ABORT:
                tracing.fail(span, f"{fr.status}: {fr.message}")
            span.end()
        if self.log_requests:
            if fr.type == common_pb2.FINISH_ABORT:
                log.info("request %s aborted (%s): %s; %d output tokens", rid, fr.status, fr.message, output_tokens)
            else:
                log.info("request %s finished: %s, %d output tokens", rid, reason, output_tokens)

    def drop_all(self, reason: str) -> None:
        """Every scheduler stream ended: the open spans end with the error ``reason``."""
        for span in self.spans.values():
            tracing.fail(span, reason)
            span.end()
        self.spans.clear()
