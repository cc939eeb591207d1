"""One request followed around a launched ring: OpenTelemetry spans from all four services exported
to an OTLP receiver this module starts (tests/helpers/otlp.py), and X-Request-Id through the
HTTP API and every service's log line.

The ring is the session's ``keyed_ring`` (tests/e2e/conftest.py): it has ``--log-requests``
and exports its spans to the session's receiver (``otlp``), with a 50 ms batch-export delay so
spans arrive at once; every call here presents its API key. Each test follows only its own
trace ids and request ids, so the other tests' spans and log lines there do not matter.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict

import httpx
import pytest

from tests.helpers.otlp import OtlpReceiver, Span
from tests.helpers.ringstack import OwnStack

SERVICES = {f"ringserve-{s}" for s in ("gateway", "tokenizer", "scheduler", "detokenizer")}
CLIENT_SPAN = "b7ad6b7169203331"
CHAT = "/v1/chat/completions"
# What marks each service's log lines in the ring's log.
MARKERS = ("gateway: ", "services.tokenizer.", "services.scheduler.", "services.detokenizer.")


@pytest.fixture
def traced(keyed_ring: OwnStack, otlp: tuple[str, OtlpReceiver]) -> tuple[OwnStack, OtlpReceiver]:
    return keyed_ring, otlp[1]


def traceparent(n: int) -> tuple[str, str]:
    """A client's sampled trace context: (trace id, traceparent header)."""
    trace_id = f"{n:032x}"
    return trace_id, f"00-{trace_id}-{CLIENT_SPAN}-01"


def chat(ring: OwnStack, **extra) -> dict:
    return {"model": ring.model_name, "messages": [{"role": "user", "content": "Name three colours."}],
            "max_tokens": 8, "temperature": 0, **extra}


def keyed(ring: OwnStack, headers: dict[str, str]) -> dict[str, str]:
    """``headers`` and the ring's API key."""
    return {**ring.http_headers, **headers}


def trace_of(receiver: OtlpReceiver, trace_id: str, done) -> list[Span]:
    """The spans of ``trace_id`` once ``done(spans)`` holds."""
    return [s for s in receiver.wait_for(lambda all_: done([s for s in all_ if s.trace_id == trace_id]))
            if s.trace_id == trace_id]


def named(spans: list[Span], service: str, name: str) -> list[Span]:
    return [s for s in spans if s.service == f"ringserve-{service}" and s.name == name]


def finished_everywhere(spans: list[Span], choices: int = 1) -> bool:
    return (len(named(spans, "detokenizer", "detokenize")) == choices
            and len(named(spans, "scheduler", "decode")) == choices and bool(named(spans, "tokenizer", "generate"))
            and bool(named(spans, "gateway", "POST " + CHAT)))


def test_a_streamed_chat_is_one_trace_across_the_four_services(traced):
    ring, receiver = traced
    trace_id, header = traceparent(1)
    started = time.time_ns()
    with httpx.stream("POST", f"{ring.base_url}{CHAT}", json=chat(ring, stream=True), timeout=60,
                      headers=keyed(ring, {"traceparent": header, "X-Request-Id": "trace-me-1"})) as r:
        assert r.status_code == 200 and r.headers["x-request-id"] == "trace-me-1"
        body = "".join(r.iter_text())
    ended = time.time_ns()
    assert body.endswith("data: [DONE]\n\n")
    spans = trace_of(receiver, trace_id, finished_everywhere)
    assert {s.service for s in spans} == SERVICES
    ids = {s.span_id for s in spans}
    (http,) = named(spans, "gateway", "POST " + CHAT)
    assert http.parent == CLIENT_SPAN  # the client's span
    assert all(s.parent in ids for s in spans if s is not http)  # every other parent in this trace
    assert all(s.error is None for s in spans)
    assert all(s.attributes["ringserve.rid"] == "trace-me-1" for s in spans)
    (sse,) = named(spans, "gateway", "sse stream")
    (generate,) = named(spans, "tokenizer", "generate")
    (tokenize,) = named(spans, "tokenizer", "template + tokenize")
    (queue,) = named(spans, "scheduler", "queue")
    chunks = named(spans, "scheduler", "prefill chunk")
    (decode,) = named(spans, "scheduler", "decode")
    (detok,) = named(spans, "detokenizer", "detokenize")
    assert sse.parent == generate.parent == http.span_id
    assert {tokenize.parent, queue.parent, decode.parent, detok.parent} == {generate.span_id}
    assert http.attributes["gen_ai.request.model"] == ring.model_name
    assert http.attributes["gen_ai.request.max_tokens"] == 8
    assert decode.attributes["gen_ai.usage.output_tokens"] == generate.attributes["gen_ai.usage.output_tokens"] == 8
    assert decode.attributes["gen_ai.response.finish_reasons"] == ["length"]
    assert [name for name, _ in decode.events] == ["first token", "last token"]
    # The stages in order, each within the request's end-to-end time as the client saw it.
    assert started <= http.start <= generate.start <= tokenize.start <= tokenize.end <= queue.start
    assert queue.end <= chunks[0].start and chunks[-1].end <= decode.start <= detok.start
    assert detok.end <= generate.end <= sse.end <= http.end and sse.end <= ended
    assert decode.start <= sse.start  # the stream's first byte waits for the first token
    for s in spans:  # the gateway's span may end a moment after the client has the last byte
        assert s.end - s.start <= ended - started


