"""POST /v1/responses, the output side: the exact event sequence of a streamed text answer, a
streamed tool call and a reasoning answer (qwen3 parser), each streamed response's final
object equal to the non-streamed one, usage exact, an error or an abort after the start as
response.failed, a length cut as response.incomplete, a disconnect cancelling the call, and
the openai SDK parsing what is sent."""

from __future__ import annotations

import asyncio

import grpc
import openai
import pytest

from tests.helpers.responses_events import RESPONSES, WEATHER, events, normalized

WEATHER_CALL = ['[{"name": "get_weather", "arguments": {"ci', 'ty": "Paris"}}]']


async def _both(stack, body: dict, *steps) -> tuple[list[dict], dict]:
    """(the stream's events, the non-streamed body) of ``body`` over the same script; the
    stream's final response equals the body (ids and times aside)."""
    stack.fake.reset(*steps)
    r = await stack.client.post(RESPONSES, json={"model": stack.model, **body, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.text
    streamed = events(r.text)
    stack.fake.reset(*steps)
    r = await stack.client.post(RESPONSES, json={"model": stack.model, **body})
    assert r.status_code == 200 and r.headers["content-type"] == "application/json", r.text
    whole = r.json()
    assert normalized(streamed[-1]["response"]) == normalized(whole)
    return streamed, whole


def _types(evs: list[dict]) -> list[str]:
    return [e["type"].removeprefix("response.") for e in evs]


def _usage(prompt: int, cached: int, output: int, reasoning: int = 0) -> dict:
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": output, "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": prompt + output}


async def test_a_streamed_text_answer(stack):
    out = stack.out
    evs, whole = await _both(stack, {"input": "hi", "metadata": {"k": "v"}},
                             out("Hel"), out("lo", completion=2), out("", finish="stop", completion=2))
    assert _types(evs) == ["created", "in_progress", "output_item.added", "content_part.added", "output_text.delta",
                           "output_text.delta", "output_text.done", "content_part.done", "output_item.done",
                           "completed"]
    msg = evs[2]["item"]["id"]
    assert msg.startswith("msg_")
    where = {"item_id": msg, "output_index": 0, "content_index": 0}
    assert evs[2] == {"type": "response.output_item.added", "sequence_number": 2, "output_index": 0,
                      "item": {"id": msg, "type": "message", "role": "assistant", "status": "in_progress",
                               "content": []}}
    part = {"type": "output_text", "annotations": [], "logprobs": []}
    assert evs[3] == {"type": "response.content_part.added", "sequence_number": 3, **where, "part": part | {"text": ""}}
    assert [e["delta"] for e in evs[4:6]] == ["Hel", "lo"]
    assert evs[4] == {"type": "response.output_text.delta", "sequence_number": 4, **where, "delta": "Hel",
                      "logprobs": []}
    assert evs[6] == {"type": "response.output_text.done", "sequence_number": 6, **where, "text": "Hello",
                      "logprobs": []}
    assert evs[7]["part"] == part | {"text": "Hello"}
    item = {"id": msg, "type": "message", "role": "assistant", "status": "completed",
            "content": [part | {"text": "Hello"}]}
    assert evs[8] == {"type": "response.output_item.done", "sequence_number": 8, "output_index": 0, "item": item}
    for e in evs[:2]:
        assert e["response"]["status"] == "in_progress" and e["response"]["output"] == []
        assert e["response"]["usage"] is None and e["response"]["id"] == evs[-1]["response"]["id"]
    final = evs[-1]["response"]
    assert final["id"].startswith("resp_") and final["object"] == "response" and final["status"] == "completed"
    assert final["output"] == [item] and final["usage"] == _usage(7, 3, 2)
    assert final["metadata"] == {"k": "v"} and final["incomplete_details"] is None and final["error"] is None
    assert isinstance(final["completed_at"], int) and final["completed_at"] >= final["created_at"]
    assert whole["usage"] == _usage(7, 3, 2)


async def test_a_streamed_forced_tool_call(stack):
    out = stack.out
    body = {"input": "Weather in Paris?", "tools": [WEATHER], "tool_choice": "required", "temperature": 0}
    evs, whole = await _both(stack, body, out(WEATHER_CALL[0], completion=5),
                             out(WEATHER_CALL[1], finish="stop", completion=9))
    assert _types(evs) == ["created", "in_progress", "output_item.added", "function_call_arguments.delta",
                           "function_call_arguments.delta", "function_call_arguments.done", "output_item.done",
                           "completed"]
    fc = evs[2]["item"]
    assert fc["id"].startswith("fc_") and fc["call_id"].startswith("call_") and fc["call_id"] != fc["id"]
    assert fc == {"id": fc["id"], "type": "function_call", "call_id": fc["call_id"], "name": "get_weather",
                  "arguments": "", "status": "in_progress"}
    where = {"item_id": fc["id"], "output_index": 0}
    assert [e["delta"] for e in evs[3:5]] == ['{"ci', 'ty": "Paris"}']
    assert evs[3] == {"type": "response.function_call_arguments.delta", "sequence_number": 3, **where,
                      "delta": '{"ci'}
    assert evs[5] == {"type": "response.function_call_arguments.done", "sequence_number": 5, **where,
                      "name": "get_weather", "arguments": '{"city": "Paris"}'}
    done = fc | {"arguments": '{"city": "Paris"}', "status": "completed"}
    assert evs[6]["item"] == done and evs[-1]["response"]["output"] == [done]
    assert whole["status"] == "completed" and whole["usage"] == _usage(7, 3, 9)
    assert whole["tool_choice"] == "required" and whole["temperature"] == 0
    assert whole["tools"] == [WEATHER | {"strict": True}]


async def test_text_then_a_model_written_call_are_two_items(stack):
    out = stack.out
    text = 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
    steps = [out(text[:12]), out(text[12:40], completion=2), out(text[40:], finish="stop", completion=3)]
    evs, whole = await _both(stack, {"input": "hi", "tools": [WEATHER]}, *steps)
    assert [(i["type"], i["status"]) for i in whole["output"]] == [("message", "completed"),
                                                                     ("function_call", "completed")]
    assert whole["output"][0]["content"][0]["text"] == "Sure.\n\n"  # all the content, as chat's content is
    assert whole["output"][1]["arguments"] == '{"city": "Oslo"}'
    assert _types(evs)[-6:] == ["output_text.done", "content_part.done", "output_item.done",
                                "function_call_arguments.done", "output_item.done", "completed"]


async def test_blanks_beside_a_call_are_no_message_but_an_empty_answer_is_one(stack):
    out = stack.out
    call = '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
    _, whole = await _both(stack, {"input": "hi", "tools": [WEATHER]}, out(call, finish="stop"))
    assert [i["type"] for i in whole["output"]] == ["function_call"]
    evs, whole = await _both(stack, {"input": "hi"}, out("", finish="stop", completion=0))
    assert whole["output"][0]["content"] == [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]
    assert "output_text.delta" not in _types(evs)


async def test_a_reasoning_answer(qwen3_no_store):
    stack = qwen3_no_store
    out = stack.out
    steps = [out("<think>"), out("Let me", completion=2), out(" think.", completion=3), out("</think>", completion=4),
             out("\n\nHi", completion=5), out(" there", finish="stop", completion=6)]
    evs, whole = await _both(stack, {"input": "hi"}, *steps)
    assert _types(evs) == [
        "created", "in_progress",
        "output_item.added", "content_part.added", "reasoning_text.delta", "reasoning_text.delta",
        "reasoning_text.done", "content_part.done", "output_item.done",
        "output_item.added", "content_part.added", "output_text.delta", "output_text.delta",
        "output_text.done", "content_part.done", "output_item.done",
        "completed"]
    rs = evs[2]["item"]["id"]
    assert rs.startswith("rs_")
    assert evs[2]["item"] == {"id": rs, "type": "reasoning", "summary": [], "content": [], "status": "in_progress"}
    assert evs[3]["part"] == {"type": "reasoning_text", "text": ""}
    assert evs[4] == {"type": "response.reasoning_text.delta", "sequence_number": 4, "item_id": rs, "output_index": 0,
                      "content_index": 0, "delta": "Let me"}
    assert evs[6] == {"type": "response.reasoning_text.done", "sequence_number": 6, "item_id": rs, "output_index": 0,
                      "content_index": 0, "text": "Let me think."}
    assert evs[9]["output_index"] == 1
    reasoning = {"id": rs, "type": "reasoning", "summary": [],
                 "content": [{"type": "reasoning_text", "text": "Let me think."}], "status": "completed"}
    assert whole["output"][0] == reasoning | {"id": whole["output"][0]["id"]}
    assert whole["output"][1]["content"][0]["text"] == "\n\nHi there"
    assert whole["usage"] == _usage(7, 3, 6, reasoning=4)  # <think>, two pieces, </think>


async def test_output_cut_by_length_is_incomplete(qwen3_no_store):
    stack = qwen3_no_store
    out = stack.out
    steps = [out("<think>"), out("Still", completion=2), out(" thinking", finish="length", completion=3)]
    evs, whole = await _both(stack, {"input": "hi", "max_output_tokens": 3}, *steps)
    assert evs[-1]["type"] == "response.incomplete"
    assert whole["status"] == "incomplete" and whole["incomplete_details"] == {"reason": "max_output_tokens"}
    assert whole["completed_at"] is None and whole["max_output_tokens"] == 3
    assert [(i["type"], i["status"]) for i in whole["output"]] == [("reasoning", "incomplete")]
    assert whole["usage"] == _usage(7, 3, 3, reasoning=3)


async def test_an_error_after_the_start_is_response_failed(stack):
    stack.fake.reset(stack.out("Hel"), stack.Fail(grpc.StatusCode.UNAVAILABLE, "replica lost"))
    r = await stack.client.post(RESPONSES, json={"model": stack.model, "input": "hi", "stream": True})
    evs = events(r.text)
    assert _types(evs) == ["created", "in_progress", "output_item.added", "content_part.added", "output_text.delta",
                           "failed"]
    failed = evs[-1]["response"]
    assert failed["status"] == "failed" and failed["error"] == {"code": "server_error", "message": "replica lost"}
    stack.fake.reset(stack.out("Hel"), stack.Fail(grpc.StatusCode.UNAVAILABLE, "replica lost"))
    r = await stack.client.post(RESPONSES, json={"model": stack.model, "input": "hi"})
    assert r.status_code == 503 and r.json()["error"]["message"] == "replica lost"


async def test_an_operator_abort_fails_the_response(stack):
    _, whole = await _both(stack, {"input": "hi"}, stack.out("Hel"), stack.out("", finish="abort"))
    assert whole["status"] == "failed" and whole["error"] == {"code": "server_error",
                                                              "message": "the request was aborted"}


async def test_a_disconnect_cancels_the_call(stack):
    stack.fake.reset(stack.out("Hel"), stack.Hang())
    async with stack.client.stream("POST", RESPONSES, json={"model": stack.model, "input": "hi",
                                                           "stream": True}) as r:
        async for chunk in r.aiter_text():
            if "output_text.delta" in chunk:
                break
    await asyncio.wait_for(stack.fake.cancelled.wait(), 5)
    stack.fake.reset(stack.Hang())
    with pytest.raises(Exception):  # noqa: B017, PT011 (the client's own timeout, whatever its type)
        await stack.client.post(RESPONSES, json={"model": stack.model, "input": "hi"}, timeout=0.5)
    await asyncio.wait_for(stack.fake.cancelled.wait(), 5)


async def test_the_openai_sdk_reads_the_responses(stack):
    sdk = openai.AsyncOpenAI(base_url=f"{stack.client.base_url}/v1", api_key="none", max_retries=0)
    stack.fake.reset(stack.out("Hel"), stack.out("lo", finish="stop", completion=2))
    response = await sdk.responses.create(model=stack.model, input="hi", instructions="Be brief.")
    assert response.output_text == "Hello" and response.status == "completed"
    assert response.usage is not None and response.usage.input_tokens_details.cached_tokens == 3
    stack.fake.reset(stack.out(WEATHER_CALL[0]), stack.out(WEATHER_CALL[1], finish="stop", completion=2))
    async with sdk.responses.stream(model=stack.model, input="hi", tools=[WEATHER],  # type: ignore[list-item]
                                    tool_choice={"type": "function", "name": "get_weather"}) as stream:
        seen = [event.type async for event in stream]
        final = await stream.get_final_response()
    assert seen[0] == "response.created" and seen[-1] == "response.completed"
    call = final.output[0]
    assert call.type == "function_call" and call.name == "get_weather" and call.arguments == '{"city": "Paris"}'
    await sdk.close()
