"""Chat messages (``ChatInput``) to a prompt string through the model's chat template.

Rules, following vLLM's and SGLang's OpenAI serving layers:

- Roles: system, developer, user, assistant, tool. A tool message needs
  ``tool_call_id``; an assistant message may carry ``tool_calls`` and no content.
- Content is either ``content`` (a string) or ``content_parts``. Parts are joined
  by concatenating their ``text`` in order with no separator, so a single text
  part gives exactly the string form. Any part whose type is not "text" is
  rejected: this service serves text-only models.
- Absent content (an assistant with tool calls) is passed to the template as "".
- ``tool_call_id`` belongs to tool messages, ``tool_calls`` and ``reasoning_content`` to
  assistant messages: on any other role they are refused, not ignored.
- A tool call's ``function_arguments`` is passed as a dict when it is a JSON
  object (what Hugging Face templates expect, e.g. ``arguments | tojson``),
  otherwise as the string the model wrote.
- ``tools_json`` (a JSON array) becomes the template variable ``tools``;
  ``chat_template_kwargs_json`` (a JSON object) is merged into the template
  variables and may not redefine messages, tools, add_generation_prompt or
  continue_final_message.
- ``add_generation_prompt`` defaults to true. ``continue_final_message`` renders
  the prompt so it ends with the last assistant message's text: no end-of-turn
  token, no new assistant header. It uses transformers' sentinel method (render
  with a tag after the final content, cut at the tag), which works for templates
  with no native support. It excludes add_generation_prompt and needs the last
  message to be the assistant's.

Every rejection raises ``RequestError`` (gRPC INVALID_ARGUMENT, param "messages").
"""

from __future__ import annotations

from typing import Any

import jinja2
import orjson

from ringserve import limits
from ringserve.v1 import tokenizer_pb2
from services.tokenizer.errors import (
    CHAT_TEMPLATE_ERROR,
    INVALID_REQUEST,
    UNSUPPORTED_CONTENT_TYPE,
    RequestError,
    invalid,
    over_limit,
)

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "tools", "add_generation_prompt", "continue_final_message"})


def message_content(msg: tokenizer_pb2.ChatMessage, i: int) -> str | None:
    """The text of one message: ``content``, or its text parts concatenated with no separator.

    Raises:
        RequestError: both forms given, or a part that is not text.
    """
    if not msg.content_parts:
        return msg.content if msg.HasField("content") else None
    if msg.HasField("content"):
        raise invalid(f"messages[{i}]: give either content or content parts, not both", "messages")
    for j, part in enumerate(msg.content_parts):
        if part.type != "text":
            raise invalid(
                f"messages[{i}].content[{j}] has type {part.type!r}: only text content parts are supported by "
                "this model",
                "messages",
                UNSUPPORTED_CONTENT_TYPE,
            )
    return "".join(part.text for part in msg.content_parts)


def _tool_call(call: tokenizer_pb2.ToolCall, where: str) -> dict[str, Any]:
    arguments: Any = call.function_arguments
    try:
        limits.check_json_text(arguments, f"{where}.function_arguments", "messages")
    except limits.LimitExceeded as exc:
        raise over_limit(exc) from None
    try:
        parsed = orjson.loads(arguments) if arguments else {}
    except orjson.JSONDecodeError:
        parsed = None
    if isinstance(parsed, dict):
        arguments = parsed
    return {
        "id": call.id,
        "type": call.type or "function",
        "function": {"name": call.function_name, "arguments": arguments},
    }


