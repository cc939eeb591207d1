"""``ringserve.limits`` and the tokenizer's gRPC API applying it (direct clients skip the gateway).

Depth 600 objects in the template kwargs or the tools and depth 10,000 as JSON text in a
constraint made the template and the schema checks recurse past Python's limit: a
RecursionError, gRPC UNKNOWN and a 3,000-line traceback. Now each is INVALID_ARGUMENT with
``param`` and the limit in the message, decided before anything is parsed.
"""

from __future__ import annotations

import json

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ringserve import limits
from ringserve.v1 import common_pb2, tokenizer_pb2
from services.tokenizer.chat import render_chat
from services.tokenizer.constraints import resolve_constraint
from services.tokenizer.errors import RequestError

DEEP = "nests deeper than 32 levels of objects and arrays, the limit for JSON inside a request"
LARGE = "larger than 262144 bytes (256 KiB), the limit for JSON and grammars inside a request"
USER = tokenizer_pb2.ChatMessage(role="user", content="hi")


def deep_text(depth: int) -> str:
    return '{"a": ' * (depth - 1) + "[]" + "}" * (depth - 1)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(alphabet='ab"\\[]{}, :\n', max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(alphabet='k"[]{}\\', max_size=3), inner,
                                                                max_size=3),
    max_leaves=12,
)


@settings(max_examples=60, deadline=None)
@given(value=json_values)
def test_text_depth_is_the_depth_of_the_value(value):
    """Brackets inside strings (keys too, escaped quotes included) never count."""
    assert limits.text_depth(json.dumps(value)) == limits.value_depth(value, stop_after=100)


def test_depth_counts_containers_and_malformed_text_counts_at_least_what_a_parser_reaches():
    assert [limits.value_depth(v) for v in (1, [], {"a": []}, [[{}], 1])] == [0, 1, 2, 3]
    assert [limits.text_depth(t) for t in ("1", "[]", '{"a": []}', '[[{}], 1]')] == [0, 1, 2, 3]
    assert limits.text_depth('{"a": "[[[", "b\\"[[": {}}') == 2
    assert limits.text_depth('"unterminated [[[[') == 4  # the unclosed string's brackets count: never fewer
    assert limits.value_depth(json.loads(deep_text(40))) == 33  # stops after the limit


def refused(render) -> RequestError:
    with pytest.raises(RequestError) as info:
        render()
    assert info.value.status == grpc.StatusCode.INVALID_ARGUMENT and info.value.code == "invalid_value"
    return info.value


@pytest.mark.parametrize("chat,param,message", [
    (tokenizer_pb2.ChatInput(messages=[USER], chat_template_kwargs_json=json.dumps({"x": json.loads(deep_text(600))})),
     "chat_template_kwargs", f"chat_template_kwargs: {DEEP}"),
    (tokenizer_pb2.ChatInput(messages=[USER], tools_json=deep_text(10_000)), "tools", f"tools: {DEEP}"),
    (tokenizer_pb2.ChatInput(messages=[USER], tools_json=json.dumps(["a" * limits.MAX_JSON_BYTES])), "tools",
     f"tools: {LARGE}"),
    (tokenizer_pb2.ChatInput(messages=[USER, tokenizer_pb2.ChatMessage(role="assistant", tool_calls=[
        tokenizer_pb2.ToolCall(id="c", function_name="f", function_arguments=deep_text(600))])]),
     "messages", f"messages[1].tool_calls[0].function_arguments: {DEEP}"),
], ids=["kwargs", "tools", "tools-size", "arguments"])
def test_chat_documents_over_the_limits_are_refused(smollm2_tokenizer, chat, param, message):
    error = refused(lambda: render_chat(smollm2_tokenizer, chat))
    assert (error.param, error.message) == (param, message)


@pytest.mark.parametrize("constraint,message", [
    (common_pb2.Constraint(json_schema=deep_text(10_000), param="response_format"), f"response_format: {DEEP}"),
    (common_pb2.Constraint(json_schema=deep_text(33)), f"response_format: {DEEP}"),
    (common_pb2.Constraint(regex="a" * (limits.MAX_JSON_BYTES + 1), param="regex"), f"regex: {LARGE}"),
    (common_pb2.Constraint(choice=common_pb2.ChoiceList(choices=["ab"] * 70_000), param="structured_outputs.choice"),
     f"structured_outputs.choice: {LARGE}"),
], ids=["schema-10000", "schema-33", "regex", "choice"])
def test_constraints_over_the_limits_are_refused(constraint, message):
    error = refused(lambda: resolve_constraint(constraint))
    assert (error.param, error.message) == (constraint.param or "response_format", message)


def test_a_schema_at_the_limit_is_accepted():
    schema = {"type": "object", "default": json.loads(deep_text(31))}
    assert limits.value_depth(schema) == 32
    out = resolve_constraint(common_pb2.Constraint(json_schema=json.dumps(schema), param="response_format"))
    assert json.loads(out.json_schema) == schema
