"""A credential in gRPC call metadata, checked by a server interceptor once per call.

Both credentials ringserve checks on gRPC go through here: the public API key on the
tokenizer's ``Tokenizer`` service (``ringserve.apikeys``) and the ring's internal token on
the scheduler's and the detokenizer's services (``ringserve.internal_auth``).

The check runs in ``intercept_service``, once when a call starts: for a long-lived stream
(``Scheduler.Connect``, ``Detokenizer.Stream``/``Subscribe``) that is once per stream,
never per message, and an accepted call gets its servicer's own handler back, so the
messages of a stream pass no extra code. A refused call gets a handler of the same kind
that ends it with UNAUTHENTICATED at once, without parsing the request. Methods of
services not named (health, reflection) are never checked.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, Iterable

import grpc


def matches_any(given: str, keys: Iterable[str]) -> bool:
    """Whether ``given`` equals one of ``keys``. Every key is compared, each in constant time
    (``hmac.compare_digest``), so the answer's timing does not tell which key or how much of
    one matched."""
    data = given.encode()
    ok = False
    for key in keys:
        ok |= hmac.compare_digest(data, key.encode())
    return ok


def denying_handler(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of ``handler``'s kind that ends the call with UNAUTHENTICATED ``message`` at once.

    It has no request deserializer: the request is not even parsed."""

    async def deny(_request: object, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(deny)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(deny)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(deny)
    return grpc.stream_stream_rpc_method_handler(deny)


class CredentialInterceptor(grpc.aio.ServerInterceptor):
    """Checks the metadata ``metadata_key`` on every call to a method of ``services``.

    Args:
        services: full service names (``ringserve.v1.Scheduler``) whose methods need the credential.
        metadata_key: the (lower-case) metadata key that carries it.
        accepts: whether a value of ``metadata_key`` is a valid credential.
        missing: the UNAUTHENTICATED message of a call without ``metadata_key``.
        wrong: the UNAUTHENTICATED message of a call with a value ``accepts`` refuses.
    """

    def __init__(self, services: tuple[str, ...], metadata_key: str, accepts: Callable[[str], bool],
                 missing: str, wrong: str):
        self.prefixes = tuple(f"/{name}/" for name in services)
        self.metadata_key = metadata_key
        self.accepts = accepts
        self.missing = missing
        self.wrong = wrong

    def refusal(self, value: str | None) -> str | None:
        """None when ``value`` (the first of ``metadata_key``, None when absent) is accepted,
        else the message of the call's refusal."""
        if value is None:
            return self.missing
        return None if self.accepts(value) else self.wrong

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or not details.method.startswith(self.prefixes):
            return handler
        given = next((value for key, value in details.invocation_metadata or () if key == self.metadata_key), None)
        refusal = self.refusal(given)
        return handler if refusal is None else denying_handler(handler, refusal)
