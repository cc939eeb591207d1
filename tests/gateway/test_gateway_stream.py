"""SSE framing, chunk schema, usage chunk and cancellation of the gateway (cases C06-C08)."""

from __future__ import annotations

import asyncio

import grpc
import httpx
import orjson
import pytest

pytestmark = pytest.mark.asyncio(loop_scope="session")

CHAT = "/v1/chat/completions"


def events(raw: bytes) -> list[bytes]:
    """Split an SSE body into event payloads, checking the exact framing on the way."""
    assert raw.endswith(b"data: [DONE]\n\n"), raw[-80:]
    parts = raw.split(b"\n\n")
    assert parts[-1] == b"", "nothing may follow [DONE]"
    payloads = []
    for part in parts[:-1]:
        assert part.startswith(b"data: ") and b"\n" not in part, part
        payloads.append(part[len(b"data: "):])
    assert payloads.count(b"[DONE]") == 1
    return payloads


def chunks(raw: bytes) -> list[dict]:
    return [orjson.loads(p) for p in events(raw)[:-1]]


async def test_chat_stream_framing_and_schema(stack):
    o = stack.out
    stack.fake.reset(
        o("Hel", completion=1), o("", completion=2), o("lo", completion=3),
        o("!", finish="stop", completion=4, matched_str="\n"))
    body = {"model": stack.model, "stream": True, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 9}
    r = await stack.client.post(CHAT, json=body)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    got = chunks(r.content)
    # The empty delta that finishes nothing is not sent.
    assert len(got) == 3
    rid = stack.fake.requests[0].rid
    for c in got:
        assert c["object"] == "chat.completion.chunk"
        assert c["id"] == f"chatcmpl-{rid}" and c["model"] == "smol"
        assert c["created"] == got[0]["created"] and c["system_fingerprint"] == got[0]["system_fingerprint"]
        assert c["usage"] is None
        assert len(c["choices"]) == 1 and c["choices"][0]["index"] == 0
        assert "finish_reason" in c["choices"][0]
    assert got[0]["choices"][0]["delta"] == {"role": "assistant", "content": "Hel"}
    assert [c["choices"][0]["finish_reason"] for c in got] == [None, None, "stop"]
    assert "role" not in got[1]["choices"][0]["delta"]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in got) == "Hello!"
    assert got[-1]["choices"][0]["matched_stop"] == "\n"


async def test_chat_stream_length_finish(stack):
    o = stack.out
    stack.fake.reset(*(o(str(i), completion=i) for i in range(1, 5)), o("5", finish="length", completion=5))
    body = {"model": stack.model, "stream": True, "max_tokens": 5,
            "messages": [{"role": "user", "content": "Count"}]}
    got = chunks((await stack.client.post(CHAT, json=body)).content)
    assert [c["choices"][0]["finish_reason"] for c in got] == [None] * 4 + ["length"]
    assert stack.fake.requests[0].sampling_params.max_new_tokens == 5


async def test_include_usage_n2(stack):
    o = stack.out
    stack.fake.reset(
        o("a", index=0, completion=1), o("b", index=1, completion=1),
        o("c", index=1, finish="stop", completion=2), o("d", index=0, finish="length", completion=3),
    )
    body = {"model": stack.model, "stream": True, "n": 2, "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": "hi"}]}
    got = chunks((await stack.client.post(CHAT, json=body)).content)
    content, last = got[:-1], got[-1]
    assert all(c["usage"] is None for c in content)
    assert [(c["choices"][0]["index"], c["choices"][0]["finish_reason"]) for c in content] == [
        (0, None), (1, None), (1, "stop"), (0, "length")]
    assert content[0]["choices"][0]["delta"]["role"] == "assistant"
    assert content[1]["choices"][0]["delta"]["role"] == "assistant"
    assert last["choices"] == [] and last["object"] == "chat.completion.chunk" and last["id"] == content[0]["id"]
    # prompt tokens once, completion summed over both choices
    assert last["usage"] == {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12,
                             "prompt_tokens_details": {"cached_tokens": 3}}
    assert stack.fake.requests[0].sampling_params.n == 2


