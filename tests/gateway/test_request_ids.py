"""X-Request-Id through the gateway (in front of the fake tokenizer): accepted, refused, generated,
returned on every response; and the gateway's spans when tracing is on (in memory), none when off."""

from __future__ import annotations

import asyncio
import logging
import re

import grpc
import httpx
import orjson
import pytest
from opentelemetry.trace import SpanKind, StatusCode

from ringserve import tracing
from services.gateway import request_context, sse
from services.gateway.errors import GatewayError
from services.gateway.request_context import ERROR_EVENT, RequestContextMiddleware, RequestLogFilter
from tests.helpers.otlp import recording

pytestmark = pytest.mark.asyncio(loop_scope="session")

CHAT = "/v1/chat/completions"
HEX32 = re.compile(r"[0-9a-f]{32}")
CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"


def chat(stack, **extra) -> dict:
    return {"model": stack.model, "messages": [{"role": "user", "content": "hi"}], **extra}


ROUTES = {
    "chat": (CHAT, lambda s: chat(s), "chatcmpl-"),
    "chat stream": (CHAT, lambda s: chat(s, stream=True), "chatcmpl-"),
    "completions": ("/v1/completions", lambda s: {"model": s.model, "prompt": "hi"}, "cmpl-"),
    "generate": ("/generate", lambda s: {"text": "hi"}, None),
}


@pytest.mark.parametrize("route", ROUTES)
async def test_the_header_is_the_rid_and_comes_back(stack, route):
    path, body, prefix = ROUTES[route]
    stack.fake.reset(stack.out("ok", finish="stop"))
    r = await stack.client.post(path, json=body(stack), headers={"X-Request-Id": "client-id-7"})
    assert r.status_code == 200, r.text
    assert r.headers["x-request-id"] == "client-id-7"
    assert [q.rid for q in stack.fake.requests] == ["client-id-7"]
    if prefix and not r.headers["content-type"].startswith("text/event-stream"):
        assert r.json()["id"] == prefix + "client-id-7"


async def test_the_header_is_the_rid_of_responses_and_embeddings(stack):
    stack.fake.reset(stack.out("ok", finish="stop"))
    r = await stack.client.post("/v1/responses", json={"model": stack.model, "input": "hi"},
                                headers={"X-Request-Id": "client-id-8"})
    assert r.status_code == 200, r.text
    assert r.headers["x-request-id"] == "client-id-8"
    assert [q.rid for q in stack.fake.requests] == ["client-id-8"]
    assert r.json()["id"].startswith("resp_") and r.json()["id"] != "resp_client-id-8"  # new per response
    r = await stack.client.post("/v1/embeddings", json={"model": stack.model, "input": "hi"},
                                headers={"X-Request-Id": "client-id-9"})
    assert r.status_code == 200, r.text
    assert r.headers["x-request-id"] == "client-id-9"
    assert stack.fake.embed_requests[-1].rid == "client-id-9"


