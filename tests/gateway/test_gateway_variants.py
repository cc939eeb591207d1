"""A key that belongs to another variant of a tagged union is refused, not ignored (against the
scripted fake tokenizer): ``response_format``'s ``json_schema`` off type ``json_schema``, and
the role-specific keys of a chat message on another role.
"""

from __future__ import annotations

import pytest

from tests.helpers.gateway_requests import MSG, assert_error, body_for, call

pytestmark = pytest.mark.asyncio(loop_scope="session")


# (body overrides, message) for keys that belong to another variant of a tagged union.
OTHER_VARIANT = [
    ({"response_format": {"type": "text", "json_schema": {"name": "x", "schema": {"type": "object"}}}},
     "Invalid 'response_format': json_schema is only allowed with type 'json_schema', got type 'text'"),
    ({"response_format": {"type": "json_object", "json_schema": {"name": "x", "schema": {}}}},
     "Invalid 'response_format': json_schema is only allowed with type 'json_schema', got type 'json_object'"),
    ({"messages": [{"role": "user", "content": "hi", "tool_call_id": "c1"}]},
     "Invalid 'messages[0]': tool_call_id is only allowed with role 'tool', got role 'user'"),
    ({"messages": [{"role": "system", "content": "s", "reasoning_content": "r",
                    "tool_calls": [{"id": "c1", "function": {"name": "f"}}]}, *MSG]},
     "Invalid 'messages[0]': tool_calls is only allowed with role 'assistant'; reasoning_content is only "
     "allowed with role 'assistant', got role 'system'"),
]


@pytest.mark.parametrize("override,message", OTHER_VARIANT, ids=["text", "json_object", "user", "system"])
async def test_a_key_of_another_variant_is_refused_not_ignored(stack, override, message):
    stack.fake.reset(stack.out("never", finish="stop"))
    r = await stack.client.post("/v1/chat/completions", json=body_for("/v1/chat/completions", override))
    err = assert_error(r, 400, override and next(iter(override)), "invalid_value")
    assert err["message"] == message
    assert stack.fake.requests == []


async def test_the_owning_variant_keeps_its_keys_and_null_is_absent(stack):
    stack.fake.reset(stack.out("ok", finish="stop"))
    messages = [{"role": "user", "content": "hi", "tool_call_id": None, "tool_calls": None},
                {**call("{}"), "reasoning_content": "thought"},
                {"role": "tool", "content": "4", "tool_call_id": "c1"}, *MSG]
    body = body_for("/v1/chat/completions", {"messages": messages,
                                             "response_format": {"type": "text", "json_schema": None}})
    r = await stack.client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    chat = stack.fake.requests[0].chat
    assert [m.role for m in chat.messages] == ["user", "assistant", "tool", "user"]
    assert chat.messages[1].reasoning_content == "thought" and chat.messages[2].tool_call_id == "c1"
    assert not stack.fake.requests[0].sampling_params.HasField("constraint")
