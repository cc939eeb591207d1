"""POST /v1/responses, the request side: a Responses request becomes the GenerateReqInput the
equivalent chat request makes (the same messages, tools JSON and constraint), its own fields
(priority) are passed on, and every field this server cannot honour is a 400 naming it
before anything is sent to the tokenizer."""

from __future__ import annotations

import grpc
import pytest
from google.protobuf.json_format import MessageToDict

from services.gateway.responses_convert import ITEMS, chat_messages
from tests.helpers.gateway_requests import assert_error
from tests.helpers.responses_events import RESPONSES, WEATHER

CHAT = "/v1/chat/completions"
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def _sent(fake) -> dict:
    sent = MessageToDict(fake.requests[-1])
    del sent["rid"]
    return sent


async def _same_as_chat(stack, responses_body: dict, chat_body: dict) -> dict:
    """Both requests answered 200 and sent the same GenerateReqInput (rid aside)."""
    stack.fake.reset(stack.out("ok", finish="stop"))
    r = await stack.client.post(RESPONSES, json={"model": stack.model, **responses_body})
    assert r.status_code == 200, r.text
    responses_sent = _sent(stack.fake)
    stack.fake.reset(stack.out("ok", finish="stop"))
    r = await stack.client.post(CHAT, json={"model": stack.model, "stream": True, **chat_body})
    assert r.status_code == 200, r.text
    assert responses_sent == _sent(stack.fake)
    return responses_sent


async def test_a_conversation_of_items_is_the_chat_request_it_means(stack):
    items = [
        {"role": "developer", "content": [{"type": "input_text", "text": "Answer briefly."}]},
        {"type": "message", "role": "user", "content": "Weather in Paris?"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Look."}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Checking.", "annotations": [], "logprobs": []}]},
        {"type": "function_call", "id": "fc_1", "call_id": "call_a", "name": "get_weather",
         "arguments": '{"city": "Paris"}', "status": "completed"},
        {"type": "function_call", "call_id": "call_b", "name": "get_weather", "arguments": '{"city": "Lyon"}'},
        {"type": "function_call_output", "call_id": "call_a", "output": "18C"},
        {"type": "function_call_output", "call_id": "call_b", "output": [{"type": "input_text", "text": "20C"}]},
        {"role": "user", "content": "Thanks"},
    ]
    messages = [
        {"role": "system", "content": "Be kind."},
        {"role": "developer", "content": [{"type": "text", "text": "Answer briefly."}]},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Checking."}], "reasoning_content": "Look.",
         "tool_calls": [{"id": c, "type": "function", "function": {"name": "get_weather", "arguments": a}}
                        for c, a in (("call_a", '{"city": "Paris"}'), ("call_b", '{"city": "Lyon"}'))]},
        {"role": "tool", "tool_call_id": "call_a", "content": "18C"},
        {"role": "tool", "tool_call_id": "call_b", "content": [{"type": "text", "text": "20C"}]},
        {"role": "user", "content": "Thanks"},
    ]
    chat_tool = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"} | {"strict": True}}
    sent = await _same_as_chat(
        stack,
        {"instructions": "Be kind.", "input": items, "tools": [WEATHER], "max_output_tokens": 9,
         "temperature": 0.5, "top_p": 0.9, "user": "u1"},
        {"messages": messages, "tools": [chat_tool], "max_completion_tokens": 9, "temperature": 0.5, "top_p": 0.9,
         "user": "u1"},
    )
    assert [m["role"] for m in sent["chat"]["messages"]] == ["system", "developer", "user", "assistant", "tool",
                                                             "tool", "user"]
    assert sent["samplingParams"] == {"maxNewTokens": 9, "temperature": 0.5, "topP": 0.9}
    assert sent["stream"] is True  # the tokenizer streams every response (see responses_output)


def test_reasoning_goes_to_the_assistant_turn_after_it():
    items = ITEMS.validate_python([
        {"role": "user", "content": "q"}, {"role": "assistant", "content": "Checking."},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Call it."}]},
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "Unused."}]},
    ])
    messages = chat_messages(items, None)
    assert [(m.role, m.reasoning_content, len(m.tool_calls or ())) for m in messages] == [
        ("user", None, 0), ("assistant", "Call it.", 1)]  # the last one has no turn after it: dropped


async def test_a_string_input_is_one_user_message(stack):
    await _same_as_chat(stack, {"input": "hi"}, {"messages": [{"role": "user", "content": "hi"}]})


@pytest.mark.parametrize(("choice", "chat_choice"), [
    ("required", "required"),
    ({"type": "function", "name": "get_weather"}, {"type": "function", "function": {"name": "get_weather"}}),
    ("none", "none"),
])
async def test_tool_choice_is_chat_s(stack, choice, chat_choice):
    chat_tool = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"} | {"strict": True}}
    sent = await _same_as_chat(
        stack, {"input": "hi", "tools": [WEATHER], "tool_choice": choice, "parallel_tool_calls": False},
        {"messages": [{"role": "user", "content": "hi"}], "tools": [chat_tool], "tool_choice": chat_choice,
         "parallel_tool_calls": False})
    if choice == "none":
        assert "toolsJson" not in sent["chat"] and "constraint" not in sent["samplingParams"]
    else:
        assert sent["samplingParams"]["constraint"]["param"] == "tool_choice"
        assert '"maxItems": 1' in sent["samplingParams"]["constraint"]["jsonSchema"]  # parallel_tool_calls false


