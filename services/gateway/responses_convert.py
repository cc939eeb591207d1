"""A Responses request -> the chat request it means -> the ``GenerateReqInput`` chat makes.

The conversation (a previous response's items, then ``input``) becomes chat messages:
``instructions`` the first system message, message items messages of their role, a run
of ``function_call`` items one assistant message with those tool calls (joined to the
assistant message right before it), ``function_call_output`` a tool message, and a
``reasoning`` item the ``reasoning_content`` of the assistant turn after it (dropped when
none follows). ``tools``, ``tool_choice``, ``parallel_tool_calls``, ``text.format``,
``max_output_tokens``, ``temperature`` and ``top_p`` become their chat fields, so the
template, the tool-call grammar, the output constraint and every check are chat's own
(``convert.chat_request``); an error from there names the Responses field.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from pydantic import TypeAdapter

from ringserve.limits import LimitExceeded
from ringserve.v1 import tokenizer_pb2

from . import convert
from .errors import GatewayError, invalid
from .protocol import (
    MAX_CHAT_MESSAGES,
    ChatCompletionRequest,
    ChatMessage,
    ContentPart,
    FunctionCall,
    FunctionDef,
    JsonSchemaFormat,
    NamedToolChoice,
    NamedToolChoiceFunction,
    ResponseFormat,
    Tool,
    ToolCall,
)
from .responses_protocol import (
    FunctionCallItem,
    FunctionCallOutputItem,
    InputItem,
    MessageItem,
    ReasoningItem,
    ResponsesRequest,
    TextPart,
)

ITEMS = TypeAdapter(list[InputItem])
# Chat's names in errors from the shared code -> the Responses fields they came from.
_RENAMES = (
    ("response_format.json_schema.schema", "text.format.schema"),
    ("response_format", "text.format"),
    ("max_completion_tokens", "max_output_tokens"),
    ("tools[].function.parameters", "tools[].parameters"),
    ("messages", "input"),
)
_PARAMS = {"response_format": "text", "max_completion_tokens": "max_output_tokens", "messages": "input"}
# Not served; refused unless null (OpenAI's name -> why).
_UNSERVED = {
    "conversation": "conversations are not stored here; send previous_response_id or the whole input",
    "prompt": "stored prompt templates are not served",
    "max_tool_calls": "a limit on tool calls is not served",
    "top_logprobs": "logprobs are not served on /v1/responses (use /v1/chat/completions)",
    "prompt_cache_key": "prompt caching is automatic (a shared prefix is reused) and takes no key",
    "prompt_cache_retention": "prompt caching is automatic and has no retention setting",
    "prompt_cache_options": "prompt caching is automatic and has no options",
    "context_management": "context management (compaction) is not served",
    "moderation": "moderation is not served",
    "safety_identifier": "safety identifiers are not served",
}


def refuse_unsupported(req: ResponsesRequest, store_enabled: bool) -> None:
    """Refuse, by name, every value of ``req`` this server cannot honour.

    Raises:
        GatewayError(400, code "unsupported_parameter"): the first such field.
    """
    def refuse(param: str, why: str) -> GatewayError:
        return invalid(f"{param}: {why}", param.split(".")[0], "unsupported_parameter")

    for name, why in _UNSERVED.items():
        if getattr(req, name) is not None:
            raise refuse(name, why)
    if req.background:
        raise refuse("background", "background responses are not served; stream the response instead")
    if req.include:
        raise refuse("include", f"{req.include[0]!r} cannot be included (nothing can be)")
    if req.truncation == "auto":
        raise refuse("truncation", "'auto' is not served: an input over the context window is refused")
    if req.service_tier not in (None, "auto", "default"):
        raise refuse("service_tier", f"{req.service_tier!r} is not served (only 'auto' and 'default')")
    if req.reasoning is not None:
        for key in ("effort", "summary", "generate_summary"):
            if getattr(req.reasoning, key) is not None:
                raise refuse(f"reasoning.{key}", "cannot be set on this model (reasoning, when the server "
                             "parses it, is returned as reasoning items as written)")
    if req.text is not None and req.text.verbosity is not None:
        raise refuse("text.verbosity", "verbosity cannot be set on this model")
    if req.stream_options is not None:
        if not req.stream:
            raise invalid("stream_options is only allowed when stream is true", "stream_options")
        if req.stream_options.include_obfuscation:
            raise refuse("stream_options.include_obfuscation", "no obfuscation padding is sent")
    if not store_enabled:
        if req.store:
            raise refuse("store", "the response store is off on this server (--responses-store-max 0)")
        if req.previous_response_id is not None:
            raise refuse("previous_response_id", "the response store is off on this server "
                         "(--responses-store-max 0); send the whole conversation as input")


def input_items(req: ResponsesRequest) -> list[InputItem]:
    """``input`` as items (a string is one user message)."""
    if isinstance(req.input, str):
        return [MessageItem(role="user", content=req.input)]
    return list(req.input)


def _parts(content: str | list[TextPart]) -> str | list[ContentPart]:
    if isinstance(content, str):
        return content
    return [ContentPart(type="text", text=p.text) for p in content]


def _reasoning_text(item: ReasoningItem) -> str:
    parts = item.content if item.content else item.summary
    return "".join(p.text for p in parts)


def chat_messages(items: Sequence[InputItem], instructions: str | None) -> list[ChatMessage]:
    """The chat messages of a conversation (see the module docstring).

    Raises:
        GatewayError(400): more messages than a chat request may hold.
    """
    messages = [ChatMessage(role="system", content=instructions)] if instructions is not None else []
    reasoning: str | None = None
    joinable = False  # the last message is an assistant turn a function_call may join
    for item in items:
        if isinstance(item, MessageItem):
            msg = ChatMessage(role=item.role, content=_parts(item.content))
            joinable = item.role == "assistant"
        elif isinstance(item, FunctionCallItem):
            call = ToolCall(id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments))
            if joinable:
                last = messages[-1]
                last.tool_calls = [*(last.tool_calls or ()), call]
                if reasoning is not None and last.reasoning_content is None:
                    last.reasoning_content, reasoning = reasoning, None  # the turn's reasoning, before its call
                continue
            msg, joinable = ChatMessage(role="assistant", tool_calls=[call]), True
        elif isinstance(item, FunctionCallOutputItem):
            msg, joinable = ChatMessage(role="tool", tool_call_id=item.call_id, content=_parts(item.output)), False
        else:
            reasoning = (reasoning or "") + _reasoning_text(item)
            continue
        if msg.role == "assistant" and reasoning is not None:
            msg.reasoning_content, reasoning = reasoning, None
        messages.append(msg)
    if len(messages) > MAX_CHAT_MESSAGES:
        raise invalid(f"the conversation holds {len(messages)} messages, more than the {MAX_CHAT_MESSAGES} a "
                      "request may hold", "input")
    if not messages:
        raise invalid("input must not be empty", "input")
    return messages


def chat_request(req: ResponsesRequest, items: Sequence[InputItem]) -> ChatCompletionRequest:
    """The chat request ``req`` means, over the conversation ``items``.

    Raises:
        GatewayError(400): see ``chat_messages``.
    """
    tools = [Tool(function=FunctionDef(name=t.name, description=t.description, parameters=t.parameters,
                                       strict=t.strict is not False)) for t in req.tools] if req.tools else None
    given = req.tool_choice
    choice = (NamedToolChoice(function=NamedToolChoiceFunction(name=given.name))
              if given is not None and not isinstance(given, str) else given)
    fmt = req.text.format if req.text is not None else None
    response_format = None
    if fmt is not None:
        schema = (JsonSchemaFormat(name=fmt.name, description=fmt.description, schema=fmt.schema_,
                                   strict=fmt.strict) if fmt.type == "json_schema" else None)
        response_format = ResponseFormat(type=fmt.type, json_schema=schema)
    # Always streamed from the tokenizer: a non-streamed response is the streamed one collected,
    # so that both come from the same chunks through the same parsers.
    sampling: dict[str, Any] = {"temperature": req.temperature, "top_p": req.top_p}  # the table's fields
    return ChatCompletionRequest(
        model=req.model, messages=chat_messages(items, req.instructions), tools=tools, tool_choice=choice,
        parallel_tool_calls=req.parallel_tool_calls, response_format=response_format,
        max_completion_tokens=req.max_output_tokens, user=req.user, stream=True, **sampling,
    )


def renamed(exc: GatewayError) -> GatewayError:
    """``exc`` with chat's field names replaced by the Responses fields they came from."""
    message = exc.message
    for chat, responses in _RENAMES:
        message = re.sub(rf"\b{re.escape(chat)}\b", responses, message)
    param = _PARAMS.get(exc.param or "", exc.param)
    return GatewayError(message, exc.status, exc.type, param, exc.code, exc.retry_after)


@contextmanager
def responses_names() -> Iterator[None]:
    """Errors raised inside name the Responses fields (``renamed``)."""
    try:
        yield
    except LimitExceeded as exc:
        raise renamed(invalid(exc.message, exc.param)) from None
    except GatewayError as exc:
        raise renamed(exc) from None


def generate_request(req: ResponsesRequest, chat: ChatCompletionRequest, rid: str) -> tokenizer_pb2.GenerateReqInput:
    """The chat request's ``GenerateReqInput``, with the Responses-only fields set.

    Raises:
        GatewayError(400): chat's checks, naming the Responses fields.
    """
    with responses_names():
        pb = convert.chat_request(chat, rid)
    if pb.sampling_params.constraint.param == "response_format":
        pb.sampling_params.constraint.param = "text.format"  # what later errors about it name
    if req.priority is not None:
        pb.priority = req.priority
    return pb


def output_as_input(output: list[dict]) -> list[InputItem]:
    """A response's output items as input items, as a client sends them back."""
    return ITEMS.validate_python(output)
