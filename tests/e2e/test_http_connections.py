"""HTTP/1.x connection handling of the gateway, over raw sockets.

An HTTP/1.0 client gets its stream close-delimited (HTTP/1.0 has no chunked coding),
checked on the shared ring's own gateway. The read timeouts are checked on a second gateway
process started here with one-second timeouts in front of the shared ring's tokenizer (a
gateway holds no state, so no ring of its own is needed): a request head that trickles in
gets 408 one second after its first byte, a body that stalls gets 408, a body whose reads
come less than a second apart is served, an idle connection is closed (fresh or after a
response), and requests that take longer than every timeout, streamed or not, are
unaffected.
"""

from __future__ import annotations

import asyncio
import json
import select
import socket
import time
from collections.abc import Iterator

import httpx
import orjson
import pytest

from tests.helpers.ring_requests import chat
from tests.helpers.ringstack import Stack, launched_gateway

TIMEOUT_S = 1.0
PARIS = "The capital of France is Paris."


def request_bytes(path: str, body: dict, version: str = "1.1", close: bool = False) -> bytes:
    data = orjson.dumps(body)
    head = (f"POST {path} HTTP/{version}\r\nHost: test\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n" + ("Connection: close\r\n" if close else "") + "\r\n")
    return head.encode() + data


# The server's timers run on its event loop's clock, which it reads once a loop turn, in whole
# milliseconds under uvloop: a close can come a fraction of a millisecond before one timeout by
# the client's clock (0.99988 s seen once in make test).
EARLY_S = TIMEOUT_S - 0.01


def talk(port: int, pieces: list[bytes], gap_s: float = 0.0) -> tuple[bytes, float]:
    """Send ``pieces`` ``gap_s`` apart while watching for an answer, then read until the server
    closes. Returns (every byte that came back, seconds from the first piece sent to the close)."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        started = time.monotonic()
        for i, piece in enumerate(pieces):
            if i and select.select([sock], [], [], gap_s)[0]:
                break  # the server answered (and closes) before the client finished
            sock.sendall(piece)
        sock.settimeout(30)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
        return data, time.monotonic() - started


def read_response(sock: socket.socket) -> bytes:
    """One whole response with a Content-Length from a keep-alive connection."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    length = int(split_response(data)[1]["content-length"])
    while len(data.partition(b"\r\n\r\n")[2]) < length:
        data += sock.recv(65536)
    return data


def split_response(data: bytes) -> tuple[str, dict[str, str], bytes]:
    head, _, body = data.partition(b"\r\n\r\n")
    status, *lines = head.decode().split("\r\n")
    return status, {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines)}, body


def timeout_408(data: bytes, message: str) -> None:
    status, headers, body = split_response(data)
    assert status == "HTTP/1.1 408 Request Timeout"
    assert headers["connection"] == "close" and headers["content-type"] == "application/json"
    assert json.loads(body) == {"error": {"message": message, "type": "invalid_request_error", "param": None,
                                          "code": "request_timeout"}}


@pytest.fixture(scope="module")
def gateway(stack: Stack, tmp_path_factory) -> Iterator[int]:
    """The port of a gateway with one-second header, body and idle timeouts on the shared
    ring's tokenizer; nothing it logged is a traceback."""
    log = tmp_path_factory.mktemp("gateway") / "gateway.log"
    flags = [arg for kind in ("header", "body", "idle") for arg in (f"--http-{kind}-timeout", str(TIMEOUT_S))]
    with launched_gateway(stack.tokenizer, *flags, log_path=log) as base:
        yield int(base.rsplit(":", 1)[1])
    assert "Traceback" not in log.read_text()


