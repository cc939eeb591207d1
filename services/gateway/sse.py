"""Server-sent events framing, keepalive comments and client-disconnect handling.

Each event is exactly ``data: <one-line JSON>\\n\\n``; a stream ends with ``data: [DONE]\\n\\n``.
orjson never emits a raw newline (it escapes them inside strings), so one event is one line.

Keepalive: while a stream has had nothing to send for ``--sse-keepalive-s`` seconds, it sends
the SSE comment ``: keepalive\\n\\n`` (a line starting with ``:``, which the SSE spec tells every
client to ignore), so that proxies and load balancers with idle timeouts (nginx's
``proxy_read_timeout`` is 60 s) do not cut a stream that waits in the scheduler's queue or
in a long prefill. ``response`` sends them between events; ``open_and_stream`` also starts
the response (200, then comments) when the first output takes longer than one interval, so
an error the tokenizer reports after that arrives as an error event, not an HTTP status.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any, TypeVar

import orjson
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from .errors import GatewayError

DONE = b"data: [DONE]\n\n"
KEEPALIVE = b": keepalive\n\n"
T = TypeVar("T")


def dumps(obj: Any) -> bytes:
    """``obj`` as compact JSON: orjson's, or the standard library's where orjson refuses an
    integer past 64 bits (JSON has no bound, and a client's schema, metadata or echoed item
    may hold one; the answer echoes them). Raises TypeError for what neither can encode."""
    try:
        return orjson.dumps(obj)
    except TypeError:
        return json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()


def event(obj: Any) -> bytes:
    return b"data: " + dumps(obj) + b"\n\n"


def error_event(exc: GatewayError) -> bytes:
    """The one event that reports an error after streaming started (then ``DONE`` follows)."""
    return event(exc.body())


def response(body: AsyncIterator[bytes]) -> StreamingResponse:
    """SSE response, with keepalive comments at the app's ``state.sse_keepalive_s`` (see
    ``KeepaliveResponse``). Starlette cancels ``body`` when the client disconnects; the
    generators that feed it cancel their gRPC call in ``finally``."""
    return KeepaliveResponse(
        body,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


def keepalive_s(app: Any) -> float:
    """The app's keepalive interval in seconds (``app.state.sse_keepalive_s``); 0 = none."""
    return float(getattr(getattr(app, "state", None), "sse_keepalive_s", 0.0) or 0.0)


class KeepaliveResponse(StreamingResponse):
    """A streaming response that sends ``KEEPALIVE`` whenever ``keepalive_s`` seconds pass
    without a chunk from the body (None: the interval of the app serving it, read from the
    ASGI scope, so every SSE route of the gateway has it).

    The body is iterated as Starlette does; a timer task sends the comments, under a lock so
    that two ``send`` calls never overlap, and only after the response has started. The cost
    per chunk is one uncontended lock and one clock read. A failing comment (client gone)
    stops the timer; the next chunk's send reports the disconnect as it would without it.
    """

    keepalive_s: float | None = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if self.keepalive_s is None:
            self.keepalive_s = keepalive_s(scope.get("app"))
        await super().__call__(scope, receive, send)

    async def stream_response(self, send: Any) -> None:
        interval = self.keepalive_s or 0.0
        if interval <= 0:
            await super().stream_response(send)
            return
        loop = asyncio.get_running_loop()
        lock = asyncio.Lock()
        last = loop.time()

        async def ping() -> None:
            nonlocal last
            while True:
                await asyncio.sleep(max(0.0, last + interval - loop.time()))
                if loop.time() - last < interval:
                    continue  # a chunk went out meanwhile
                async with lock:
                    try:
                        await send({"type": "http.response.body", "body": KEEPALIVE, "more_body": True})
                    except OSError:
                        return
                    last = loop.time()

        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        timer = asyncio.ensure_future(ping())
        try:
            async for chunk in self.body_iterator:
                data = chunk.encode(self.charset) if isinstance(chunk, str) else chunk
                async with lock:
                    await send({"type": "http.response.body", "body": data, "more_body": True})
                    last = loop.time()
        finally:
            timer.cancel()
            with contextlib.suppress(BaseException):
                await timer
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def chat_error(exc: GatewayError) -> list[bytes]:
    """How a chat-style stream reports an error after it started: one error event, then ``DONE``."""
    return [error_event(exc), DONE]


async def open_and_stream(
    request: Request, opening: Awaitable[T], body_of: Callable[[T], AsyncIterator[bytes]],
    on_error: Callable[[GatewayError], Iterable[bytes]] = chat_error,
) -> StreamingResponse:
    """Await ``opening`` (the Generate calls up to their first output), then stream
    ``body_of(its result)`` as SSE.

    Within one keepalive interval (or, with keepalive off, however long it takes) this is
    ``response(body_of(await unless_disconnected(request, opening)))``: an error before the
    first output is raised here and answered with its HTTP status. Past the interval the
    response starts at once and sends keepalive comments while ``opening`` goes on; an error
    it raises then becomes the frames ``on_error`` gives (chat's: one error event and ``[DONE]``),
    and a client that leaves cancels it.

    Raises:
        GatewayError: ``opening`` failed within the first interval.
        ClientDisconnected: the client went away within the first interval.
    """
    interval = keepalive_s(request.app)
    if interval <= 0:
        return response(body_of(await unless_disconnected(request, opening)))
    task = asyncio.ensure_future(opening)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait((task, watcher), timeout=interval, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        watcher.cancel()
        raise
    if task in done:
        watcher.cancel()
        return response(body_of(task.result()))
    if watcher in done:
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        raise ClientDisconnected()
    return response(_after_opening(task, watcher, body_of, on_error))


async def _after_opening(task: asyncio.Future[T], watcher: asyncio.Future[None],
                         body_of: Callable[[T], AsyncIterator[bytes]],
                         on_error: Callable[[GatewayError], Iterable[bytes]]) -> AsyncIterator[bytes]:
    """The body of a stream whose response started before its first output: a comment at
    once (the client has waited one interval already), the timer's comments while ``task``
    goes on, then its events."""
    try:
        yield KEEPALIVE
        done, _ = await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
        if task not in done:
            return  # the client went away; ``finally`` cancels the calls being opened
        watcher.cancel()
        try:
            result = task.result()
        except GatewayError as exc:
            for frame in on_error(exc):
                yield frame
            return
        async for chunk in body_of(result):
            yield chunk
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task


def json_response(obj: Any, status: int = 200) -> Response:
    return Response(dumps(obj), status, media_type="application/json")


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
