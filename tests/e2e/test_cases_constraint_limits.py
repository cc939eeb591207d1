"""Grammar failures are errors, never a fail-open or a 500, and a cut call says it was cut:
through the default ring (``stack``) on SmolLM2 with llguidance.

The documented limits (1,000 choices, repetitions counting to 1,000) are refused by the
tokenizer before dispatch; a grammar past the engine's own limits at its first step is
refused at admission by the scheduler; one that fails later ends its own request with an
error (400 body, or an SSE error event after the text already sent). Each with a plain
stream running beside it, which finishes untouched, and the ring idle afterwards.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from services.tokenizer.constraints import choice_grammar
from tests.helpers.sse_reader import sse_events
from tests.helpers.structured import chat, chat_body, error_of

ROW_LIMIT = ("Parser Error: Current row has 2501 items; max is 2000; consider making your grammar left-recursive "
             "if it's right-recursive")
TOOL_W = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city", "days"]}}}
ALTERNATIVES = " | ".join(f'"o{i}"' for i in range(2500))  # one rule, 2,500 ways: past llguidance's 2,000


@pytest.fixture
async def client(stack):
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=120) as c:
        yield c


def _plain_stream(client: httpx.AsyncClient, model: str) -> asyncio.Future:
    return asyncio.ensure_future(client.post("/v1/chat/completions", json=chat_body(
        model, "Count from one to ten in words.", max_tokens=40, stream=True)))


async def _untouched(plain: asyncio.Future, ring) -> None:
    events = sse_events(await plain)
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    ring.wait_idle()


async def test_constraints_past_the_limits_are_a_400_naming_them(stack, client):
    model = stack.model_name
    cases = [
        ({"choice": [f"option {i}" for i in range(2000)]}, "structured_outputs.choice",
         "structured_outputs.choice: 2000 choices; at most 1000 are supported"),
        ({"regex": "a{300000}"}, "structured_outputs.regex", "structured_outputs.regex: the regex counts to 300000 "
         "(nested repetitions multiplied); at most 1000 is supported"),
        ({"regex": "a{1000000}"}, "structured_outputs.regex", "structured_outputs.regex: the regex counts to 1000000 "
         "(nested repetitions multiplied); at most 1000 is supported"),
        ({"grammar": choice_grammar([f"option number {i}" for i in range(2500)])}, "structured_outputs.grammar",
         "structured_outputs.grammar: the constraint cannot be used: the grammar fails at its first token: "
         + ROW_LIMIT),
    ]
    plain = _plain_stream(client, model)
    await asyncio.sleep(0.3)
    for constraint, param, message in cases:
        for stream in (False, True):
            error = await error_of(client, chat_body(model, "Hi", structured_outputs=constraint), stream)
            assert (error["type"], error["param"], error["message"]) == ("invalid_request_error", param, message)
    await _untouched(plain, stack)


async def test_a_grammar_failing_mid_output_ends_that_request_with_an_error(stack, client):
    model = stack.model_name
    # The first step ("x") passes; the fifth token enters the 2,500-way rule.
    grammar = f'root ::= "x" [0-9] [0-9] [0-9] " " ( {ALTERNATIVES} )'
    body = chat_body(model, "Hi", structured_outputs={"grammar": grammar})
    message = f"structured_outputs.grammar: the grammar engine failed at output token 5: {ROW_LIMIT}; " \
              "simplify the constraint"
    plain = _plain_stream(client, model)
    await asyncio.sleep(0.3)
    error = await error_of(client, body, stream=False)
    assert (error["type"], error["param"], error["message"]) == ("invalid_request_error",
                                                                  "structured_outputs.grammar", message)
    events = sse_events(await client.post("/v1/chat/completions", json={**body, "stream": True}))
    text = "".join(c["delta"].get("content") or "" for e in events[:-1] for c in e["choices"])
    assert text[:1] == "x" and len(text) <= 4 and text[1:].isdigit(), text
    assert events[-1] == {"error": {"message": message, "type": "invalid_request_error",
                                    "param": "structured_outputs.grammar", "code": "invalid_request"}}
    await _untouched(plain, stack)


async def test_a_forced_call_cut_by_max_tokens_finishes_length(stack, client):
    body = chat_body(stack.model_name, "What is the weather in Paris for the next 3 days?", tools=[TOOL_W],
                     tool_choice="required", max_tokens=20)
    (plain,), (streamed,) = await asyncio.gather(*(chat(client, body, stream) for stream in (False, True)))
    for msg in (plain, streamed):
        assert (msg.finish_reason, msg.content, msg.completion_tokens) == ("length", None, 20), msg
        assert [c["name"] for c in msg.tool_calls] == ["get_weather"]
    arguments = plain.tool_calls[0]["arguments"]
    assert arguments == streamed.tool_calls[0]["arguments"] and arguments.startswith("{")
    stack.wait_idle()
