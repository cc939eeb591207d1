"""Request errors raised by the tokenizer core and their gRPC form.

The servicer turns a ``RequestError`` into a gRPC status with the message as
details and two trailing metadata keys the gateway reads to build an OpenAI
error object:

    "code"   machine-readable cause: "context_length_exceeded", "invalid_value",
             "unsupported_content_type", "chat_template_error", "invalid_request",
             "duplicate_request_id", "service_unavailable", "server_overloaded",
             "internal_error" (the last three also for a scheduler or detokenizer
             error abort: UNAVAILABLE, RESOURCE_EXHAUSTED, INTERNAL)
    "param"  the OpenAI request parameter at fault ("messages", "prompt",
             "max_tokens", "temperature", ...), when there is one
"""

from __future__ import annotations

import grpc

from ringserve.prompt_bounds import CONTEXT_LENGTH_EXCEEDED, INVALID_VALUE

UNSUPPORTED_CONTENT_TYPE = "unsupported_content_type"
CHAT_TEMPLATE_ERROR = "chat_template_error"
INVALID_REQUEST = "invalid_request"
DUPLICATE_REQUEST_ID = "duplicate_request_id"
SERVICE_UNAVAILABLE = "service_unavailable"
SERVER_OVERLOADED = "server_overloaded"
INTERNAL_ERROR = "internal_error"


class RequestError(Exception):
    """A request that cannot be served, with the gRPC status it ends the call with."""

    def __init__(
        self,
        message: str,
        status: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT,
        code: str = INVALID_VALUE,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.code = code
        self.param = param

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        """("code", ...) and, when known, ("param", ...) for the gRPC trailers."""
        pairs = [("code", self.code)]
        if self.param:
            pairs.append(("param", self.param))
        return tuple(pairs)


def invalid(message: str, param: str | None = None, code: str = INVALID_VALUE) -> RequestError:
    """An INVALID_ARGUMENT RequestError."""
    return RequestError(message, grpc.StatusCode.INVALID_ARGUMENT, code, param)


def unavailable(message: str) -> RequestError:
    """An UNAVAILABLE RequestError (a peer of the ring is down)."""
    return RequestError(message, grpc.StatusCode.UNAVAILABLE, SERVICE_UNAVAILABLE)
