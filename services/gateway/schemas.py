"""Response models, used only for the OpenAPI schema (``/openapi.json``).

Handlers build their bodies as dicts (orjson, no per-chunk model validation on the hot
path); these models state what those bodies hold so that clients and schemathesis can
check them. Every error is an OpenAI error object with a 4xx/5xx status; FastAPI's 422 is
never produced (validation errors are 400) and is removed from the schema by
``openapi_schema``.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel


class ErrorObject(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorObject


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class FunctionCallOut(BaseModel):
    name: str
    arguments: str  # JSON text of the arguments, as the model wrote it


class ToolCallOut(BaseModel):
    id: str
    type: str  # "function"
    function: FunctionCallOut


class ChatMessageOut(BaseModel):
    role: str
    content: str | None  # null when the choice only made tool calls
    tool_calls: list[ToolCallOut] | None = None  # non-empty exactly when finish_reason is "tool_calls"
    reasoning_content: str | None = None  # with --reasoning-parser


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: dict[str, Any] | None
    finish_reason: str | None
    matched_stop: str | int | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: str
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: list[dict[str, Any] | None] | None = None  # with vLLM's prompt_logprobs


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: dict[str, Any] | None
    finish_reason: str | None
    matched_stop: str | int | None = None
    prompt_logprobs: list[dict[str, Any] | None] | None = None  # with vLLM's prompt_logprobs


class CompletionResponse(BaseModel):
    id: str
    object: str
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[CompletionChoice]
    usage: UsageInfo


class ModelEntry(BaseModel):
    id: str
    object: str
    created: int
    owned_by: str
    root: str
    max_model_len: int
    parent: str | None = None  # a LoRA adapter's base model (vLLM's field); null for the base model


class ModelList(BaseModel):
    object: str
    data: list[ModelEntry]


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int
    prompt: str


class DetokenizeResponse(BaseModel):
    prompt: str


class AbortResponse(BaseModel):
    rid: str
    aborted: bool


class NotReady(BaseModel):
    replica: str  # the replica's scheduler address ("" for the tokenizer itself)
    reason: str  # scheduler_link_down, detokenizer_link_down, scheduler_health_check,
    # detokenizer_health_check, outputs_stalled, tokenizer_unavailable
    message: str


class HealthResponse(BaseModel):
    status: str
    replicas: int
    not_ready: list[NotReady]


class HealthNotReadyResponse(ErrorResponse):
    status: str  # "not_ready"
    replicas: int
    not_ready: list[NotReady]


class HealthGenerateResponse(BaseModel):
    status: str
    text: str
    completion_tokens: int
    latency_s: float


# One server-sent event (the media type's schema describes each event, as OpenAPI 3.2's
# itemSchema does): a data line holding a chunk's JSON, the last one "[DONE]".
_SSE = {"text/event-stream": {"schema": {
    "type": "object",
    "description": "data: <chunk JSON> events, then data: [DONE]",
    "properties": {"data": {"type": "string"}, "event": {"type": "string"}, "id": {"type": "string"}},
    "required": ["data"],
}}}

ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": what}
    for status, what in {
        400: "Invalid request (validation errors are 400, never 422)",
        401: "Missing or wrong API key (with --api-key)",
        404: "Unknown model or rid",
        429: "Overloaded (Retry-After)",
        500: "Internal error",
        503: "Not serving (Retry-After)",
        504: "Tokenizer deadline exceeded",
    }.items()
}


def ok(model: type[BaseModel], stream: bool = False) -> dict[int | str, dict[str, Any]]:
    """``responses=`` for a route: 200 with ``model`` (or an SSE stream), and every error."""
    extra: dict[str, Any] = {"content": _SSE} if stream else {}
    return {200: {"model": model, "description": "OK", **extra}, **ERRORS}


def openapi_schema(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema without the 422 responses and their schemas (this app answers 400)."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        for path in schema.get("paths", {}).values():
            for op in path.values():
                op.get("responses", {}).pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(name, None)
        app.openapi_schema = schema
    return app.openapi_schema
