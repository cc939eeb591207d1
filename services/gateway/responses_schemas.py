"""Response models of the ``/v1/responses`` routes, used only for the OpenAPI schema (as
``schemas`` is for the other routes): the response object, its output items and usage, and
the deletion result. The bodies themselves are built as dicts (``responses_output``)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel


class InputTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens served from the prefix cache
    cache_write_tokens: int  # always 0: caching is automatic, with no explicit writes


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class OutputItem(BaseModel):
    """One output item: ``message`` (role, content of output_text parts), ``function_call``
    (call_id, name, arguments) or ``reasoning`` (summary, content of reasoning_text parts)."""

    id: str
    type: str
    status: str
    role: str | None = None
    content: list[dict[str, Any]] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    summary: list[dict[str, Any]] | None = None


class ResponseError(BaseModel):
    code: str
    message: str


class IncompleteDetails(BaseModel):
    reason: str  # "max_output_tokens"


class ResponseObject(BaseModel):
    """The response object (``object: "response"``) with the request's settings echoed."""

    id: str
    object: str
    created_at: int
    completed_at: int | None
    status: str  # completed | incomplete | failed
    model: str
    output: list[OutputItem]
    usage: ResponseUsage | None
    error: ResponseError | None
    incomplete_details: IncompleteDetails | None
    instructions: str | None
    max_output_tokens: int | None
    metadata: dict[str, str]
    parallel_tool_calls: bool
    previous_response_id: str | None
    store: bool
    temperature: float | None
    top_p: float | None
    text: dict[str, Any]
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    truncation: str
    user: str | None


class DeletedResponse(BaseModel):
    id: str
    object: str  # "response"
    deleted: bool
