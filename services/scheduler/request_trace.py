"""The scheduler's spans and log lines per request, fed by the engine's hooks (``EngineObserver``).

Installed over the engine's observer (the metrics) when tracing is on or ``--log-requests`` is
given; otherwise nothing here runs. Its hooks run in the engine thread, so spans are made at a
request's boundaries only (first schedule, each prefill chunk, finish), never per token or per
decode step: each span is created once its end is known, with its real start time.

Spans, children of the ``traceparent`` the request arrived with (the tokenizer's ``generate``
span), for requests whose trace is sampled:

- ``queue``: joining the waiting queue -> the start of the step that first schedules it
  (vLLM's queue time);
- ``prefill chunk``: one per step that extends the request: the step's start -> its forward
  pass done (after a retraction the re-prefill's chunks come again);
- ``decode``: the first token -> the end; events ``first token``, ``last token`` and one
  ``retracted`` per retraction; GenAI usage and finish reason.

An abort (any status) ends the request's last span with the error status and its message; a
request refused before it was queued gets a ``queue`` span of no length with the error.

``--log-requests``: one line per request when it leaves the scheduler (rid, finish reason or
abort, tokens); no text.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.context import Context

from ringserve import tracing
from services.scheduler.engine.engine import Engine
from services.scheduler.engine.observer import EngineObserver
from services.scheduler.policy.req import FinishType, Req
from services.scheduler.policy.schedule import Plan

log = logging.getLogger(__name__)


@dataclass
class _Trace:
    """A traced request's times (ns since the epoch) and retraction events so far."""

    parent: Context
    queued_ns: int
    scheduled: bool = False
    first_token_ns: int | None = None
    retracted: list[tuple[int, int]] = field(default_factory=list)  # (time, output tokens then)
    parked: bool = False  # retracted, not yet re-admitted


class RequestTracer(EngineObserver):
    """Wraps ``engine.observer`` (every hook is passed on first) and installs itself in its place.

    Args:
        engine: the engine to observe.
        log_requests: write a line per finished request.
    """

    def __init__(self, engine: Engine, log_requests: bool):
        self.inner = engine.observer
        self.policy = engine.policy
        self.log_requests = log_requests
        self.traces: dict[Req, _Trace] = {}
        self._retractions = engine.policy.num_retracted
        engine.observer = self

    def on_queued(self, req: Req) -> None:
        self.inner.on_queued(req)
        if tracing.tracer is not None:
            parent = tracing.row_context(req.traceparent)
            if parent is not None:
                self.traces[req] = _Trace(parent, time.time_ns())

    def on_step(self, plan: Plan, started: float) -> None:
        self.inner.on_step(plan, started)
        if not self.traces:
            return
        now = time.time_ns()
        start_ns = now - int((time.monotonic() - started) * 1e9)
        if self.policy.num_retracted != self._retractions:  # this step's schedule retracted some
            self._retractions = self.policy.num_retracted
            for req, t in self.traces.items():
                if t.scheduled and not t.parked and req.req_slot is None:
                    t.parked = True
                    t.retracted.append((start_ns, len(req.output_ids)))
        n = plan.num_extend
        for req, prefix_len, extend_len in zip(plan.reqs[:n], plan.prefix_lens[:n], plan.extend_lens[:n], strict=True):
            t = self.traces.get(req)
            if t is None:
                continue
            if not t.scheduled:
                t.scheduled = True
                self._span("queue", t, t.queued_ns, start_ns, req)
            t.parked = False
            done = prefix_len + extend_len == req.seq_len  # the prompt (and any output) is in: it samples
            self._span("prefill chunk", t, start_ns, now, req, {
                "ringserve.extend_tokens": extend_len, "ringserve.prefix_tokens": prefix_len,
                "ringserve.prompt_done": done})
            if done and t.first_token_ns is None:
                t.first_token_ns = now

    def on_finish(self, req: Req) -> None:
        self.inner.on_finish(req)
        fr = req.finish_reason
        assert fr is not None
        t = self.traces.pop(req, None)
        if self.log_requests:
            self._log(req)
        if tracing.tracer is None:
            return
        now = time.time_ns()
        error = f"{fr.status}: {fr.message}" if fr.type == FinishType.ABORT else None
        if t is None:  # refused or aborted before it was queued
            parent = tracing.row_context(req.traceparent)
            if parent is not None:
                self._span("queue", _Trace(parent, now), now, now, req, error=error or "not queued")
            return
        if not t.scheduled:
            self._span("queue", t, t.queued_ns, now, req, error=error)
        elif t.first_token_ns is None:
            self._span("prefill chunk", t, now, now, req, {"ringserve.prompt_done": False}, error=error)
        else:
            attrs: dict[str, Any] = {
                tracing.GEN_AI_USAGE_INPUT_TOKENS: req.prompt_len,
                tracing.GEN_AI_USAGE_OUTPUT_TOKENS: len(req.output_ids),
                "ringserve.cached_tokens": req.cached_tokens or 0,
                tracing.GEN_AI_RESPONSE_FINISH_REASONS: [tracing.FINISH_REASONS[fr.type]],
                "ringserve.retractions": len(t.retracted)}
            assert tracing.tracer is not None
            span = tracing.tracer.start_span("decode", t.parent, start_time=t.first_token_ns,
                                             attributes={tracing.RID: req.rid, **attrs})
            span.add_event("first token", timestamp=t.first_token_ns)
            for at, tokens in t.retracted:
                span.add_event("retracted", {"ringserve.output_tokens": tokens}, timestamp=at)
            if req.output_ids:
                span.add_event("last token", timestamp=now)
            if error is not None:
                tracing.fail(span, error)
            span.end(now)

    @staticmethod
    def _span(name: str, t: _Trace, start: int, end: int, req: Req, attrs: dict[str, Any] | None = None,
              error: str | None = None) -> None:
        assert tracing.tracer is not None
        span = tracing.tracer.start_span(name, t.parent, start_time=start,
                                         attributes={tracing.RID: req.rid, **(attrs or {})})
        if error is not None:
            tracing.fail(span, error)
        span.end(end)

    @staticmethod
    def _log(req: Req) -> None:
        fr = req.finish_reason
        assert fr is not None
        if fr.type == FinishType.ABORT:
            log.info("request %s aborted (%s): %s; %d output tokens", req.rid, fr.status, fr.message,
                     len(req.output_ids))
        else:
            log.info("request %s finished: %s, %d prompt tokens (%d cached), %d output tokens", req.rid,
                     tracing.FINISH_REASONS[fr.type], req.prompt_len, req.cached_tokens or 0, len(req.output_ids))
