"""SSE keepalive on a launched ring: a stream held in the scheduler's queue gets comments at
the set interval, then its tokens, and the openai SDK parses the same chunks as from a stream
without comments.

On ``keyed_ring`` (tests/e2e/conftest.py: two request slots, ``--sse-keepalive-s 1``): two long
streams fill the slots, so a third request waits in the queue until they are cancelled.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import httpx
import openai
import pytest

from services.gateway.sse import KEEPALIVE
from tests.e2e.test_reliability_overload import saturating, wait_load
from tests.helpers.ring_requests import API_KEYS, PARIS, read_events

INTERVAL_S = 1.0  # keyed_ring's --sse-keepalive-s


@pytest.fixture
def ring(keyed_ring):
    return keyed_ring


class Recorded(httpx.AsyncByteStream):
    """A response body as the SDK reads it, each piece with its arrival time."""

    def __init__(self, inner: httpx.AsyncByteStream, pieces: list[tuple[float, bytes]]) -> None:
        self.inner = inner
        self.pieces = pieces

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for piece in self.inner:
            self.pieces.append((time.monotonic(), piece))
            yield piece

    async def aclose(self) -> None:
        await self.inner.aclose()


class Recording(httpx.AsyncHTTPTransport):
    """Records the raw bytes of every response body it carries."""

    def __init__(self) -> None:
        super().__init__()
        self.pieces: list[tuple[float, bytes]] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        resp = await super().handle_async_request(request)
        assert isinstance(resp.stream, httpx.AsyncByteStream)
        return httpx.Response(resp.status_code, headers=resp.headers, stream=Recorded(resp.stream, self.pieces),
                              extensions=resp.extensions)


async def sdk_stream(ring, transport: Recording) -> list[dict]:
    """The SDK's parsed chunks of a greedy streamed chat (without the per-request id and time)."""
    async with openai.AsyncOpenAI(base_url=f"{ring.base_url}/v1", api_key=API_KEYS[0], max_retries=0,
                                  http_client=httpx.AsyncClient(transport=transport, timeout=120)) as client:
        stream = await client.chat.completions.create(model=ring.model_name, messages=PARIS, max_tokens=8,
                                                      temperature=0, stream=True)
        return [c.model_dump(exclude={"id", "created"}) async for c in stream]


def frames(pieces: list[tuple[float, bytes]]) -> list[tuple[float, bytes]]:
    """(arrival time of its end, frame) per SSE frame (``...\\n\\n``) of the recorded body."""
    out, buf = [], b""
    for t, piece in pieces:
        buf += piece
        *done, buf = buf.split(b"\n\n")
        out.extend((t, f + b"\n\n") for f in done)
    assert buf == b""
    return out


async def test_a_queued_stream_gets_comments_at_the_interval_then_its_tokens_and_the_sdk_sees_no_difference(ring):
    ring.wait_idle()
    async with httpx.AsyncClient(base_url=ring.base_url, headers=ring.http_headers, timeout=120) as client:
        runners = [asyncio.create_task(read_events(client, saturating(ring), 10_000)) for _ in range(2)]
        await wait_load(ring, 2, 0)
        queued_transport = Recording()
        started = time.monotonic()
        queued = asyncio.create_task(sdk_stream(ring, queued_transport))
        await wait_load(ring, 2, 1)
        # Held in the queue: two comments, the first one interval after the request.
        deadline = time.monotonic() + 30
        while sum(f == KEEPALIVE for _, f in frames(queued_transport.pieces)) < 2:
            assert time.monotonic() < deadline and not queued.done()
            await asyncio.sleep(0.05)
        for r in runners:  # free the slots: the queued request runs
            r.cancel()
        await asyncio.gather(*runners, return_exceptions=True)
        with_comments = await queued

    got = frames(queued_transport.pieces)
    first_data = next(i for i, (_, f) in enumerate(got) if f.startswith(b"data: "))
    assert first_data >= 2 and all(f == KEEPALIVE for _, f in got[:first_data]), got[: first_data + 1]
    comment_times = [t for t, _ in got[:first_data]]
    assert comment_times[0] - started >= INTERVAL_S * 0.99
    assert all(b - a >= INTERVAL_S * 0.9 for a, b in zip(comment_times, comment_times[1:], strict=False)), comment_times
    assert got[-1][1] == b"data: [DONE]\n\n"

    # The same request on the idle ring: its first output comes within the interval, no comment.
    ring.wait_idle(timeout_s=15)
    plain_transport = Recording()
    without_comments = await sdk_stream(ring, plain_transport)
    assert not any(f == KEEPALIVE for _, f in frames(plain_transport.pieces))
    assert with_comments == without_comments
    assert "".join(c["choices"][0]["delta"]["content"] or "" for c in with_comments if c["choices"]) \
        == "The capital of France is Paris."