def test_an_aborted_stream_ends_every_services_span_with_the_error(traced):
    ring, receiver = traced
    trace_id, header = traceparent(2)

    async def read_one_chunk() -> None:
        async with httpx.AsyncClient(base_url=ring.base_url, timeout=60) as client:
            async with client.stream("POST", CHAT, json=chat(ring, stream=True, max_tokens=400, ignore_eos=True),
                                     headers=keyed(ring, {"traceparent": header})) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        return  # the client goes away mid-stream

    asyncio.run(read_one_chunk())
    spans = trace_of(receiver, trace_id, finished_everywhere)
    for service, name in (("gateway", "POST " + CHAT), ("gateway", "sse stream"), ("tokenizer", "generate"),
                          ("scheduler", "decode"), ("detokenizer", "detokenize")):
        (span,) = named(spans, service, name)
        assert span.error, (service, name)
    (decode,) = named(spans, "scheduler", "decode")
    assert decode.error.startswith("CANCELLED: ") and decode.attributes["gen_ai.response.finish_reasons"] == ["abort"]
    assert decode.attributes["gen_ai.usage.output_tokens"] < 400
    ring.wait_idle()


def test_a_400_ends_its_spans_with_the_error(traced):
    ring, receiver = traced
    trace_id, header = traceparent(3)
    r = httpx.post(f"{ring.base_url}{CHAT}", json=chat(ring, max_tokens=9000), timeout=60,
                   headers=keyed(ring, {"traceparent": header, "X-Request-Id": "too-long-1"}))
    assert r.status_code == 400 and r.headers["x-request-id"] == "too-long-1"
    assert r.json()["error"]["code"] == "context_length_exceeded"
    spans = trace_of(receiver, trace_id, lambda s: len(s) == 2)
    http, generate = sorted(spans, key=lambda s: s.start)
    assert (http.service, http.error) == ("ringserve-gateway", "HTTP 400")
    assert generate.service == "ringserve-tokenizer" and generate.error.startswith(
        "This model's maximum context length is 8192 tokens.")


def test_n2_and_two_concurrent_requests_keep_their_traces_apart(traced):
    ring, receiver = traced
    ring.wait_idle()  # the ring's two slots and queue of one take the three sequences only when idle
    (first, h1), (second, h2) = traceparent(4), traceparent(5)

    async def both() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=ring.base_url, timeout=60) as client:
            return list(await asyncio.gather(
                client.post(CHAT, json=chat(ring, n=2, temperature=0.8, seed=1),
                            headers=keyed(ring, {"traceparent": h1, "X-Request-Id": "pair"})),
                client.post(CHAT, json=chat(ring), headers=keyed(ring, {"traceparent": h2, "X-Request-Id": "single"}))))

    replies = asyncio.run(both())
    assert [r.status_code for r in replies] == [200, 200]
    pair = trace_of(receiver, first, lambda s: finished_everywhere(s, choices=2))
    single = trace_of(receiver, second, finished_everywhere)
    rids: dict[str, set[str]] = defaultdict(set)
    for s in pair:
        rids[s.name].add(s.attributes["ringserve.rid"])
    assert rids["decode"] == rids["detokenize"] == rids["queue"] == {"pair-0", "pair-1"}
    assert rids["generate"] == rids["POST " + CHAT] == {"pair"}
    assert {s.attributes["ringserve.rid"] for s in single} == {"single"}
    assert not {s.span_id for s in pair} & {s.span_id for s in single}


def test_x_request_id_round_trips_and_names_the_request_in_every_services_log(traced):
    ring, _ = traced
    r = httpx.post(f"{ring.base_url}{CHAT}", json=chat(ring), headers=keyed(ring, {"X-Request-Id": "log-me-7"}),
                   timeout=60)
    assert r.status_code == 200 and r.headers["x-request-id"] == "log-me-7" and r.json()["id"] == "chatcmpl-log-me-7"
    with httpx.stream("POST", f"{ring.base_url}{CHAT}", json=chat(ring, stream=True), timeout=60,
                      headers=keyed(ring, {"X-Request-Id": "log-me-8"})) as s:
        assert s.headers["x-request-id"] == "log-me-8" and "".join(s.iter_text()).endswith("[DONE]\n\n")
    bad = httpx.post(f"{ring.base_url}{CHAT}", json=chat(ring, rid="other"),
                     headers=keyed(ring, {"X-Request-Id": "log-me-9"}), timeout=60)
    assert bad.status_code == 400 and bad.headers["x-request-id"] == "log-me-9"
    fresh = httpx.post(f"{ring.base_url}{CHAT}", json=chat(ring), headers=keyed(ring, {}), timeout=60)
    assert fresh.json()["id"] == "chatcmpl-" + fresh.headers["x-request-id"]
    deadline = time.monotonic() + 10
    while True:
        lines = [line for line in ring.log().splitlines() if "log-me-7" in line]
        services = {name for name in MARKERS if any(name in line for line in lines)}
        if len(services) == 4 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert services == set(MARKERS), lines
    assert any("services.scheduler.request_trace: request log-me-7 finished: length" in line for line in lines)
