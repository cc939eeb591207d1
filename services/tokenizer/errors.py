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

Both go out bounded: gRPC refuses metadata that is not printable ASCII (INTERNAL "Invalid
metadata") and a client drops trailers over 8 KiB (RESOURCE_EXHAUSTED "Stream removed"),
and a message or a param can quote the request (a grammar engine's error quotes the regex;
``Constraint.param`` is whatever a direct client sent).
"""

from __future__ import annotations

import grpc

from ringserve.limits import LimitExceeded
from ringserve.prompt_bounds import INVALID_VALUE

# Status details as UTF-8 (gRPC percent-encodes them: at most 3x on the wire) and the param.
MAX_DETAILS_BYTES = 2048
MAX_PARAM_CHARS = 128

UNSUPPORTED_CONTENT_TYPE = "unsupported_content_type"
CHAT_TEMPLATE_ERROR = "chat_template_error"
INVALID_REQUEST = "invalid_request"
DUPLICATE_REQUEST_ID = "duplicate_request_id"
SERVICE_UNAVAILABLE = "service_unavailable"
SERVER_OVERLOADED = "server_overloaded"
INTERNAL_ERROR = "internal_error"
MODEL_NOT_FOUND = "model_not_found"  # a LoRA adapter the scheduler does not hold (unloaded meanwhile)


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

    def details(self) -> str:
        """The message as gRPC status details: cut to MAX_DETAILS_BYTES of UTF-8, saying so."""
        raw = self.message.encode("utf-8", "replace")
        if len(raw) <= MAX_DETAILS_BYTES:
            return self.message
        return raw[:MAX_DETAILS_BYTES - 64].decode("utf-8", "ignore") + f" ... (cut, {len(raw)} bytes in all)"

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        """("code", ...) and, when known, ("param", ...) for the gRPC trailers: printable
        ASCII (other characters backslash-escaped), the param cut to MAX_PARAM_CHARS."""
        pairs = [("code", self.code)]
        if self.param:
            param = self.param.encode("ascii", "backslashreplace").decode("ascii")
            param = "".join(ch if ch.isprintable() else f"\\x{ord(ch):02x}" for ch in param)
            pairs.append(("param", param[:MAX_PARAM_CHARS]))
        return tuple(pairs)


def invalid(message: str, param: str | None = None, code: str = INVALID_VALUE) -> RequestError:
    """An INVALID_ARGUMENT RequestError."""
    return RequestError(message, grpc.StatusCode.INVALID_ARGUMENT, code, param)


def unavailable(message: str) -> RequestError:
    """An UNAVAILABLE RequestError (a peer of the ring is down)."""
    return RequestError(message, grpc.StatusCode.UNAVAILABLE, SERVICE_UNAVAILABLE)


def over_limit(exc: LimitExceeded) -> RequestError:
    """The INVALID_ARGUMENT RequestError of a document over ``ringserve.limits``' limits."""
    return RequestError(exc.message, grpc.StatusCode.INVALID_ARGUMENT, INVALID_VALUE, exc.param)
