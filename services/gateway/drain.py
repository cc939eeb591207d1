"""Graceful drain of the gateway on SIGTERM (a pod's or a container's stop).

On the first SIGTERM or SIGINT the gateway drains: every new request gets 503
``service_unavailable_error`` with ``Retry-After`` and ``Connection: close`` (``/health`` too,
so a readiness probe takes the pod out of its Service; ``/metrics`` keeps answering), the
requests already in flight, streams included, go on, and once none is left, or after
``--grace-period`` seconds, uvicorn shuts down: it closes the listening socket and idle
connections and gives what still runs ``CUT_AFTER_S`` before cancelling it. The process then
exits 0. A second signal during the drain ends it at once.

uvicorn alone would stop accepting connections on SIGTERM (a client then sees a refused
connection, not an error it can read), wait for open connections without a bound, and then
re-raise the signal (exit status 143).
"""

from __future__ import annotations

import logging
import signal
import time
from types import FrameType

import orjson
import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send

from .errors import GatewayError

logger = logging.getLogger(__name__)

# Still answered while draining: Prometheus scrapes the pod until it is gone.
OPEN_WHILE_DRAINING = frozenset({"/metrics"})
# After the grace period, what is still running gets this long before it is cancelled.
CUT_AFTER_S = 1.0


class Drain:
    """The drain state one gateway process shares between its app and its server.

    ``in_flight`` counts HTTP requests whose response has not ended (a stream counts until
    its last event); ``deadline`` is the monotonic time the drain ends at, None until
    ``begin``.
    """

    def __init__(self) -> None:
        self.in_flight = 0
        self.deadline: float | None = None

    @property
    def draining(self) -> bool:
        return self.deadline is not None

    def begin(self, grace_s: float) -> None:
        """Start draining: refuse new requests; let in-flight ones run for ``grace_s`` seconds."""
        if self.deadline is None:
            self.deadline = time.monotonic() + grace_s

    def done(self) -> bool:
        """Whether the drain is over: nothing in flight, or the grace period has passed."""
        return self.deadline is not None and (self.in_flight == 0 or time.monotonic() >= self.deadline)


def _draining_response() -> tuple[dict, bytes]:
    error = GatewayError("the gateway is shutting down; retry on another instance", 503,
                         "service_unavailable_error", code="service_unavailable", retry_after=True)
    body = orjson.dumps(error.body())
    start = {"type": "http.response.start", "status": 503, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
        (b"retry-after", b"1"), (b"connection", b"close")]}
    return start, body


class DrainMiddleware:
    """Pure ASGI (it must not buffer SSE): counts in-flight requests, and answers 503 to a
    new one while the gateway drains."""

    def __init__(self, app: ASGIApp, drain: Drain) -> None:
        self.app = app
        self.drain = drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.drain.draining and scope["path"] not in OPEN_WHILE_DRAINING:
            start, body = _draining_response()
            await send(start)
            await send({"type": "http.response.body", "body": body})
            return
        self.drain.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.in_flight -= 1


class DrainingServer(uvicorn.Server):
    """uvicorn's server with the gateway's drain (module docstring) in place of its own
    SIGTERM/SIGINT handling; ``serve`` returns normally, so the process exits 0."""

    def __init__(self, config: uvicorn.Config, drain: Drain, grace_s: float) -> None:
        super().__init__(config)
        self.drain = drain
        self.grace_s = grace_s

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not uvicorn's: it records the signal to raise it again after the shutdown.
        if self.drain.draining:
            logger.warning("second %s: stopping without waiting for %d request(s)",
                           signal.Signals(sig).name, self.drain.in_flight)
            self.should_exit = self.force_exit = True
            return
        logger.info("%s: draining %d in-flight request(s) for up to %g s",
                    signal.Signals(sig).name, self.drain.in_flight, self.grace_s)
        self.drain.begin(self.grace_s)

    async def on_tick(self, counter: int) -> bool:
        # Every 0.1 s in uvicorn's main loop: leave it (and shut down) once the drain is over.
        if self.drain.done():
            if self.drain.in_flight:
                logger.warning("grace period over: cutting %d request(s)", self.drain.in_flight)
            return True
        return await super().on_tick(counter)


def serve(app: ASGIApp, drain: Drain, grace_s: float, **uvicorn_kwargs: object) -> None:
    """Run ``app`` under uvicorn (``uvicorn_kwargs`` as ``uvicorn.Config`` takes them) until a
    signal's drain is over; returns normally (exit status 0)."""
    config = uvicorn.Config(app, timeout_graceful_shutdown=CUT_AFTER_S, **uvicorn_kwargs)  # type: ignore[arg-type]
    DrainingServer(config, drain, grace_s).run()
