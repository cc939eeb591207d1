"""The load generator's SSE reader on byte streams split at every awkward place: exact payloads."""

from __future__ import annotations

import asyncio

import httpx

from ringserve.bench.client import _sse_data


class _Chunks(httpx.AsyncByteStream):
    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks

    async def __aiter__(self):
        for chunk in self.chunks:
            yield chunk


def _payloads(chunks: list[bytes]) -> list[bytes]:
    async def run() -> list[bytes]:
        return [d async for d in _sse_data(httpx.Response(200, stream=_Chunks(chunks)))]

    return asyncio.run(run())


BODY = b'data: {"a": 1}\n\n: comment\ndata:{"b":"x\\ny"}\r\n\r\nevent: e\ndata: [DONE]\n\n'


def test_sse_payloads_are_the_data_lines_stripped():
    assert _payloads([BODY]) == [b'{"a": 1}', b'{"b":"x\\ny"}', b"[DONE]"]


def test_sse_payloads_do_not_depend_on_how_the_bytes_are_split():
    for size in (1, 2, 3, 7, 16):
        chunks = [BODY[i:i + size] for i in range(0, len(BODY), size)]
        assert _payloads(chunks) == [b'{"a": 1}', b'{"b":"x\\ny"}', b"[DONE]"], size


def test_a_last_line_without_newline_is_still_read():
    assert _payloads([b"data: 1\n\ndata: 2"]) == [b"1", b"2"]
