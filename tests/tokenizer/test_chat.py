"""Chat rendering with the real SmolLM2 template (ChatML)."""

from __future__ import annotations

import grpc
import orjson
import pytest

from ringserve.v1 import tokenizer_pb2
from services.tokenizer.chat import render_chat
from services.tokenizer.errors import RequestError
from services.tokenizer.model import load_tokenizer

DEFAULT_SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"


def msg(role: str, content: str | None = None, parts: list[tuple[str, str]] | None = None,
        **kw) -> tokenizer_pb2.ChatMessage:
    m = tokenizer_pb2.ChatMessage(role=role, **kw)
    if content is not None:
        m.content = content
    for type_, text in parts or []:
        m.content_parts.add(type=type_, text=text)
    return m


def chat(*messages: tokenizer_pb2.ChatMessage, **kw) -> tokenizer_pb2.ChatInput:
    return tokenizer_pb2.ChatInput(messages=messages, **kw)


def rejected(tokenizer, c: tokenizer_pb2.ChatInput) -> RequestError:
    with pytest.raises(RequestError) as info:
        render_chat(tokenizer, c)
    assert info.value.status == grpc.StatusCode.INVALID_ARGUMENT
    return info.value


def test_system_text_rendered_once_in_the_system_slot(smollm2_tokenizer):
    prompt = render_chat(
        smollm2_tokenizer,
        chat(msg("system", "Always answer in French."), msg("user", "What colour is the sky?")),
    )
    assert prompt == (
        "<|im_start|>system\nAlways answer in French.<|im_end|>\n"
        "<|im_start|>user\nWhat colour is the sky?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert prompt.count("Always answer in French.") == 1


def test_generation_prompt_is_added_by_default_and_can_be_turned_off(smollm2_tokenizer):
    with_prompt = render_chat(smollm2_tokenizer, chat(msg("user", "hi")))
    without = render_chat(smollm2_tokenizer, chat(msg("user", "hi"), add_generation_prompt=False))
    assert with_prompt == DEFAULT_SYSTEM + "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert without == DEFAULT_SYSTEM + "<|im_start|>user\nhi<|im_end|>\n"


@pytest.mark.parametrize("prefill", ["The capital of France is", "The capital of France is ", ""])
def test_continue_final_message_ends_with_the_prefill(smollm2_tokenizer, prefill):
    prompt = render_chat(
        smollm2_tokenizer,
        chat(
            msg("user", "Complete the sentence."),
            msg("assistant", prefill),
            add_generation_prompt=False,
            continue_final_message=True,
        ),
    )
    assert prompt == (DEFAULT_SYSTEM + "<|im_start|>user\nComplete the sentence.<|im_end|>\n<|im_start|>assistant\n"
                      + prefill)
    assert prompt.count("<|im_start|>assistant") == 1


def test_continue_final_message_conflicts_are_rejected(smollm2_tokenizer):
    both = rejected(
        smollm2_tokenizer,
        # add_generation_prompt defaults true
        chat(msg("user", "a"), msg("assistant", "b"), continue_final_message=True),
    )
    assert both.message.startswith("continue_final_message and add_generation_prompt cannot both be true")
    last_user = rejected(
        smollm2_tokenizer,
        chat(msg("user", "a"), add_generation_prompt=False, continue_final_message=True),
    )
    assert last_user.message == (
        "continue_final_message needs the last message to be from the assistant, but it is from 'user'"
    )
    assert last_user.param == "messages"


@pytest.mark.parametrize("role", ["system", "user", "assistant", "tool"])
def test_text_parts_give_the_string_forms_tokens(smollm2_tokenizer, role):
    extra = {"tool_call_id": "call_1"} if role == "tool" else {}
    parts = [("text", "What is 2+"), ("text", "2? Answer with one digit.")]
    joined = render_chat(smollm2_tokenizer, chat(msg("user", "q"), msg(role, parts=parts, **extra)))
    string = render_chat(
        smollm2_tokenizer, chat(msg("user", "q"), msg(role, "What is 2+2? Answer with one digit.", **extra))
    )
    single = render_chat(smollm2_tokenizer, chat(msg("user", "q"), msg(role, parts=[("text", "Hello there")], **extra)))
    single_str = render_chat(smollm2_tokenizer, chat(msg("user", "q"), msg(role, "Hello there", **extra)))
    assert joined == string
    assert single == single_str
    enc = smollm2_tokenizer.encode
    assert enc(joined, add_special_tokens=False) == enc(string, add_special_tokens=False)


def test_image_part_is_rejected(smollm2_tokenizer):
    err = rejected(
        smollm2_tokenizer,
        chat(msg("user", parts=[("text", "What is this?"), ("image_url", "http://x/cat.png")])),
    )
    assert err.message == ("messages[0].content[1] has type 'image_url': only text content parts are supported by "
                           "this model")
    assert (err.code, err.param) == ("unsupported_content_type", "messages")


@pytest.mark.parametrize(
    "messages, expected",
    [
        ([], "messages must contain at least one message"),
        ([msg("robot", "x")], "messages[0].role 'robot' is not one of assistant, developer, system, tool, user"),
        ([msg("user")], "messages[0] (user) has no content"),
        ([msg("user", "x"), msg("tool", "42")], "messages[1] (tool) needs tool_call_id"),
        ([msg("user", "x", parts=[("text", "y")])], "messages[0]: give either content or content parts, not both"),
    ],
)
def test_bad_messages_are_rejected(smollm2_tokenizer, messages, expected):
    assert rejected(smollm2_tokenizer, chat(*messages)).message == expected


@pytest.fixture(scope="module")
def probe_tokenizer(smollm2_dir):
    """SmolLM2's tokenizer with a template that prints what it is given."""
    tok = load_tokenizer(smollm2_dir)
    tok.chat_template = (
        "{% for m in messages %}{{ m.role }}:{{ m.content }}"
        "{% for c in m.tool_calls or [] %}"
        "[{{ c.id }} {{ c.function.name }} {{ c.function.arguments | tojson }}]{% endfor %}"
        "{% if m.tool_call_id %}#{{ m.tool_call_id }}{% endif %}|{% endfor %}"
        "tools={{ tools | tojson }} greeting={{ greeting }}"
        "{% if add_generation_prompt %}>{% endif %}"
        "{% if messages[0].content == 'boom' %}{{ raise_exception('roles must alternate') }}{% endif %}"
    )
    return tok


def test_tools_kwargs_and_tool_calls_reach_the_template(probe_tokenizer):
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
    call = tokenizer_pb2.ToolCall(id="call_1", type="function", function_name="weather",
                                  function_arguments='{"city": "Paris"}')
    prompt = render_chat(
        probe_tokenizer,
        chat(
            msg("user", "Weather in Paris?"),
            msg("assistant", tool_calls=[call]),
            msg("tool", "sunny", tool_call_id="call_1"),
            tools_json=orjson.dumps(tools).decode(),
            chat_template_kwargs_json='{"greeting": "bonjour"}',
        ),
    )
    assert prompt == (
        'user:Weather in Paris?|assistant:[call_1 weather {"city": "Paris"}]|tool:sunny#call_1|'
        'tools=[{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}] '
        "greeting=bonjour>"
    )


def test_tool_call_arguments_that_are_not_an_object_stay_a_string(probe_tokenizer):
    call = tokenizer_pb2.ToolCall(id="c", function_name="f", function_arguments="{not json")
    prompt = render_chat(probe_tokenizer, chat(msg("user", "x"), msg("assistant", tool_calls=[call])))
    assert '[c f "{not json"]' in prompt


@pytest.mark.parametrize(
    "kw, expected",
    [
        ({"tools_json": "{}"}, "tools must be a JSON array"),
        ({"chat_template_kwargs_json": "[1]"}, "chat_template_kwargs must be a JSON object"),
        (
            {"chat_template_kwargs_json": '{"add_generation_prompt": false, "tools": []}'},
            "chat_template_kwargs may not set add_generation_prompt, tools; use the request fields",
        ),
    ],
)
def test_bad_tools_and_kwargs_are_rejected(probe_tokenizer, kw, expected):
    assert rejected(probe_tokenizer, chat(msg("user", "x"), **kw)).message == expected


def test_template_exception_is_invalid_argument(probe_tokenizer):
    err = rejected(probe_tokenizer, chat(msg("user", "boom")))
    assert err.message == "the chat template could not render these messages: roles must alternate"
    assert err.code == "chat_template_error"


def test_model_without_template_is_rejected(smollm2_dir):
    tok = load_tokenizer(smollm2_dir)
    tok.chat_template = None
    err = rejected(tok, chat(msg("user", "x")))
    assert err.message == ("this model has no chat template: use /v1/completions (or text / input_ids), or start it "
                           "with --chat-template FILE (ringserve launch or the tokenizer)")


@pytest.mark.parametrize("message,error", [
    (tokenizer_pb2.ChatMessage(role="user", content="hi", tool_call_id="c1"),
     "messages[0] (user) cannot carry tool_call_id (only role tool has it)"),
    (tokenizer_pb2.ChatMessage(role="system", content="hi", reasoning_content="r"),
     "messages[0] (system) cannot carry reasoning_content (only role assistant has it)"),
], ids=["tool_call_id", "reasoning_content"])
def test_a_key_of_another_role_is_refused_not_ignored(smollm2_tokenizer, message, error):
    got = rejected(smollm2_tokenizer, chat(message, msg("user", "hi")))
    assert (got.param, got.message) == ("messages", error)