def messages_to_dicts(chat: tokenizer_pb2.ChatInput) -> list[dict[str, Any]]:
    """ChatInput.messages as the list of dicts chat templates read.

    Raises:
        RequestError: empty list, unknown role, tool message without tool_call_id,
            or a content problem (see ``message_content``).
    """
    if not chat.messages:
        raise invalid("messages must contain at least one message", "messages")
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(chat.messages):
        if msg.role not in ROLES:
            raise invalid(
                f"messages[{i}].role {msg.role!r} is not one of {', '.join(sorted(ROLES))}", "messages"
            )
        content = message_content(msg, i)
        if content is None and not (msg.role == "assistant" and msg.tool_calls):
            raise invalid(f"messages[{i}] ({msg.role}) has no content", "messages")
        d: dict[str, Any] = {"role": msg.role, "content": content if content is not None else ""}
        if msg.name:
            d["name"] = msg.name
        if msg.role == "tool":
            if not msg.tool_call_id:
                raise invalid(f"messages[{i}] (tool) needs tool_call_id", "messages")
            d["tool_call_id"] = msg.tool_call_id
        elif msg.tool_call_id:
            raise invalid(f"messages[{i}] ({msg.role}) cannot carry tool_call_id (only role tool has it)", "messages")
        if msg.HasField("reasoning_content") and msg.role != "assistant":
            raise invalid(f"messages[{i}] ({msg.role}) cannot carry reasoning_content (only role assistant has it)",
                          "messages")
        if msg.tool_calls:
            if msg.role != "assistant":
                raise invalid(f"messages[{i}] ({msg.role}) cannot carry tool_calls", "messages")
            d["tool_calls"] = [_tool_call(c, f"messages[{i}].tool_calls[{j}]") for j, c in enumerate(msg.tool_calls)]
        if msg.HasField("reasoning_content"):
            d["reasoning_content"] = msg.reasoning_content
        out.append(d)
    return out


def _json_field(text: str, kind: type, name: str) -> Any:
    try:
        limits.check_json_text(text, name)
    except limits.LimitExceeded as exc:
        raise over_limit(exc) from None
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise invalid(f"{name} is not valid JSON: {exc}", name, INVALID_REQUEST) from None
    if not isinstance(value, kind):
        raise invalid(f"{name} must be a JSON {'array' if kind is list else 'object'}", name, INVALID_REQUEST)
    return value


def render_chat(tokenizer: Any, chat: tokenizer_pb2.ChatInput) -> str:
    """Render ``chat`` into the prompt text with ``tokenizer``'s chat template.

    Args:
        tokenizer: a transformers tokenizer whose ``chat_template`` is set.
        chat: messages, tools and template flags.

    Returns:
        The prompt string; tokenize it without adding special tokens.

    Raises:
        RequestError: INVALID_ARGUMENT for conflicting flags, a bad message, bad
            tools/kwargs JSON, or an error the template raises (param "messages").
    """
    if not tokenizer.chat_template:
        raise invalid("this model has no chat template: use /v1/completions (or text / input_ids), or start it with "
                      "--chat-template FILE (ringserve launch or the tokenizer)", "messages", INVALID_REQUEST)
    messages = messages_to_dicts(chat)
    add_generation_prompt = chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True
    if chat.continue_final_message:
        if add_generation_prompt:
            raise invalid(
                "continue_final_message and add_generation_prompt cannot both be true; "
                "set add_generation_prompt to false to continue the final message",
                "continue_final_message",
                INVALID_REQUEST,
            )
        if messages[-1]["role"] != "assistant":
            raise invalid(
                "continue_final_message needs the last message to be from the assistant, "
                f"but it is from {messages[-1]['role']!r}",
                "messages",
                INVALID_REQUEST,
            )
    kwargs: dict[str, Any] = {}
    if chat.chat_template_kwargs_json:
        kwargs = _json_field(chat.chat_template_kwargs_json, dict, "chat_template_kwargs")
        reserved = sorted(RESERVED_TEMPLATE_KWARGS & kwargs.keys())
        if reserved:
            raise invalid(
                f"chat_template_kwargs may not set {', '.join(reserved)}; use the request fields",
                "chat_template_kwargs",
                INVALID_REQUEST,
            )
    tools = _json_field(chat.tools_json, list, "tools") if chat.tools_json else None
    try:
        def render(tools: list | None) -> str:
            return tokenizer.apply_chat_template(
                messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=chat.continue_final_message,
                tokenize=False,
                **kwargs,
            )

        prompt = render(tools)
        if tools and prompt == render(None):
            raise invalid(
                "this model's chat template does not render tools, so the model would never see them; "
                "start it with --chat-template FILE, a template that renders them (ringserve launch or the "
                "tokenizer; a ChatML model gets ringserve/templates/chatml_tools.jinja by default)",
                "tools",
                INVALID_REQUEST,
            )
        return prompt
    except (jinja2.TemplateError, ValueError, TypeError) as exc:
        raise RequestError(
            f"the chat template could not render these messages: {exc}",
            code=CHAT_TEMPLATE_ERROR,
            param="messages",
        ) from None
