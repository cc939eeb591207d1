"""The gateway's limits on the JSON and grammars a request carries inside it (against the
scripted fake tokenizer): every such field follows ``ringserve.limits`` (256 KiB, 32 levels)
and is refused naming the field before anything is sent.
"""

from __future__ import annotations

import json

import pytest

from ringserve.limits import MAX_JSON_BYTES
from tests.helpers.gateway_requests import MSG, assert_error, body_for, call

pytestmark = pytest.mark.asyncio(loop_scope="session")

DEEP = "nests deeper than 32 levels of objects and arrays, the limit for JSON inside a request"
LARGE = "larger than 262144 bytes (256 KiB), the limit for JSON and grammars inside a request"


def nested(depth: int) -> dict:
    """``{"a": {"a": ... {}}}``: ``depth`` levels of objects."""
    value: dict = {}
    for _ in range(depth - 1):
        value = {"a": value}
    return value


def deep_text(depth: int) -> str:
    return '{"a": ' * (depth - 1) + "{}" + "}" * (depth - 1)


def tool(parameters: dict) -> dict:
    return {"type": "function", "function": {"name": "f", "parameters": parameters}}


# (path, body overrides, param, message) for documents over a limit; each must be refused
# before anything reaches the tokenizer.
OVER = [
    ("/v1/chat/completions", {"chat_template_kwargs": {"x": nested(600)}}, "chat_template_kwargs",
     f"chat_template_kwargs: {DEEP}"),
    ("/v1/chat/completions", {"tools": [tool(nested(600))]}, "tools", f"tools: {DEEP}"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                                          "schema": nested(600)}}},
     "response_format", f"response_format.json_schema.schema: {DEEP}"),
    ("/v1/chat/completions", {"structured_outputs": {"json": deep_text(10_000)}}, "structured_outputs.json",
     f"structured_outputs.json: {DEEP}"),
    ("/v1/completions", {"structured_outputs": {"json": nested(33)}}, "structured_outputs.json",
     f"structured_outputs.json: {DEEP}"),
    ("/v1/chat/completions", {"messages": [*MSG, call(deep_text(40))]}, "messages",
     f"messages[1].tool_calls[0].function.arguments: {DEEP}"),
    ("/v1/chat/completions", {"structured_outputs": {"regex": "a" * (MAX_JSON_BYTES + 1)}},
     "structured_outputs.regex", f"structured_outputs.regex: {LARGE}"),
    ("/v1/completions", {"structured_outputs": {"choice": ["ab"] * 70_000}}, "structured_outputs.choice",
     f"structured_outputs.choice: {LARGE}"),
    ("/v1/chat/completions", {"chat_template_kwargs": {"x": "a" * MAX_JSON_BYTES}}, "chat_template_kwargs",
     f"chat_template_kwargs: {LARGE}"),
    ("/generate", {"json_schema": deep_text(10_000)}, "json_schema", f"json_schema: {DEEP}"),
    ("/generate", {"sampling_params": {"max_new_tokens": 2, "ebnf": "root ::= " + '"a" ' * 70_000}},
     "sampling_params.ebnf", f"sampling_params.ebnf: {LARGE}"),
    # The tool-call schema a forced call builds puts each tool's parameters two levels deeper.
    ("/v1/chat/completions", {"tools": [tool(nested(29)), {**tool({}), "function": {"name": "g"}}],
                              "tool_choice": "required"},
     "tool_choice", f"the tool-call schema built from tools: {DEEP}"),
]


@pytest.mark.parametrize("path,override,param,message", OVER, ids=[o[3].split(":")[0] for o in OVER])
async def test_documents_over_the_limits_are_refused_naming_the_field(stack, path, override, param, message):
    stack.fake.reset(stack.out("never", finish="stop"))
    r = await stack.client.post(path, json=body_for(path, override))
    err = assert_error(r, 400, param, "invalid_value")
    assert err["message"] == message
    assert stack.fake.requests == [], "nothing may be sent to the tokenizer"


async def test_documents_at_the_limits_are_sent_as_they_are(stack):
    """32 levels and a text of exactly 256 KiB pass, and reach the tokenizer unchanged."""
    kwargs = {"x": nested(31), "pad": ""}
    kwargs["pad"] = "p" * (MAX_JSON_BYTES - len(json.dumps(kwargs)))
    tools = [tool(nested(29))]
    stack.fake.reset(stack.out("ok", finish="stop"))
    body = body_for("/v1/chat/completions", {"chat_template_kwargs": kwargs, "tools": tools,
                                             "messages": [*MSG, call(deep_text(32))]})
    r = await stack.client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    chat = stack.fake.requests[0].chat
    assert len(chat.chat_template_kwargs_json) == MAX_JSON_BYTES
    assert json.loads(chat.chat_template_kwargs_json) == kwargs
    assert json.loads(chat.tools_json)[0]["function"]["parameters"] == nested(29)
    assert chat.messages[1].tool_calls[0].function_arguments == deep_text(32)


async def test_a_body_too_deep_to_parse_is_a_400(stack):
    depth = 10_000
    raw = '{"model": "smol", "messages": [{"role": "user", "content": "hi"}], "stop": ' + "[" * depth + "]" * depth
    r = await stack.client.post("/v1/chat/completions", content=raw + "}", headers={"content-type": "application/json"})
    err = assert_error(r, 400, None, "invalid_json")
    assert err["message"] == ("the request body nests too deeply to parse; JSON inside a request may nest at most "
                              "32 levels")
