"""OpenAI error objects and the mapping from gRPC statuses and validation errors onto them.

Every error leaves the gateway as ``{"error": {"message", "type", "param", "code"}}`` with
``Content-Type: application/json`` (or, once an SSE stream has started, as one
``data: {"error": ...}`` event). Status mapping for the tokenizer's gRPC codes:

    INVALID_ARGUMENT   -> 400 invalid_request_error (code/param from trailing metadata)
    ALREADY_EXISTS     -> 400 invalid_request_error, code "duplicate_request_id"
    NOT_FOUND          -> 404 not_found_error
    RESOURCE_EXHAUSTED -> 429 rate_limit_error + Retry-After
    UNAVAILABLE        -> 503 service_unavailable_error + Retry-After
    CANCELLED          -> 503 service_unavailable_error + Retry-After (the tokenizer went away)
    DEADLINE_EXCEEDED  -> 504 timeout_error
    UNAUTHENTICATED    -> 500 server_error: the tokenizer refused the gateway's own key (the
                          client's was checked here), a configuration error named in the log
    anything else      -> 500 server_error (the gRPC details, never a stack trace)
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Mapping, Sequence
from typing import Any

import grpc
import orjson
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from ringserve.limits import MAX_JSON_DEPTH, LimitExceeded
from ringserve.sampling_params import bound_message

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 1


class GatewayError(Exception):
    """An error with its HTTP status and OpenAI error fields."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        retry_after: bool = False,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.param = param
        self.code = code
        self.retry_after = retry_after

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> Response:
        headers = {"Retry-After": str(RETRY_AFTER_S)} if self.retry_after else None
        return Response(orjson.dumps(self.body()), self.status, headers, media_type="application/json")


def invalid(message: str, param: str | None = None, code: str | None = "invalid_value") -> GatewayError:
    """A 400 invalid_request_error."""
    return GatewayError(message, 400, "invalid_request_error", param, code)


_GRPC_STATUS: dict[grpc.StatusCode, tuple[int, str, str | None, bool]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error", None, False),
    grpc.StatusCode.ALREADY_EXISTS: (400, "invalid_request_error", "duplicate_request_id", False),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error", "not_found", False),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error", "failed_precondition", False),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error", "server_overloaded", True),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error", "service_unavailable", True),
    grpc.StatusCode.CANCELLED: (503, "service_unavailable_error", "service_unavailable", True),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error", "timeout", False),
}


def from_grpc_status(
    code: grpc.StatusCode, details: str | None, metadata: Mapping[str, str] | None = None
) -> GatewayError:
    """Map a gRPC status (and the tokenizer's "code"/"param" trailing metadata) to a GatewayError."""
    metadata = metadata or {}
    if code == grpc.StatusCode.UNAUTHENTICATED:
        logger.error("the tokenizer refused the gateway's API key (%s): the gateway's first key must be "
                     "one the tokenizer accepts", details)
        return GatewayError("the server's tokenizer refused the gateway's API key (a server configuration error)",
                            500, "server_error", None, "internal_error")
    status, type_, default_code, retry = _GRPC_STATUS.get(code, (500, "server_error", "internal_error", False))
    message = details or code.name.lower()
    if status == 500:
        # The details go to the client only: they may quote the request.
        logger.error("tokenizer returned %s", code.name)
    param = metadata.get("param") or ("rid" if code == grpc.StatusCode.ALREADY_EXISTS else None)
    return GatewayError(message, status, type_, param, metadata.get("code") or default_code, retry)


def from_rpc_error(exc: grpc.aio.AioRpcError) -> GatewayError:
    metadata: dict[str, str] = {}
    for key, value in exc.trailing_metadata() or ():
        if isinstance(value, str):
            metadata[key] = value
    return from_grpc_status(exc.code(), exc.details(), metadata)


def from_status_name(name: str, message: str) -> GatewayError:
    """Map a FinishReason.status name ("UNAVAILABLE", ...) to a GatewayError."""
    code = grpc.StatusCode.__members__.get(name, grpc.StatusCode.INTERNAL)
    return from_grpc_status(code, message or name.lower())


# --- request validation (pydantic) -------------------------------------------------------

_BOUND_WORDS = {
    "greater_than_equal": ("at least", "ge"),
    "greater_than": ("greater than", "gt"),
    "less_than_equal": ("at most", "le"),
    "less_than": ("less than", "lt"),
}

