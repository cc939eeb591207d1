"""Server-sent events framing and client-disconnect handling.

Each event is exactly ``data: <one-line JSON>\\n\\n``; a stream ends with ``data: [DONE]\\n\\n``.
orjson never emits a raw newline (it escapes them inside strings), so one event is one line.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

import orjson
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from .errors import GatewayError

DONE = b"data: [DONE]\n\n"
T = TypeVar("T")


def event(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def error_event(exc: GatewayError) -> bytes:
    """The one event that reports an error after streaming started (then ``DONE`` follows)."""
    return event(exc.body())


def response(body: AsyncIterator[bytes]) -> StreamingResponse:
    """SSE response. Starlette cancels ``body`` when the client disconnects; the generators
    that feed it cancel their gRPC call in ``finally``."""
    return StreamingResponse(
        body,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


def json_response(obj: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(obj), status, media_type="application/json")


class ClientDisconnected(Exception):
    """The HTTP client went away before the response could be sent."""


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``, cancelling it if the client disconnects first.

    Used for everything awaited before the response starts (a non-stream request's whole
    generation, a stream's first output), since no response write can notice the
    disconnect then. The request body must already have been read.

    Raises:
        ClientDisconnected: the client went away; ``work`` was cancelled (and with it the
            gRPC call, which makes the tokenizer abort the rid).
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(BaseException):
        await task
    raise ClientDisconnected()
