"""The scheduler's spans and log lines per request against the real engine (spans in memory):
queue, one span per prefill chunk, decode with its events, through chunked prefill, retraction
and an abort; the RowInit that hands the trace context to the detokenizer."""

from __future__ import annotations

import logging
import math
from collections import Counter
from dataclasses import replace

from opentelemetry import trace
from opentelemetry.trace import StatusCode

from ringserve import tracing
from services.scheduler.engine.observer import EngineObserver
from services.scheduler.policy.output import RowInit, StepOutput
from services.scheduler.request_trace import RequestTracer
from services.scheduler.wire import step_output_to_proto
from tests.helpers.otlp import recording

WORDS = ["ten", "twenty", "thirty", "forty"]


def test_spans_through_chunked_prefill_retraction_and_abort(make_engine, chat_ids, greedy_req, run_all):
    prompts = {f"r{i}": chat_ids(f"Count to {w}.") for i, w in enumerate(WORDS)}
    # As tests/scheduler/test_metrics.py: all four prompts fit at admission, not all four
    # finished sequences (retraction), and chunks of 8 tokens.
    size = sum(len(p) for p in prompts.values()) + 16
    engine = make_engine(max_total_tokens=size, disable_radix_cache=True, chunked_prefill_size=8)
    tracer = RequestTracer(engine, log_requests=False)
    assert isinstance(tracer.inner, EngineObserver)
    with recording() as exporter:
        assert tracing.tracer is not None
        parent = tracing.tracer.start_span("generate")
        traceparent = tracing.traceparent(parent)
        for rid, ids in prompts.items():
            engine.add_request(replace(greedy_req(rid, ids, 16, ignore_eos=True), traceparent=traceparent))
        engine.add_request(replace(greedy_req("gone", chat_ids("Never mind."), 16), traceparent=traceparent))
        engine.add_request(greedy_req("untraced", chat_ids("Hi."), 2))
        engine.add_request(replace(greedy_req("unsampled", chat_ids("Hi."), 2),
                                   traceparent=traceparent[:-2] + "00"))
        engine.abort(rid="gone")
        got = run_all(engine)
        parent.end()
    assert engine.policy.num_retracted > 0 and not tracer.traces
    spans = [s for s in exporter.get_finished_spans() if s.name != "generate"]
    own = parent.get_span_context()
    assert {(s.context.trace_id, s.parent.span_id) for s in spans} == {(own.trace_id, own.span_id)}
    by_rid: dict[str, list] = {}
    for s in spans:
        by_rid.setdefault(s.attributes[tracing.RID], []).append(s)
    assert sorted(by_rid) == ["gone", *prompts]  # nothing for the untraced and the unsampled requests

    (gone,) = by_rid.pop("gone")  # aborted while it waited: its queue span, with the error
    assert gone.name == "queue" and gone.status.status_code == StatusCode.ERROR
    assert gone.status.description == "CANCELLED: aborted"
    retracted = 0
    for rid, own_spans in by_rid.items():
        names = Counter(s.name for s in own_spans)
        (queue,) = [s for s in own_spans if s.name == "queue"]
        (decode,) = [s for s in own_spans if s.name == "decode"]
        chunks = sorted((s for s in own_spans if s.name == "prefill chunk"), key=lambda s: s.start_time)
        events = [e.name for e in decode.events]
        retracted += events.count("retracted")
        # Every chunk of 8 of the prompt, and again (with the output so far) after each retraction.
        assert names["prefill chunk"] >= math.ceil(len(prompts[rid]) / 8)
        assert sum(c.attributes["ringserve.extend_tokens"] for c in chunks if c.start_time < decode.start_time) \
            == len(prompts[rid])
        assert events[0] == "first token" and events[-1] == "last token"
        assert dict(decode.attributes) == {
            tracing.RID: rid, tracing.GEN_AI_USAGE_INPUT_TOKENS: len(prompts[rid]),
            tracing.GEN_AI_USAGE_OUTPUT_TOKENS: 16, "ringserve.cached_tokens": 0,
            tracing.GEN_AI_RESPONSE_FINISH_REASONS: ("length",), "ringserve.retractions": events.count("retracted")}
        assert got[rid].completion_tokens == 16
        # In order: queued, then the chunks one after another, the first token when the last
        # chunk of the prompt is done, decode to the end.
        assert queue.end_time <= chunks[0].start_time
        assert all(a.end_time <= b.start_time for a, b in zip(chunks, chunks[1:], strict=False))
        done = [c for c in chunks if c.attributes["ringserve.prompt_done"]]
        assert done[0].end_time == decode.start_time == decode.events[0].timestamp
        assert decode.end_time == decode.events[-1].timestamp
        assert all(s.status.status_code == StatusCode.UNSET for s in own_spans)
    assert retracted == engine.policy.num_retracted  # every retraction of a traced request, once


def test_log_lines_name_the_rid(make_engine, chat_ids, greedy_req, run_all, caplog):
    engine = make_engine()
    RequestTracer(engine, log_requests=True)
    caplog.set_level(logging.INFO, "services.scheduler.request_trace")
    ids = chat_ids("Hi.")
    engine.add_request(greedy_req("logged-1", ids, 3, ignore_eos=True))
    engine.add_request(greedy_req("logged-2", ids, 3))
    engine.abort(rid="logged-2", message="the client went away")
    run_all(engine)
    assert sorted(caplog.messages) == [
        f"request logged-1 finished: length, {len(ids)} prompt tokens (0 cached), 3 output tokens",
        "request logged-2 aborted (CANCELLED): the client went away; 0 output tokens",
    ]


def test_the_first_row_hands_the_trace_context_to_the_detokenizer():
    out = StepOutput(rids=["a"], tokenizer_ids=["t"], new_token_counts=[0], finish_reasons=[None],
                     prompt_tokens=[1], completion_tokens=[0], cached_tokens=[0], logprob_counts=[0],
                     inits=[RowInit(0, [5], (), True, True, False, 0, "00-0af7651916cd43dd8448eb211c80319c-"
                                                                       "b7ad6b7169203331-01")])
    msg = step_output_to_proto(out)
    assert msg.inits[0].traceparent == "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    assert tracing.row_context(msg.inits[0].traceparent) is not None
    assert trace.get_current_span(tracing.row_context(msg.inits[0].traceparent)).get_span_context().is_remote