def test_http10_stream_is_close_delimited(stack):
    """RFC 9112 §6.1/§6.3: no Transfer-Encoding to an HTTP/1.0 client; the close ends the body."""
    port = int(stack.base_url.rsplit(":", 1)[1])
    body = chat(stack, max_tokens=16, stream=True)
    data, _ = talk(port, [request_bytes("/v1/chat/completions", body, version="1.0")])
    status, headers, payload = split_response(data)
    assert status == "HTTP/1.1 200 OK"
    assert "transfer-encoding" not in headers and "content-length" not in headers
    assert headers["connection"] == "close" and headers["content-type"].startswith("text/event-stream")
    events = payload.decode().split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == PARIS
    # HTTP/1.1 still gets chunked coding.
    data, _ = talk(port, [request_bytes("/v1/chat/completions", body, close=True)])
    assert split_response(data)[1]["transfer-encoding"] == "chunked"
    stack.wait_idle()


def test_request_head_gets_408_one_timeout_after_its_first_byte(gateway):
    port = gateway
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
    # One header line every 0.3 s: each gap is shorter than the timeout, the whole head is not.
    data, took = talk(port, [head, *(b"X-Slow-%d: 1\r\n" % i for i in range(20))], gap_s=0.3)
    timeout_408(data, "the request head did not arrive within 1 s (--http-header-timeout)")
    assert EARLY_S <= took < TIMEOUT_S + 2.0, took


def test_stalled_body_gets_408_and_a_slow_one_is_served(gateway, stack):
    port = gateway
    whole = request_bytes("/v1/chat/completions", chat(stack, max_tokens=16))
    cut = whole.index(b"\r\n\r\n") + 4 + 10
    data, took = talk(port, [whole[:cut]])
    timeout_408(data, "the request body stalled for 1 s (--http-body-timeout)")
    assert EARLY_S <= took < TIMEOUT_S + 2.0, took
    # The same body in three parts 0.6 s apart: 1.2 s in all, no gap of a second.
    third = (len(whole) - cut) // 3
    parts = [whole[:cut], whole[cut:cut + third], whole[cut + third:cut + 2 * third], whole[cut + 2 * third:]]
    data, took = talk(port, parts, gap_s=0.6)
    status, _, body = split_response(data)
    assert status == "HTTP/1.1 200 OK" and took >= 1.8, (status, took)
    assert json.loads(body)["choices"][0]["message"]["content"] == PARIS
    stack.wait_idle()


def test_idle_connections_are_closed(gateway):
    port = gateway
    data, took = talk(port, [])  # connects, never sends
    assert data == b"" and EARLY_S <= took < TIMEOUT_S + 2.0, took
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.settimeout(30)
        for _ in range(2):  # keep-alive: a second request 0.3 s after the first is served
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: test\r\n\r\n")
            answer = read_response(sock)
            assert answer.startswith(b"HTTP/1.1 200 OK"), answer
            time.sleep(0.3)
        answered = time.monotonic() - 0.3
        assert sock.recv(65536) == b""  # closed by the server
        # The server's clock starts when it sent the response, a little before it arrived here:
        # the lower bound only tells the idle limit from a close at once.
        assert TIMEOUT_S / 2 <= time.monotonic() - answered < TIMEOUT_S + 2.0


async def test_generations_longer_than_every_timeout_are_unaffected(gateway, stack):
    """A streamed and a plain generation, each running longer than the timeouts, side by side."""
    port = gateway
    story = [{"role": "user", "content": "Write a very long story."}]

    async def streamed(client: httpx.AsyncClient) -> tuple[list[str], float]:
        body = chat(stack, story, max_tokens=40, stream=True, ignore_eos=True, stream_options={"include_usage": True})
        started = time.monotonic()
        async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
            assert resp.status_code == 200
            return [line async for line in resp.aiter_lines() if line.startswith("data: ")], time.monotonic() - started

    async def plain(client: httpx.AsyncClient) -> tuple[httpx.Response, float]:
        started = time.monotonic()
        resp = await client.post("/v1/chat/completions", json=chat(stack, story, max_tokens=40, ignore_eos=True))
        return resp, time.monotonic() - started

    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=120) as client:
        (events, stream_took), (resp, plain_took) = await asyncio.gather(streamed(client), plain(client))
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["usage"]["completion_tokens"] == 40
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 40
    assert min(stream_took, plain_took) > TIMEOUT_S, (stream_took, plain_took)  # else this checks nothing
    stack.wait_idle()