@pytest.mark.parametrize("field", ["rid", "request_id"])
async def test_a_body_rid_comes_back_as_the_header(stack, field):
    stack.fake.reset(stack.out("ok", finish="stop"))
    r = await stack.client.post(CHAT, json=chat(stack, **{field: "body-9"}))
    assert r.status_code == 200 and r.headers["x-request-id"] == "body-9"
    # The same id in the header too is no conflict.
    stack.fake.reset(stack.out("ok", finish="stop"))
    r = await stack.client.post(CHAT, json=chat(stack, **{field: "body-9"}), headers={"X-Request-Id": "body-9"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "body-9"


async def test_without_one_the_response_names_the_rid_it_was_served_under(stack):
    stack.fake.reset(stack.out("ok", finish="stop"))
    r = await stack.client.post(CHAT, json=chat(stack))
    rid = r.headers["x-request-id"]
    assert HEX32.fullmatch(rid) and stack.fake.requests[0].rid == rid and r.json()["id"] == f"chatcmpl-{rid}"


async def test_a_rid_outside_visible_ascii_comes_back_percent_encoded(stack):
    stack.fake.reset(stack.out("ok", finish="stop"))
    r = await stack.client.post(CHAT, json=chat(stack, rid="café 1"))
    assert r.status_code == 200 and r.headers["x-request-id"] == "caf%C3%A9%201"
    assert stack.fake.requests[0].rid == "café 1"


async def test_header_and_body_rid_that_differ_are_refused(stack):
    stack.fake.reset(stack.out("ok", finish="stop"))
    r = await stack.client.post(CHAT, json=chat(stack, rid="body-1"), headers={"X-Request-Id": "head-1"})
    assert r.status_code == 400 and r.headers["x-request-id"] == "head-1"
    assert r.json()["error"] == {
        "message": "X-Request-Id 'head-1' and the request's rid 'body-1' differ; give one, or the same in both",
        "type": "invalid_request_error", "param": "rid", "code": "invalid_value"}
    assert stack.fake.requests == []  # refused before anything was sent


async def test_a_bad_header_is_refused_with_a_fresh_id(stack):
    stack.fake.reset(stack.out("ok", finish="stop"))
    r = await stack.client.post(CHAT, json=chat(stack), headers={"X-Request-Id": "two words"})
    assert r.status_code == 400 and HEX32.fullmatch(r.headers["x-request-id"])
    assert r.json()["error"]["message"] == "X-Request-Id 'two words' must be visible ASCII characters without spaces"
    assert r.json()["error"]["param"] == "X-Request-Id" and stack.fake.requests == []


async def test_every_error_carries_the_id(stack, keyed):
    stack.fake.reset(stack.Fail(grpc.StatusCode.ALREADY_EXISTS, "request id 'dup-1' is already in flight"))
    r = await stack.client.post(CHAT, json=chat(stack), headers={"X-Request-Id": "dup-1"})
    assert (r.status_code, r.json()["error"]["code"], r.headers["x-request-id"]) == (400, "duplicate_request_id",
                                                                                     "dup-1")
    r = await stack.client.post(CHAT, json={"model": stack.model}, headers={"X-Request-Id": "bad-body"})
    assert r.status_code == 400 and r.headers["x-request-id"] == "bad-body"  # validation, before any route code
    r = await stack.client.get("/v1/nothing-here", headers={"X-Request-Id": "lost-1"})
    assert r.status_code == 404 and r.headers["x-request-id"] == "lost-1"
    r = await keyed.post(CHAT, json=chat(stack), headers={"X-Request-Id": "no-key"})
    assert r.status_code == 401 and r.headers["x-request-id"] == "no-key"
    r = await stack.client.get("/v1/models")
    assert r.status_code == 200 and HEX32.fullmatch(r.headers["x-request-id"])


async def test_an_unhandled_error_carries_the_id_too():
    async def broken(scope, receive, send):
        raise RuntimeError("boom")

    from starlette.middleware.errors import ServerErrorMiddleware
    app = RequestContextMiddleware(ServerErrorMiddleware(broken))
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
        r = await client.get("/x", headers={"X-Request-Id": "oops-1"})
    assert r.status_code == 500 and r.headers["x-request-id"] == "oops-1"


async def test_log_records_written_during_a_request_carry_its_id(caplog):
    seen: list[str] = []

    async def app(scope, receive, send):
        logging.getLogger("ringserve.test").warning("inside")
        await sse.json_response({})(scope, receive, send)

    log_filter = RequestLogFilter()
    caplog.handler.addFilter(log_filter)
    try:
        transport = httpx.ASGITransport(app=RequestContextMiddleware(app))
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            await client.get("/x", headers={"X-Request-Id": "logged-1"})
        seen = [r.request_tag for r in caplog.records if r.getMessage() == "inside"]  # type: ignore[attr-defined]
        logging.getLogger("ringserve.test").warning("outside")
        assert caplog.records[-1].request_tag == ""  # type: ignore[attr-defined]
    finally:
        caplog.handler.removeFilter(log_filter)
    assert seen == ["[logged-1] "]


async def test_the_error_event_prefix_is_what_sse_writes():
    assert sse.error_event(GatewayError("x", 500, "server_error")).startswith(ERROR_EVENT)
    assert not sse.event({"id": "chatcmpl-1", "choices": []}).startswith(ERROR_EVENT)


# ---- spans ------------------------------------------------------------------------------------

def _by_name(exporter) -> dict:
    return {s.name: s for s in exporter.get_finished_spans()}


async def _spans(exporter, count: int) -> dict:
    for _ in range(200):  # the middleware ends its span after the response's last byte
        if len(exporter.get_finished_spans()) >= count:
            break
        await asyncio.sleep(0.01)
    return _by_name(exporter)


async def test_a_traced_stream_continues_the_clients_trace(stack):
    stack.fake.reset(stack.out("a"), stack.out("b", finish="stop", completion=2))
    with recording() as exporter:
        r = await stack.client.post(
            CHAT, json=chat(stack, stream=True, max_tokens=9, temperature=0.5),
            headers={"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01", "X-Request-Id": "traced-1"})
        assert r.status_code == 200
        spans = await _spans(exporter, 2)
    http, stream = spans["POST /v1/chat/completions"], spans["sse stream"]
    assert http.kind == SpanKind.SERVER and format(http.context.trace_id, "032x") == CLIENT_TRACE
    assert format(http.parent.span_id, "016x") == CLIENT_SPAN
    assert dict(http.attributes) == {
        "http.request.method": "POST", "url.path": CHAT, "http.route": CHAT, "http.response.status_code": 200,
        tracing.RID: "traced-1", tracing.GEN_AI_OPERATION: "chat", tracing.GEN_AI_REQUEST_MODEL: stack.model,
        tracing.GEN_AI_REQUEST_MAX_TOKENS: 9, tracing.GEN_AI_REQUEST_TEMPERATURE: 0.5}
    assert http.status.status_code == StatusCode.UNSET
    assert stream.parent.span_id == http.context.span_id and stream.status.status_code == StatusCode.UNSET
    assert http.start_time <= stream.start_time <= stream.end_time <= http.end_time
    # The tokenizer is told to continue the request's span.
    own = format(http.context.span_id, "016x")
    assert stack.fake.metadata[-1]["traceparent"] == f"00-{CLIENT_TRACE}-{own}-01"


async def test_a_400_ends_the_request_span_with_the_error_status(stack):
    stack.fake.reset(stack.out("ok", finish="stop"))
    with recording() as exporter:
        r = await stack.client.post(CHAT, json=chat(stack, rid="b"), headers={"X-Request-Id": "h"})
        assert r.status_code == 400
        (span,) = (await _spans(exporter, 1)).values()
    assert span.status.status_code == StatusCode.ERROR and span.status.description == "HTTP 400"
    assert span.attributes["http.response.status_code"] == 400 and span.attributes[tracing.RID] == "h"


async def test_an_error_event_mid_stream_ends_both_spans_with_the_error_status(stack):
    stack.fake.reset(stack.out("a"), stack.out("", finish="abort", message="KV pool broke", status="INTERNAL"))
    with recording() as exporter:
        r = await stack.client.post(CHAT, json=chat(stack, stream=True))
        assert r.status_code == 200 and b'"KV pool broke"' in r.content
        spans = await _spans(exporter, 2)
    assert spans["sse stream"].status.description == "the stream reported an error event"
    assert spans["POST /v1/chat/completions"].status.status_code == StatusCode.ERROR


async def test_a_client_gone_mid_stream_ends_both_spans_with_the_error_status(stack):
    stack.fake.reset(stack.out("one"), stack.Hang())
    with recording() as exporter:
        async with httpx.AsyncClient(base_url=stack.client.base_url) as c:
            async with c.stream("POST", CHAT, json=chat(stack, stream=True)) as r:
                async for _ in r.aiter_lines():
                    break
        spans = await _spans(exporter, 2)
    assert spans["sse stream"].status.description == \
        "the stream ended before its last event (the client went away)"
    assert spans["POST /v1/chat/completions"].status.status_code == StatusCode.ERROR


async def test_probes_are_not_traced(stack, quick_probe):
    stack.fake.reset(stack.Hang())
    with recording() as exporter:
        assert (await stack.client.get("/health")).status_code == 200
        assert (await stack.client.get("/metrics")).status_code == 200
        assert (await quick_probe.get("/health_generate")).status_code == 503  # the fake never answers
        await asyncio.sleep(0.05)
        assert exporter.get_finished_spans() == ()
    # The generation probe's call tells the tokenizer not to trace it either.
    assert stack.fake.metadata[-1]["traceparent"].endswith("-00")


async def test_off_no_span_and_no_trace_metadata(stack, monkeypatch):
    assert tracing.tracer is None
    stack.fake.reset(stack.out("ok", finish="stop"))
    seen: list[request_context.RequestContext | None] = []
    original = request_context.adopt

    def spy(body_rid, attributes):
        seen.append(request_context.current())
        return original(body_rid, attributes)

    monkeypatch.setattr(request_context, "adopt", spy)
    r = await stack.client.post(CHAT, json=chat(stack), headers={"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"})
    assert r.status_code == 200
    assert len(seen) == 1 and seen[0] is not None and seen[0].span is None
    assert "traceparent" not in stack.fake.metadata[-1]
    assert orjson.loads(r.content)["id"] == f"chatcmpl-{r.headers['x-request-id']}"
