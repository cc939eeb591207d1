"""The gateway's HTTP/1.1 server: uvicorn's h11 protocol plus the read timeouts it lacks.

h11 frames every response by the request's HTTP version (RFC 9112 §6): a streamed answer
to an HTTP/1.0 request is close-delimited (no ``Transfer-Encoding``, ``Connection:
close``), where uvicorn's httptools protocol sends HTTP/1.0 clients chunked coding, which
HTTP/1.0 does not have. It costs the gateway about 8 % more CPU per streamed token
(measured with a fake tokenizer: 219 against 202 us of gateway CPU per SSE event, the mean
of four runs each, on a shared machine where runs spread by 10 %).

uvicorn closes a keep-alive connection that stays silent after a response
(``timeout_keep_alive``) and nothing else: a connection that never sends, sends half a
request head, or stops half-way through a body stays open. ``TimedH11Protocol`` keeps one
deadline per connection, chosen from h11's view of the client's side (``their_state``):

- idle (``HttpTimeouts.idle_s``): no request in progress and no byte of the next one, from
  the accept (after a response uvicorn's keep-alive timer, given the same value, does it):
  the connection is closed without a response.
- header (``header_s``): from the first byte of a request head to its end, however the
  bytes trickle in (as Node's ``headersTimeout``): 408 and close.
- body (``body_s``): the longest gap between two reads of a request body (as nginx's
  ``client_body_timeout``); it does not run while the server itself has paused reading
  (flow control): 408 when no response has started, else close.

A request whose head and body have arrived has no deadline here: a long generation or a
streamed response that is still sending is not idle (``--request-timeout`` bounds those).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import h11
import orjson
from uvicorn.protocols.http.h11_impl import H11Protocol

from .config import HttpTimeouts
from .errors import GatewayError

logger = logging.getLogger(__name__)


def _timeout_response(message: str) -> bytes:
    """A whole 408 response with an OpenAI error object, for a connection about to close."""
    body = orjson.dumps(GatewayError(message, 408, "invalid_request_error", None, "request_timeout").body())
    head = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body))
    return head + body


class TimedH11Protocol(H11Protocol):
    """uvicorn's ``H11Protocol`` with the idle, header and body deadlines of ``timeouts``.

    Pass it to uvicorn as ``http=functools.partial(TimedH11Protocol, timeouts=...)`` with
    ``timeout_keep_alive=timeouts.idle_s``.
    """

    def __init__(self, *args: Any, timeouts: HttpTimeouts, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.timeouts = timeouts
        self._deadline: asyncio.TimerHandle | None = None
        self._waiting_for: str | None = None  # "idle", "header" or "body" while a deadline runs

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm("idle", self.timeouts.idle_s)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        # Runs after every read and after every response (pipelined requests): each time
        # h11's state says what the connection waits for now.
        super().handle_events()
        self._follow()

    def _follow(self) -> None:
        state = self.conn.their_state
        if state is h11.SEND_BODY:
            self._arm("body", self.timeouts.body_s)  # every read restarts it: a gap, not a total
        elif state is h11.IDLE and self.conn.trailing_data[0]:
            if self._waiting_for != "header":  # from the head's first byte; later bytes do not extend it
                self._arm("header", self.timeouts.header_s)
        elif state is h11.IDLE and self.timeout_keep_alive_task is None:
            if self._waiting_for != "idle":
                self._arm("idle", self.timeouts.idle_s)
        else:
            self._disarm()  # a whole request is in (or uvicorn's keep-alive timer runs)

    def _arm(self, kind: str, seconds: float) -> None:
        self._disarm()
        self._waiting_for = kind
        self._deadline = self.loop.call_later(seconds, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline = None
        self._waiting_for = None

    def _expired(self) -> None:
        kind = self._waiting_for
        self._deadline = None
        self._waiting_for = None
        if self.transport.is_closing():
            return
        if kind == "body" and self.flow.read_paused:  # the server stopped reading, not the client
            self._arm("body", self.timeouts.body_s)
            return
        logger.debug("closing %s: %s timeout", self.client, kind)
        if kind == "idle":
            self.timeout_keep_alive_handler()
            return
        if kind == "header":
            message = f"the request head did not arrive within {self.timeouts.header_s:g} s (--http-header-timeout)"
        else:
            message = f"the request body stalled for {self.timeouts.body_s:g} s (--http-body-timeout)"
        if kind == "header" or self.cycle is None or not self.cycle.response_started:
            self.transport.write(_timeout_response(message))
        # The app, if it waits for the body, sees the client's disconnect (connection_lost).
        self.transport.close()