async def test_completions_stream_batch_and_echo(stack):
    o = stack.out
    stack.fake.reset(o(" world", finish="stop", completion=2))
    body = {"model": stack.model, "stream": True, "prompt": ["Hello", "Bye"], "echo": True}
    got = chunks((await stack.client.post("/v1/completions", json=body)).content)
    assert {c["object"] for c in got} == {"text_completion"}
    texts = sorted((c["choices"][0]["index"], c["choices"][0]["text"]) for c in got)
    assert texts == [(0, "Hello world"), (1, "Bye world")]
    rids = sorted(r.rid for r in stack.fake.requests)
    assert rids[0].endswith("-0") and rids[1].endswith("-1")


async def test_native_generate_stream(stack):
    o = stack.out
    stack.fake.reset(o("x", completion=1), o("y", finish="length", completion=2))
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 2, "temperature": 0}, "stream": True, "rid": "n1"}
    got = chunks((await stack.client.post("/generate", json=body)).content)
    assert [g["text"] for g in got] == ["x", "y"]
    assert got[-1]["meta_info"]["finish_reason"] == {"type": "length", "matched": None, "length": 2}
    assert got[0]["meta_info"]["id"] == "n1"
    sp = stack.fake.requests[0].sampling_params
    assert sp.HasField("temperature") and sp.temperature == 0 and not sp.HasField("top_p")


async def test_mid_stream_error_is_one_event_then_done(stack):
    o = stack.out
    stack.fake.reset(o("partial"), stack.Fail(grpc.StatusCode.UNAVAILABLE, "scheduler went away"))
    body = {"model": stack.model, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    r = await stack.client.post(CHAT, json=body)
    assert r.status_code == 200
    payloads = events(r.content)
    assert len(payloads) == 3
    assert orjson.loads(payloads[0])["choices"][0]["delta"]["content"] == "partial"
    assert orjson.loads(payloads[1]) == {"error": {
        "message": "scheduler went away", "type": "service_unavailable_error", "param": None,
        "code": "service_unavailable"}}


async def test_abort_with_error_status_mid_stream(stack):
    o = stack.out
    stack.fake.reset(o("a"), o("", finish="abort", message="KV pool broke", status="INTERNAL"))
    body = {"model": stack.model, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    payloads = events((await stack.client.post(CHAT, json=body)).content)
    assert orjson.loads(payloads[-2])["error"]["type"] == "server_error"
    assert orjson.loads(payloads[-2])["error"]["message"] == "KV pool broke"


async def test_plain_abort_is_a_finish_reason(stack):
    o = stack.out
    stack.fake.reset(o("a"), o("", finish="abort", message="aborted by operator", status="CANCELLED"))
    body = {"model": stack.model, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    got = chunks((await stack.client.post(CHAT, json=body)).content)
    assert got[-1]["choices"][0]["finish_reason"] == "abort"


async def _wait_cancelled(fake) -> None:
    await asyncio.wait_for(fake.cancelled.wait(), timeout=3)


async def test_disconnect_mid_stream_cancels_the_call(stack):
    stack.fake.reset(stack.out("one"), stack.Hang())
    body = {"model": stack.model, "stream": True, "messages": [{"role": "user", "content": "long story"}]}
    async with httpx.AsyncClient(base_url=stack.client.base_url) as c:
        async with c.stream("POST", CHAT, json=body) as r:
            async for line in r.aiter_lines():
                assert line.startswith("data: ")
                break
    await _wait_cancelled(stack.fake)


@pytest.mark.parametrize("stream", [True, False])
async def test_disconnect_before_first_output_cancels_the_call(stack, stream):
    """A long prefill (stream) or a whole non-stream generation: nothing has been sent yet."""
    stack.fake.reset(stack.Hang())
    body = {"model": stack.model, "stream": stream, "messages": [{"role": "user", "content": "long story"}]}
    async with httpx.AsyncClient(base_url=stack.client.base_url) as c:
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(c.post(CHAT, json=body), timeout=0.5)
    await _wait_cancelled(stack.fake)