# Segments pydantic adds to a location for union members; they are not field names.
_TYPE_SEGMENTS = {"str", "int", "float", "bool", "dict", "list"}


def _path(loc: Sequence[Any]) -> str:
    parts: list[str] = []
    for seg in loc:
        if isinstance(seg, int):
            parts.append(f"[{seg}]")
        elif seg in _TYPE_SEGMENTS or "[" in str(seg) or str(seg).startswith(("constrained-", "function-")):
            continue
        else:
            parts.append(("." if parts else "") + str(seg))
    return "".join(parts)


def _loc(err: Mapping[str, Any]) -> tuple[Any, ...]:
    loc = tuple(err.get("loc", ()))
    return loc[1:] if loc[:1] == ("body",) else loc


def from_validation_errors(errors: Sequence[Mapping[str, Any]]) -> GatewayError:
    """Turn pydantic/FastAPI validation errors into one 400 naming the offending parameter.

    Unknown fields are reported all together ("Unrecognized request arguments supplied: a, b").
    """
    if not errors:
        return invalid("invalid request body", None)
    extras = [_path(_loc(e)) for e in errors if e.get("type") == "extra_forbidden"]
    if extras:
        noun = "argument" if len(extras) == 1 else "arguments"
        names = ", ".join(extras)
        return invalid(f"Unrecognized request {noun} supplied: {names}", extras[0], "unknown_parameter")
    err = errors[0]
    kind = err.get("type", "")
    if kind == "json_invalid":
        detail = (err.get("ctx") or {}).get("error", "JSON decode error")
        return invalid(f"Invalid JSON body: {detail}", None, "invalid_json")
    if kind == "string_not_utf8":
        # Raised by protocol.Body for the whole body: the path is in the context.
        path = (err.get("ctx") or {}).get("path", "")
        param = path.split(".", 1)[0].split("[", 1)[0] or None
        return invalid(err.get("msg", f"'{path}' cannot be encoded as UTF-8"), param, "invalid_encoding")
    loc = _loc(err)
    path = _path(loc)
    param = str(loc[0]) if loc else None
    if kind == "missing":
        return invalid(f"Missing required parameter: '{path or 'body'}'", param, "missing_required_parameter")
    if kind in _BOUND_WORDS:
        words, key = _BOUND_WORDS[kind]
        bound = (err.get("ctx") or {}).get(key)
        if bound is not None:
            # Worded as the tokenizer and the scheduler word it (the sampling parameters' table).
            return invalid(bound_message(path, words, bound, err.get("input")), param, "invalid_value")
    what = f"Invalid '{path}'" if path else "Invalid request body"
    code = "invalid_type" if kind.endswith("_type") or kind.endswith("_parsing") else "invalid_value"
    return invalid(f"{what}: {err.get('msg', 'invalid value')}", param, code)


# --- exception handlers --------------------------------------------------------------------


async def handle_gateway_error(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, GatewayError)
    return exc.response()


async def handle_validation_error(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    return from_validation_errors(exc.errors()).response()


async def handle_limit_exceeded(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, LimitExceeded)
    return invalid(exc.message, exc.param).response()


async def handle_http_error(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    if isinstance(exc.__cause__, RecursionError):
        # FastAPI's body parse (stdlib json) gave up on the nesting: say so, not just "error parsing".
        return invalid(f"the request body nests too deeply to parse; JSON inside a request may nest at most "
                       f"{MAX_JSON_DEPTH} levels", None, "invalid_json").response()
    type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    return GatewayError(str(exc.detail), exc.status_code, type_, None, code).response()


async def handle_unexpected(_: Request, exc: Exception) -> Response:
    # The traceback without the exception's message, which may quote the request body.
    trace = "".join(traceback.format_tb(exc.__traceback__))
    logger.error("unhandled %s in the gateway:\n%s", type(exc).__name__, trace)
    return GatewayError("internal server error", 500, "server_error", None, "internal_error").response()


HANDLERS = {
    GatewayError: handle_gateway_error,
    LimitExceeded: handle_limit_exceeded,
    RequestValidationError: handle_validation_error,
    StarletteHTTPException: handle_http_error,
    Exception: handle_unexpected,
}
