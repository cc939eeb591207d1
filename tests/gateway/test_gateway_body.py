"""Request bodies at a bounded cost to the gateway's event loop (services/gateway/body.py),
in front of the fake tokenizer: the test shares the gateway's loop and measures its lag."""

from __future__ import annotations

import json

import orjson
import pytest

from tests.helpers.loop_lag import worst_lag_during

# The loop's work for 50,000 messages is ~50 ms of parsing (2.5 s on main, validating and
# converting them); the margin is for 2 cores shared with other work (0.257 s seen once, at
# nice 10 beside make test's ring tier and a benchmark).
LAG_BOUND_S = 0.5


def chat_body(stack, messages: list[dict]) -> bytes:
    return orjson.dumps({"model": stack.model, "max_tokens": 5, "messages": messages})


async def post(stack, path: str, raw: bytes):
    return await stack.client.post(path, content=raw, headers={"content-type": "application/json"})


@pytest.fixture(autouse=True)
async def warm_client(stack):
    """httpx imports its async backend on the first request, on this loop: not the gateway's lag."""
    await stack.client.get("/health")


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/tokenize"])
async def test_a_chat_of_50000_messages_is_refused_before_validation(stack, path):
    stack.fake.reset(stack.out("ok", finish="stop"))
    raw = chat_body(stack, [{"role": "user", "content": "hi"}] * 50_000)
    resp, lag = await worst_lag_during(post(stack, path, raw))
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"] == {
        "message": "Invalid 'messages': 50000 messages are more than the 2048 a request may hold",
        "type": "invalid_request_error", "param": "messages", "code": "invalid_value"}
    assert stack.fake.requests == [] and lag < LAG_BOUND_S, lag


async def test_messages_up_to_the_context_bound_are_served(stack):
    """The fake serves a 2048-token context: 2047 messages fit the bound, 2048 do not."""
    stack.fake.reset(stack.out("ok", finish="stop"))
    pair = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    resp, lag = await worst_lag_during(post(stack, "/v1/chat/completions", chat_body(stack, pair * 1023 + pair[:1])))
    assert resp.status_code == 200, resp.text
    assert len(stack.fake.requests[0].chat.messages) == 2047 and lag < LAG_BOUND_S, lag
    stack.fake.reset(stack.out("ok", finish="stop"))
    resp = await post(stack, "/v1/chat/completions", chat_body(stack, pair * 1024))
    assert resp.status_code == 400 and stack.fake.requests == []
    assert resp.json()["error"] == {
        "message": "This model's maximum context length is 2048 tokens. However, you sent 2048 messages, and more "
                   "than 2047 messages cannot fit (each takes at least one token). Please reduce the number of "
                   "messages.", "type": "invalid_request_error", "param": "messages", "code": "context_length_exceeded"}


async def test_a_15_mb_prompt_reaches_the_tokenizer_whole(stack):
    """The proto is built in place (a copy of this message costs ~80 ms of the loop); its lag with
    the tokenizer in another process is timed on the ring (tests/e2e/test_reliability_no_stall.py)."""
    stack.fake.reset(stack.out("ok", finish="stop"))
    content = "word " * 3_000_000
    resp = await post(stack, "/v1/chat/completions", chat_body(stack, [{"role": "user", "content": content}]))
    assert resp.status_code == 200, resp.text
    assert stack.fake.requests[0].chat.messages[0].content == content


async def parse(raw: bytes):
    from services.gateway.body import JsonRequest

    async def receive() -> dict:
        return {"type": "http.request", "body": raw, "more_body": False}

    return await JsonRequest({"type": "http", "method": "POST", "headers": []}, receive).json()


@pytest.mark.parametrize("raw", [
    b'{"a": 123456789012345678901234567890, "b": -9223372036854775809}',
    b'{"a": 1.1, "b": 1e-7, "c": 3.141592653589793238, "d": 1e400, "e": -0.0, "f": 5e-324}',
    b'{"a": NaN, "b": Infinity, "c": -Infinity}',
    b'{"a": "\\udfff"}',  # a lone surrogate: from_json refuses it, json.loads keeps it for the 400 naming it
    b'{"a": "\\ud83d\\ude00", "a": 2}',
    b'\xef\xbb\xbf{"a": 1}',
    b"[" * 300 + b"]" * 300,
])
async def test_parsing_gives_what_json_loads_gives(raw):
    assert repr(await parse(raw)) == repr(json.loads(raw))


@pytest.mark.parametrize("raw", [b'{"a": "x"} trailing', b'{"a": [1,2,]}', b'{"a": "\t"}'])
async def test_malformed_bodies_raise_json_loads_error(raw):
    with pytest.raises(json.JSONDecodeError) as ours:
        await parse(raw)
    with pytest.raises(json.JSONDecodeError) as theirs:
        json.loads(raw)
    assert (ours.value.msg, ours.value.pos) == (theirs.value.msg, theirs.value.pos)


def test_the_model_cards_character_bound():
    from ringserve.prompt_bounds import BoundExceeded
    from ringserve.v1 import tokenizer_pb2
    from services.gateway.backend import ModelCard

    info = tokenizer_pb2.ModelInfo(context_length=101, vocab_size=10, chars_per_token=3)
    bounds = ModelCard("m", "/m", 101, info).bounds
    bounds.check_tokenize(tokenizer_pb2.TokenizeRequest(text="x" * 300))
    with pytest.raises(BoundExceeded) as info_:
        bounds.check_generate(tokenizer_pb2.GenerateReqInput(text="x" * 301))
    assert (info_.value.param, info_.value.code, info_.value.message) == ("prompt", "context_length_exceeded", (
        "This model's maximum context length is 101 tokens. However, your prompt has 301 characters, and more than "
        "300 characters cannot fit (100 tokens of at most 3 characters each). Please reduce the length of the "
        "prompt."))
    assert ModelCard("m", "/m", 101, tokenizer_pb2.ModelInfo(context_length=101)).bounds.max_prompt_chars is None


async def test_a_client_that_leaves_mid_body_ends_the_route_quietly():
    """The server's body timeout (or the client) closes the connection while the route reads
    the body: the route ends without an exception (uvicorn would log its traceback) and the
    handler never runs."""
    from fastapi import FastAPI

    from services.gateway.body import BodyRoute

    app = FastAPI()
    app.router.route_class = BodyRoute
    handled: list[dict] = []

    @app.post("/echo")
    async def echo(body: dict) -> dict:
        handled.append(body)
        return body

    incoming = iter([{"type": "http.request", "body": b'{"a": ', "more_body": True}, {"type": "http.disconnect"}])

    async def receive() -> dict:
        return next(incoming)

    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/echo", "headers": [(b"content-type", b"application/json")],
             "query_string": b"", "http_version": "1.1", "scheme": "http", "server": ("127.0.0.1", 80),
             "client": ("127.0.0.1", 1), "root_path": ""}
    await app(scope, receive, send)
    assert handled == [] and sent[0] == {"type": "http.response.start", "status": 499, "headers": [
        (b"content-length", b"0")]}
