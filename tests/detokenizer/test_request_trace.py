"""The detokenizer's span and log line per request (spans in memory): from the step holding a
rid's first row (its RowInit names the trace) to the step holding its last."""

from __future__ import annotations

import logging

from opentelemetry.trace import StatusCode

from ringserve import tracing
from ringserve.v1 import common_pb2, detokenizer_pb2
from services.detokenizer.request_trace import RequestTracer
from services.detokenizer.servicer import DetokenizerServicer
from tests.helpers.otlp import recording

STOP = common_pb2.FinishReason(type=common_pb2.FINISH_STOP)
NONE = common_pb2.FinishReason()


def step(rows: list[tuple[str, common_pb2.FinishReason, int]], inits: dict[int, str] | None = None):
    """A BatchTokenIDOutput of (rid, finish reason, completion tokens) rows, one id each; ``inits``:
    row -> the traceparent its RowInit carries."""
    return detokenizer_pb2.BatchTokenIDOutput(
        rids=[r for r, _, _ in rows], tokenizer_ids=["t"] * len(rows), new_token_counts=[1] * len(rows),
        output_ids=[7] * len(rows), finish_reasons=[f for _, f, _ in rows],
        completion_tokens=[n for _, _, n in rows],
        inits=[detokenizer_pb2.RowInit(row=i, traceparent=tp) for i, tp in (inits or {}).items()])


class _Manager:
    """What the servicer needs of a DetokenizerManager to route a step (no vocabulary)."""

    def handle_batch(self, batch):
        return {}

    def drop_all(self) -> int:
        return 0


def test_a_span_per_traced_rid_from_its_first_row_to_its_last():
    with recording() as exporter:
        assert tracing.tracer is not None
        parent = tracing.tracer.start_span("generate")
        tp = tracing.traceparent(parent)
        servicer = DetokenizerServicer(_Manager(), "detok")  # type: ignore[arg-type]
        servicer.requests = RequestTracer(log_requests=False)
        servicer.route(step([("a", NONE, 1), ("b", NONE, 1), ("c", NONE, 1)], {0: tp, 1: tp[:-2] + "00", 2: ""}))
        servicer.route(step([("a", NONE, 2), ("b", STOP, 2), ("c", STOP, 2)]))
        assert exporter.get_finished_spans() == ()  # a is still running
        aborted = common_pb2.FinishReason(type=common_pb2.FINISH_ABORT, status="CANCELLED", message="gone")
        servicer.route(step([("a", aborted, 2), ("d", NONE, 1)], {1: tp}))
        servicer.requests.drop_all("the scheduler stream ended")
        parent.end()
    a, d = [s for s in exporter.get_finished_spans() if s.name == "detokenize"]
    own = parent.get_span_context()
    assert {(s.context.trace_id, s.parent.span_id) for s in (a, d)} == {(own.trace_id, own.span_id)}
    assert dict(a.attributes) == {tracing.RID: "a", tracing.GEN_AI_USAGE_OUTPUT_TOKENS: 2,
                                  tracing.GEN_AI_RESPONSE_FINISH_REASONS: ("abort",)}
    assert (a.status.status_code, a.status.description) == (StatusCode.ERROR, "CANCELLED: gone")
    assert (d.attributes[tracing.RID], d.status.description) == ("d", "the scheduler stream ended")
    assert servicer.requests.spans == {}


def test_log_lines_name_the_rid(caplog):
    caplog.set_level(logging.INFO, "services.detokenizer.request_trace")
    requests = RequestTracer(log_requests=True)
    requests.observe(step([("a", NONE, 1)], {0: ""}))
    aborted = common_pb2.FinishReason(type=common_pb2.FINISH_ABORT, status="INTERNAL", message="broke")
    requests.observe(step([("a", STOP, 4), ("b", aborted, 0)]))
    assert caplog.messages == ["request a finished: stop, 4 output tokens",
                               "request b aborted (INTERNAL): broke; 0 output tokens"]