async def test_text_format_is_the_output_constraint(stack):
    stack.fake.reset(stack.out('{"a": 1}', finish="stop"))
    fmt = {"type": "json_schema", "name": "thing", "schema": SCHEMA, "strict": True}
    r = await stack.client.post(RESPONSES, json={"model": stack.model, "input": "hi", "text": {"format": fmt}})
    assert r.status_code == 200, r.text
    c = stack.fake.requests[0].sampling_params.constraint
    assert c.param == "text.format"  # what a later error about the schema names
    assert c.json_schema == '{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], ' \
                            '"additionalProperties": false}'  # strict closes the object, as in chat
    assert r.json()["text"] == {"format": fmt}
    stack.fake.reset(stack.out("{}", finish="stop"))
    r = await stack.client.post(RESPONSES, json={"model": stack.model, "input": "hi",
                                                 "text": {"format": {"type": "json_object"}}})
    assert r.status_code == 200 and stack.fake.requests[0].sampling_params.constraint.json_object


async def test_priority_is_passed_on(stack):
    for given, sent in ((-3, -3), (None, 0)):
        stack.fake.reset(stack.out("ok", finish="stop"))
        body = {"model": stack.model, "input": "hi"} | ({"priority": given} if given is not None else {})
        assert (await stack.client.post(RESPONSES, json=body)).status_code == 200
        assert stack.fake.requests[0].priority == sent


REFUSED = [
    ({"background": True}, "background", "unsupported_parameter"),
    ({"include": ["reasoning.encrypted_content"]}, "include", "unsupported_parameter"),
    ({"truncation": "auto"}, "truncation", "unsupported_parameter"),
    ({"conversation": "conv_1"}, "conversation", "unsupported_parameter"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt", "unsupported_parameter"),
    ({"top_logprobs": 2}, "top_logprobs", "unsupported_parameter"),
    ({"prompt_cache_key": "k"}, "prompt_cache_key", "unsupported_parameter"),
    ({"max_tool_calls": 1}, "max_tool_calls", "unsupported_parameter"),
    ({"service_tier": "flex"}, "service_tier", "unsupported_parameter"),
    ({"reasoning": {"effort": "low"}}, "reasoning", "unsupported_parameter"),
    ({"text": {"verbosity": "low"}}, "text", "unsupported_parameter"),
    ({"stream": True, "stream_options": {"include_obfuscation": True}}, "stream_options", "unsupported_parameter"),
    ({"stream": False, "stream_options": {"include_obfuscation": False}}, "stream_options", "invalid_value"),
    ({"tools": [{"type": "web_search"}]}, "tools", "invalid_type"),
    ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice", "invalid_type"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input", "invalid_type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]}, "input", "invalid_value"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input", "invalid_value"),
    ({"input": []}, "input", "invalid_value"),
    ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "abc"}]}, "input", "invalid_value"),
    ({"seed": 1}, "seed", "unknown_parameter"),
    ({"temperature": 3}, "temperature", "invalid_value"),
    ({"max_output_tokens": 0}, "max_output_tokens", "invalid_value"),
    ({"metadata": {"k": "v" * 513}}, "metadata", "invalid_value"),
    ({"tool_choice": "required"}, "tool_choice", "invalid_value"),  # no tools
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice", "invalid_value"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text", "invalid_value"),
    ({"text": {"format": {"type": "text", "schema": {}}}}, "text", "invalid_value"),
    ({"previous_response_id": "resp_unknown"}, "previous_response_id", "response_not_found"),
]


@pytest.mark.parametrize(("extra", "param", "code"), REFUSED, ids=[r[1] + str(i) for i, r in enumerate(REFUSED)])
async def test_a_field_that_cannot_be_honoured_is_a_400_naming_it(stack, extra, param, code):
    stack.fake.reset(stack.out("never", finish="stop"))
    for stream in (False, True):  # a stream is refused before its first byte, as JSON
        r = await stack.client.post(RESPONSES, json={"model": stack.model, "input": "hi", "stream": stream, **extra})
        status = 404 if code == "response_not_found" else 400
        err = assert_error(r, status, param, code, "not_found_error" if status == 404 else "invalid_request_error")
        assert "response_format" not in err["message"] and "messages" not in err["message"], err  # chat's names
    assert stack.fake.requests == []


async def test_a_json_schema_format_without_its_schema_names_text_format(stack):
    r = await stack.client.post(RESPONSES, json={"model": stack.model, "input": "hi",
                                                 "text": {"format": {"type": "json_schema", "name": "x"}}})
    assert assert_error(r, 400, "text", "invalid_value")["message"] == "text.format.schema is required"


async def test_with_the_store_off_store_and_previous_response_id_are_refused(qwen3_no_store):
    stack = qwen3_no_store
    for extra, param in (({"store": True}, "store"), ({"previous_response_id": "resp_1"}, "previous_response_id")):
        r = await stack.client.post(RESPONSES, json={"model": stack.model, "input": "hi", **extra})
        assert "--responses-store-max 0" in assert_error(r, 400, param, "unsupported_parameter")["message"]
    stack.fake.reset(stack.out("ok", finish="stop"))
    r = await stack.client.post(RESPONSES, json={"model": stack.model, "input": "hi"})
    assert r.status_code == 200 and r.json()["store"] is False  # store left out: served, not stored


async def test_a_tokenizer_error_names_the_responses_field(stack):
    stack.fake.reset(stack.Fail(grpc.StatusCode.INVALID_ARGUMENT, "messages: the prompt is too long",
                                (("param", "messages"), ("code", "context_length_exceeded"))))
    r = await stack.client.post(RESPONSES, json={"model": stack.model, "input": "hi"})
    err = assert_error(r, 400, "input", "context_length_exceeded")
    assert err["message"] == "input: the prompt is too long"


async def test_an_unknown_model_is_a_404(stack):
    r = await stack.client.post(RESPONSES, json={"model": "gpt-9", "input": "hi"})
    assert_error(r, 404, "model", "model_not_found")
