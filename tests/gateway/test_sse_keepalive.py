"""SSE keepalive comments (services/gateway/sse.py), driven as ASGI with fake sources.

The sources wait on events the fake ``send`` sets once it has seen a given number of
comments, so the expected bytes are exact whatever the machine's speed; only lower bounds
of time are checked (a comment never comes before its interval has passed).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from types import SimpleNamespace

import pytest
from starlette.requests import Request

from services.gateway import sse
from services.gateway.errors import GatewayError

pytestmark = pytest.mark.asyncio

INTERVAL = 0.1
EVENTS = [sse.event({"n": 1}), sse.event({"n": 2})]


class Client:
    """A fake ASGI server side: records what the response sends; ``comments(k)`` is set
    once ``k`` keepalives have gone out."""

    def __init__(self, comments_before_data: int) -> None:
        self.messages: list[dict] = []
        self.times: list[float] = []
        self.start = time.monotonic()
        self.ready = asyncio.Event()
        self.wanted = comments_before_data

    async def send(self, message: dict) -> None:
        self.messages.append(message)
        self.times.append(time.monotonic())
        if sum(m.get("body") == sse.KEEPALIVE for m in self.messages) >= self.wanted:
            self.ready.set()

    @staticmethod
    async def receive() -> dict:
        await asyncio.sleep(3600)  # the client never leaves
        raise AssertionError("unreachable")

    @property
    def body(self) -> bytes:
        assert self.messages[0]["type"] == "http.response.start" and self.messages[0]["status"] == 200
        assert self.messages[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
        return b"".join(m["body"] for m in self.messages[1:])

    def comment_times(self) -> list[float]:
        return [t for m, t in zip(self.messages, self.times, strict=True) if m.get("body") == sse.KEEPALIVE]


def app(keepalive_s: float) -> SimpleNamespace:
    return SimpleNamespace(state=SimpleNamespace(sse_keepalive_s=keepalive_s))


def scope(keepalive_s: float) -> dict:
    return {"type": "http", "asgi": {"spec_version": "2.4"}, "app": app(keepalive_s), "method": "POST",
            "path": "/", "headers": []}


async def waiting_source(client: Client, gap_comments: int = 0) -> AsyncIterator[bytes]:
    """Nothing until ``client`` has seen its comments; then the first event, then (after
    ``gap_comments`` more comments) the second and [DONE]."""
    await client.ready.wait()
    yield EVENTS[0]
    if gap_comments:
        client.wanted += gap_comments
        client.ready.clear()
        await client.ready.wait()
    yield EVENTS[1]
    yield sse.DONE


async def test_comments_while_the_source_waits_then_the_events_exactly() -> None:
    client = Client(comments_before_data=2)
    await sse.response(waiting_source(client, gap_comments=1))(scope(INTERVAL), client.receive, client.send)
    assert client.body == sse.KEEPALIVE * 2 + EVENTS[0] + sse.KEEPALIVE + EVENTS[1] + sse.DONE
    times = client.comment_times()
    # Each comment comes a whole interval after the last thing sent (start, comment or event).
    sent = [client.times[0]] + times
    assert all(b - a >= INTERVAL * 0.99 for a, b in zip(sent[:2], times[:2], strict=True)), times
    event_time = client.times[[m.get("body") for m in client.messages].index(EVENTS[0])]
    assert times[2] - event_time >= INTERVAL * 0.99


async def test_no_comment_between_events_that_come_in_time_nor_with_keepalive_off() -> None:
    async def quick() -> AsyncIterator[bytes]:
        for e in EVENTS:
            await asyncio.sleep(INTERVAL / 10)
            yield e
        yield sse.DONE

    for keepalive in (INTERVAL, 0.0):
        client = Client(comments_before_data=1)
        await sse.response(quick())(scope(keepalive), client.receive, client.send)
        assert client.body == EVENTS[0] + EVENTS[1] + sse.DONE

    client = Client(comments_before_data=1)
    slow = asyncio.create_task(sse.response(waiting_source(client))(scope(0.0), client.receive, client.send))
    await asyncio.sleep(INTERVAL * 3)
    assert [m["type"] for m in client.messages] == ["http.response.start"]  # off: silence
    client.ready.set()
    await slow
    assert client.body == EVENTS[0] + EVENTS[1] + sse.DONE


def request(client: Client, keepalive_s: float) -> Request:
    return Request(scope(keepalive_s), client.receive)


async def events_after(streams: list[bytes]) -> AsyncIterator[bytes]:
    for e in streams:
        yield e
    yield sse.DONE


async def test_open_and_stream_starts_the_response_with_comments_when_the_first_output_is_late() -> None:
    client = Client(comments_before_data=3)

    async def opening() -> list[bytes]:  # the Generate calls waiting in the scheduler's queue
        await client.ready.wait()
        return EVENTS

    t0 = time.monotonic()
    response = await sse.open_and_stream(request(client, INTERVAL), opening(), events_after)
    assert time.monotonic() - t0 >= INTERVAL * 0.99  # held back one interval first
    await response(scope(INTERVAL), client.receive, client.send)
    assert client.body == sse.KEEPALIVE * 3 + EVENTS[0] + EVENTS[1] + sse.DONE


async def test_open_and_stream_answers_in_time_as_before() -> None:
    async def fast() -> list[bytes]:
        return EVENTS

    async def refused() -> list[bytes]:
        raise GatewayError("too busy", 429, "rate_limit_error", code="server_overloaded")

    client = Client(comments_before_data=1)
    response = await sse.open_and_stream(request(client, INTERVAL), fast(), events_after)
    await response(scope(INTERVAL), client.receive, client.send)
    assert client.body == EVENTS[0] + EVENTS[1] + sse.DONE
    for keepalive in (INTERVAL, 0.0):  # an error within the interval is the HTTP status, as without keepalive
        with pytest.raises(GatewayError) as info:
            await sse.open_and_stream(request(client, keepalive), refused(), events_after)
        assert info.value.status == 429


async def test_an_error_after_the_response_started_is_one_error_event() -> None:
    client = Client(comments_before_data=2)

    async def refused_late() -> list[bytes]:
        await client.ready.wait()
        raise GatewayError("too busy", 429, "rate_limit_error", code="server_overloaded")

    response = await sse.open_and_stream(request(client, INTERVAL), refused_late(), events_after)
    await response(scope(INTERVAL), client.receive, client.send)
    error = GatewayError("too busy", 429, "rate_limit_error", code="server_overloaded")
    assert client.body == sse.KEEPALIVE * 2 + sse.error_event(error) + sse.DONE


async def test_an_error_after_the_response_started_is_what_the_route_frames() -> None:
    """/v1/responses frames a late error as response.created, response.in_progress and
    response.failed (no [DONE]): the route's ``on_error`` decides, not chat's framing."""
    client = Client(comments_before_data=1)

    async def refused_late() -> list[bytes]:
        await client.ready.wait()
        raise GatewayError("too busy", 429, "rate_limit_error", code="server_overloaded")

    def framed(exc: GatewayError) -> list[bytes]:
        return [sse.event({"type": "response.failed", "message": exc.message})]

    response = await sse.open_and_stream(request(client, INTERVAL), refused_late(), events_after, framed)
    await response(scope(INTERVAL), client.receive, client.send)
    assert client.body == sse.KEEPALIVE + sse.event({"type": "response.failed", "message": "too busy"})


async def test_a_client_leaving_during_the_wait_cancels_the_opening() -> None:
    left = asyncio.Event()
    cancelled = asyncio.Event()

    async def leaves() -> dict:
        await left.wait()
        return {"type": "http.disconnect"}

    async def opening() -> list[bytes]:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return EVENTS

    client = Client(comments_before_data=1)
    response = await sse.open_and_stream(Request(scope(INTERVAL), leaves), opening(), events_after)
    serving = asyncio.create_task(response(scope(INTERVAL), leaves, client.send))
    await client.ready.wait()
    left.set()
    await asyncio.wait_for(cancelled.wait(), 5)
    await asyncio.wait_for(serving, 5)
    assert client.body == sse.KEEPALIVE
