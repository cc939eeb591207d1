"""A request that protobuf cannot parse is the client's error: INVALID_ARGUMENT, not UNKNOWN.

grpc's server turns a deserializer's exception into ``UNKNOWN "Unexpected DecodeError"``. The
common case is a string field holding bytes that are not UTF-8 (a lone surrogate encoded
the CESU way, or arbitrary bytes from a client whose protobuf does not check them): protobuf
in Python refuses such a field (``String field had bad UTF-8``). ``DecodeErrorInterceptor``
makes every unary-request method answer it with INVALID_ARGUMENT and the parser's message,
before the servicer runs. Stream-request methods (the ring's internal links) are left as
they are: their peers are ringserve services that serialize with protobuf.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError


class _Undecodable:
    def __init__(self, error: str) -> None:
        self.error = error


def _safe(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None

    def parse(data: bytes) -> Any:
        try:
            return deserializer(data)
        except DecodeError as exc:
            return _Undecodable(str(exc))

    return parse


async def _refuse(request: _Undecodable, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"the request could not be parsed: {request.error}")


def _checked(behavior: Callable[..., Any]) -> Callable[..., Any]:
    if inspect.isasyncgenfunction(behavior):

        async def stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if isinstance(request, _Undecodable):
                await _refuse(request, context)
            async for item in behavior(request, context):
                yield item

        return stream

    async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, _Undecodable):
            await _refuse(request, context)
        result = behavior(request, context)
        return await result if inspect.isawaitable(result) else result

    return call


class DecodeErrorInterceptor(grpc.aio.ServerInterceptor):
    """INVALID_ARGUMENT for a unary request that does not parse (see the module docstring)."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        if handler is None or handler.request_streaming:
            return handler
        if handler.response_streaming:
            make, behavior = grpc.unary_stream_rpc_method_handler, handler.unary_stream
        else:
            make, behavior = grpc.unary_unary_rpc_method_handler, handler.unary_unary
        return make(
            _checked(behavior),
            request_deserializer=_safe(handler.request_deserializer),
            response_serializer=handler.response_serializer,
        )
