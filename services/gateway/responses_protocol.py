"""Request models of the OpenAI Responses API (``POST /v1/responses``).

What is served: ``input`` as a string or a list of items (messages with text parts,
``function_call``, ``function_call_output``, ``reasoning``), ``instructions``, function
``tools`` (Responses shape: name and parameters at the top level), ``tool_choice``,
``parallel_tool_calls``, ``text.format``, ``max_output_tokens``, ``temperature``,
``top_p``, ``metadata``, ``stream``, ``user``, ``store`` and ``previous_response_id``, and
ringserve's ``priority``. Every other OpenAI field is declared so that a value the server
cannot honour is refused by name (``responses_convert.refuse_unsupported``); a field OpenAI
does not have is refused as unrecognized, as in every other request model here. The item
shapes accept what this server returns, so a client can send its output items back as input
(the OpenAI Agents SDK does).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Discriminator, Field, Tag, field_validator, model_validator
from pydantic_core import PydanticCustomError

from ringserve import sampling_params as table

from .protocol import INT32_MAX, MAX_CHAT_MESSAGES, Body, JsonInt, Strict, bounded, refuse_other_variants

ItemStatus = Literal["in_progress", "completed", "incomplete"]
# Tool types OpenAI hosts (or runs on the client in its own shapes): none is served here.
FUNCTION_ONLY = "only tools of type 'function' are served"


class TextPart(Strict):
    """A text content part: ``input_text`` (user, system, developer) or ``output_text``
    (assistant); either is taken for any role, since both are plain text here."""

    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[dict[str, Any]] | None = None  # output_text echoed back: what this server sent
    logprobs: list[dict[str, Any]] | None = None

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        kind = data.get("type") if isinstance(data, dict) else None
        if isinstance(kind, str) and kind not in ("input_text", "output_text"):
            raise PydanticCustomError("unsupported_content", "content part type '{kind}' is not supported; this "
                                      "model accepts only 'input_text' and 'output_text' parts", {"kind": kind})
        if isinstance(data, dict) and data.get("annotations"):
            raise PydanticCustomError("unsupported_content", "annotations on a content part are not supported", {})
        return data


def _str_or_list(value: Any) -> str:
    return "str" if isinstance(value, str) else "list"


# ``str | parts``, checked against one branch only (chosen by the value's JSON type), so that
# an error names what is wrong with the value rather than every branch of the union.
Content = Annotated[Annotated[str, Tag("str")] | Annotated[list[TextPart], Tag("list")], Discriminator(_str_or_list)]


class MessageItem(Strict):
    """A message; ``type`` may be left out (OpenAI's "easy input message")."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Content
    id: str | None = None
    status: ItemStatus | None = None


class FunctionCallItem(Strict):
    """A call the model made (sent back so that the model sees its own call)."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str
    arguments: str
    id: str | None = None
    status: ItemStatus | None = None


class FunctionCallOutputItem(Strict):
    """The result of the call ``call_id``, as text or text parts."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: Content
    id: str | None = None
    status: ItemStatus | None = None


class SummaryText(Strict):
    type: Literal["summary_text"]
    text: str


class ReasoningText(Strict):
    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(Strict):
    """Reasoning the model wrote (sent back); its text goes to the next assistant turn."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[SummaryText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None
    status: ItemStatus | None = None

    @field_validator("encrypted_content")
    @classmethod
    def _not_encrypted(cls, value: str | None) -> None:
        if value is not None:
            raise PydanticCustomError("unsupported_value", "encrypted reasoning cannot be read here (this server "
                                      "never encrypts it): send the reasoning item's content", {})
        return value


def _item_tag(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("type", "message")
    return getattr(value, "type", None)


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_tag),
]
Items = Annotated[
    Annotated[str, Tag("str")] | Annotated[list[InputItem], Field(max_length=MAX_CHAT_MESSAGES), Tag("list")],
    Discriminator(_str_or_list),
]
ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")


class FunctionTool(Strict):
    """A function tool in the Responses shape. ``strict`` defaults to true, as OpenAI's does:
    a forced call's arguments then follow the parameters with every object closed."""

    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(Strict):
    type: Literal["function"]
    name: str


class TextFormat(Strict):
    """``text.format``: OpenAI's union tagged by ``type``; name, schema, description and
    strict belong to ``json_schema``."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _type_keys(cls, data: Any) -> Any:
        return refuse_other_variants(data, "type", {k: ("json_schema",) for k in
                                                    ("name", "description", "schema", "strict")})


class TextConfig(Strict):
    format: TextFormat | None = None
    verbosity: Any = None  # refused unless null (responses_convert)


class ReasoningConfig(Strict):
    """``reasoning``: effort and summaries cannot be honoured; refused unless null."""

    effort: Any = None
    summary: Any = None
    generate_summary: Any = None


class ResponsesStreamOptions(Strict):
    include_obfuscation: bool | None = None  # true is refused: no obfuscation padding is sent


def _refuse_types(value: Any, what: str, allowed: tuple[str, ...], why: str) -> None:
    """A readable 400 for an entry whose ``type`` is not served (rather than a union mismatch)."""
    for i, entry in enumerate(value if isinstance(value, list) else ()):
        kind = _item_tag(entry)
        if isinstance(kind, str) and kind not in allowed:
            raise PydanticCustomError("unsupported_type", "{what}[{i}]: type '{kind}' is not supported; {why}",
                                      {"what": what, "i": i, "kind": kind, "why": why})


class ResponsesRequest(Body):
    """``POST /v1/responses``. Defaults are None so that only what the client gave reaches
    the tokenizer, which fills in the real ones (as for chat)."""

    model: str | None = None
    input: Items
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: JsonInt | None = bounded(table.PARAMS["max_new_tokens"])
    temperature: float | None = bounded(table.PARAMS["temperature"])
    top_p: float | None = bounded(table.PARAMS["top_p"])
    metadata: dict[str, Annotated[str, Field(max_length=512)]] | None = Field(None, max_length=16)
    stream: bool = False
    stream_options: ResponsesStreamOptions | None = None
    user: str | None = None
    # ringserve: scheduling priority, lower first (vLLM's meaning), under --schedule-policy priority.
    priority: JsonInt | None = Field(None, ge=-INT32_MAX - 1, le=INT32_MAX)
    store: bool | None = None
    previous_response_id: str | None = Field(None, min_length=1)
    # OpenAI fields served only at their default value (refused by name otherwise).
    background: bool | None = None
    include: list[str] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    service_tier: str | None = None
    # OpenAI fields not served at all: refused by name unless null.
    conversation: Any = None
    prompt: Any = None
    max_tool_calls: Any = None
    top_logprobs: Any = None
    prompt_cache_key: Any = None
    prompt_cache_retention: Any = None
    prompt_cache_options: Any = None
    context_management: Any = None
    moderation: Any = None
    safety_identifier: Any = None

    @field_validator("input", mode="before")
    @classmethod
    def _item_types(cls, value: Any) -> Any:
        _refuse_types(value, "input", ITEM_TYPES, "items may be " + ", ".join(ITEM_TYPES))
        return value

    @field_validator("tools", mode="before")
    @classmethod
    def _tool_types(cls, value: Any) -> Any:
        _refuse_types(value, "tools", ("function",), FUNCTION_ONLY)
        return value

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _choice_type(cls, value: Any) -> Any:
        if isinstance(value, dict) and isinstance(value.get("type"), str) and value["type"] != "function":
            raise PydanticCustomError("unsupported_type", "tool_choice of type '{kind}' is not supported; give "
                                      "'auto', 'none', 'required' or a function (type 'function' with its name)",
                                      {"kind": value["type"]})
        return value

    @field_validator("metadata", mode="before")
    @classmethod
    def _metadata_keys(cls, value: Any) -> Any:
        if isinstance(value, dict) and any(isinstance(k, str) and len(k) > 64 for k in value):
            raise PydanticCustomError("metadata_key", "metadata keys are at most 64 characters", {})
        return value
