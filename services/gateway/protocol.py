"""Request models of the OpenAI API (chat, completions) and of the native endpoints.

Every model forbids unknown fields: a silently ignored parameter is how clients get wrong
results. Ranges that need no model knowledge are checked here (they also appear in the
OpenAPI schema); the tokenizer service checks the rest (context length, template errors).
The sampling fields are generated from the table of ``ringserve.sampling_params`` (names,
types, bounds, help), under their OpenAI names in chat/completions and under the proto's in
``/generate``. They default to None so that only what the client gave reaches the tokenizer,
which fills in the real defaults.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, create_model, model_validator
from pydantic_core import PydanticCustomError

from ringserve import sampling_params as table
from ringserve.priority import PRIORITY


class Strict(BaseModel):
    """Unknown fields are rejected, and so are values of the wrong JSON type (``"true"`` for a
    boolean, ``"5"`` for an integer): what is accepted is exactly what the OpenAPI schema
    says. An integer is still accepted where a number is expected."""

    model_config = ConfigDict(extra="forbid", strict=True)


def first_unencodable(value: Any, path: str = "") -> tuple[str, str] | None:
    """The path (``messages[0].content``) and value of the first string in a JSON value that
    cannot be encoded as UTF-8 (a lone surrogate, which JSON's ``\\udfff`` escape allows),
    looking at object keys too; None when every string encodes. Iterative: no recursion limit
    for deeply nested client JSON."""
    stack: list[tuple[Any, str]] = [(value, path)]
    while stack:
        item, where = stack.pop()
        if isinstance(item, str):
            if not item.isascii():
                try:
                    item.encode("utf-8")
                except UnicodeEncodeError:
                    return where or "body", item
        elif isinstance(item, dict):
            for key, sub in reversed(list(item.items())):
                name = str(key).encode("utf-8", "backslashreplace").decode("utf-8")
                sub_path = f"{where}.{name}" if where else name
                if name != key:
                    return sub_path, key
                stack.append((sub, sub_path))
        elif isinstance(item, list):
            stack.extend((sub, f"{where}[{i}]") for i, sub in reversed(list(enumerate(item))))
    return None


def refuse_other_variants(data: Any, tag: str, owners: Mapping[str, tuple[str, ...]]) -> Any:
    """Refuse keys that belong to another variant of a union tagged by ``tag`` (a before-validator).

    ``owners`` maps a key to the tag values whose variant has it: ``json_schema`` belongs to
    ``type: "json_schema"``, so ``{"type": "text", "json_schema": {...}}`` is refused rather
    than served with the schema ignored. A key given as null counts as absent.

    Raises:
        PydanticCustomError("variant_key"): naming each such key and the variants that own it.
    """
    if not isinstance(data, dict):
        return data
    given = data.get(tag)
    wrong = [f"{key} is only allowed with {tag} {' or '.join(map(repr, tags))}"
             for key, tags in owners.items() if data.get(key) is not None and given not in tags]
    if wrong:
        raise PydanticCustomError("variant_key", "{wrong}, got {tag} {given}",
                                  {"wrong": "; ".join(wrong), "tag": tag, "given": repr(given)})
    return data


class Body(Strict):
    """A request body. Every string in it, at any depth (free-form JSON such as tool
    parameters and chat_template_kwargs included, and object keys), must be encodable as
    UTF-8: protobuf, the tokenizer and the JSON encoder all refuse lone surrogates, so one
    check here turns that whole class of input into a 400 naming the field."""

    @model_validator(mode="before")
    @classmethod
    def _utf8_strings(cls, data: Any) -> Any:
        bad = first_unencodable(data)
        if bad is not None:
            where, text = bad
            index = next(i for i, ch in enumerate(text) if 0xD800 <= ord(ch) <= 0xDFFF)
            raise PydanticCustomError(
                "string_not_utf8",
                "'{path}' cannot be encoded as UTF-8: lone surrogate U+{code} at index {index}",
                {"path": where, "code": f"{ord(text[index]):04X}", "index": index},
            )
        return data


# Token counts and ids travel as proto int32: a larger number is a 400 here, not a 500 later.
INT32_MAX = table.INT32_MAX
# Messages per chat request (Azure OpenAI's limit): what bounds the gateway's validation
# work on the event loop (services/gateway/body.py).
MAX_CHAT_MESSAGES = 2048


def _integral(value: Any) -> Any:
    """JSON Schema's integer: ``5.0`` is the integer 5 (strict mode would reject it)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


JsonInt = Annotated[int, BeforeValidator(_integral)]
NonNegInt = Annotated[JsonInt, Field(ge=0, le=INT32_MAX)]
NonEmptyStr = Annotated[str, Field(min_length=1)]
_JSON_TYPES: dict[type, Any] = {bool: bool, int: JsonInt, float: float}


def bounded(p: table.Param, default: Any = None) -> Any:
    """A pydantic field with ``p``'s bounds and help.

    A parameter with an ``off`` value (top_k: -1, or at least 1) shows ``off`` as its
    schema's minimum and is checked below by ``convert`` with the table's message, which
    names both; every other bound is a pydantic constraint, whose error ``errors`` words as
    the table does.
    """
    bounds: dict[str, Any] = {}
    if p.off is not None:
        bounds["json_schema_extra"] = {"minimum": p.off}
    elif p.lo is not None:
        bounds["gt" if p.lo_open else "ge"] = p.lo
    if p.hi is not None:
        bounds["lt" if p.hi_open else "le"] = p.hi
    return Field(default, description=p.help, **bounds)


def table_fields(http_names: bool) -> dict[str, Any]:
    """Every parameter of the table as ``create_model`` field definitions (type | None, default None),
    under its OpenAI name (``http_names``) or its proto name."""
    return {p.http_name if http_names else p.name: (_JSON_TYPES[p.type] | None, bounded(p)) for p in table.TABLE}


class StreamOptions(Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class ContentPart(BaseModel):
    """One part of a message's content. Only ``text`` parts are served (checked on conversion,
    so that an ``image_url`` part gets a clear 400 rather than a union-matching error)."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    text: str | None = None


class FunctionCall(Strict):
    name: str
    arguments: str = ""


class ToolCall(Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall
    index: JsonInt | None = None


class ChatMessage(Strict):
    """One message; OpenAI's message types are a union tagged by ``role``, and a key of
    another role's type is refused (``tool_call_id`` on a user message)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCall] | None = None
    reasoning_content: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _role_keys(cls, data: Any) -> Any:
        return refuse_other_variants(data, "role", {"tool_call_id": ("tool",), "tool_calls": ("assistant",),
                                                    "reasoning_content": ("assistant",)})


class FunctionDef(Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Strict):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedToolChoiceFunction(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"] = "function"
    function: NamedToolChoiceFunction


class JsonSchemaFormat(Strict):
    """``response_format.json_schema``: ``schema`` is required here (a format without one would
    enforce nothing). The schema is enforced whether ``strict`` is true or not; true also closes its
    objects (``constraints.closed_objects``)."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Strict):
    """OpenAI's union tagged by ``type``: only ``json_schema`` has a ``json_schema`` key."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="before")
    @classmethod
    def _type_keys(cls, data: Any) -> Any:
        return refuse_other_variants(data, "type", {"json_schema": ("json_schema",)})


class StructuredOutputs(Strict):
    """vLLM's ``structured_outputs``: exactly one of json (a schema), json_object, regex, choice, grammar."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    json_: dict[str, Any] | bool | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class _RequestFields(Body):
    """Fields shared by chat and completions requests besides the table's sampling parameters."""

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[NonNegInt] | None = None
    logit_bias: dict[str, float] | None = None
    include_stop_str_in_output: bool | None = None
    user: str | None = None
    rid: str | None = Field(None, min_length=1)
    request_id: str | None = Field(None, min_length=1)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    priority: JsonInt = bounded(PRIORITY, 0)  # vLLM: lower runs first (--schedule-policy priority)


if TYPE_CHECKING:
    class SamplingFields(_RequestFields):
        def __getattr__(self, name: str) -> Any: ...  # the table's fields, made at import
else:
    SamplingFields = create_model(
        "SamplingFields", __base__=_RequestFields, __module__=__name__, **table_fields(http_names=True),
        __doc__="Fields shared by chat and completions requests (OpenAI plus the SGLang/vLLM extensions).",
    )


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_CHAT_MESSAGES)
    max_completion_tokens: JsonInt | None = bounded(table.PARAMS["max_new_tokens"])
    logprobs: bool = False
    top_logprobs: JsonInt | None = bounded(table.TOP_LOGPROBS)
    add_generation_prompt: bool | None = None
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    echo: bool = False  # vLLM: prepend the final assistant message (when continuing it)
    prompt_logprobs: JsonInt | None = bounded(table.TOP_LOGPROBS)  # vLLM: logprobs of the prompt's tokens


class CompletionRequest(SamplingFields):
    prompt: NonEmptyStr | list[NonNegInt] | list[list[NonNegInt]] | list[NonEmptyStr]
    # 0 only with echo or prompt_logprobs: score the prompt, generate nothing.
    max_tokens: JsonInt | None = Field(None, ge=0, le=INT32_MAX)
    echo: bool = False  # with logprobs: the prompt's tokens get entries too (the first: null)
    logprobs: JsonInt | None = bounded(table.TOP_LOGPROBS)
    prompt_logprobs: JsonInt | None = bounded(table.TOP_LOGPROBS)  # vLLM


class _NativeFields(Strict):
    """``/generate``'s sampling_params besides the table's parameters."""

    stop: str | list[str] | None = None
    stop_token_ids: list[NonNegInt] | None = None
    logit_bias: dict[str, float] | None = None
    # SGLang's constraints (at most one, here or at the top level of the request).
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None


if TYPE_CHECKING:
    class NativeSamplingParams(_NativeFields):
        def __getattr__(self, name: str) -> Any: ...  # the table's fields, made at import
else:
    NativeSamplingParams = create_model(
        "NativeSamplingParams", __base__=_NativeFields, __module__=__name__, **table_fields(http_names=False),
        __doc__="``sampling_params`` of ``POST /generate``: the fields of the proto's SamplingParams.",
    )


class GenerateRequest(Body):
    """``POST /generate`` (SGLang's native API): exactly one of text and input_ids."""

    text: str | None = None
    input_ids: Annotated[list[NonNegInt], Field(min_length=1)] | None = None
    sampling_params: NativeSamplingParams = Field(default_factory=NativeSamplingParams)
    stream: bool = False
    rid: str | None = Field(None, min_length=1)
    return_logprob: bool = False
    top_logprobs_num: JsonInt = bounded(table.TOP_LOGPROBS, 0)
    # With return_logprob: prompt logprobs from this position (SGLang); -1 = none.
    logprob_start_len: JsonInt = Field(-1, ge=-1, le=INT32_MAX)
    priority: JsonInt = bounded(PRIORITY, 0)  # SGLang's and vLLM's: lower runs first
    lora_path: str | None = None  # SGLang's: the LoRA adapter (its name) to run under; 404 if not loaded
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None


class TokenizeRequest(Body):
    """``POST /v1/tokenize``: a prompt, or chat messages rendered with the template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, max_length=MAX_CHAT_MESSAGES)
    add_special_tokens: bool = True
    add_generation_prompt: bool | None = None
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None


class DetokenizeRequest(Body):
    model: str | None = None
    tokens: list[NonNegInt]
    skip_special_tokens: bool = False


class AbortRequest(Body):
    rid: str = Field(min_length=1)
