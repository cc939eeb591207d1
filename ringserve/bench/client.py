"""One streamed OpenAI request, timed chunk by chunk (vLLM ``backend_request_func``,
SGLang ``async_request_openai_completions``)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import httpx
import orjson

from ringserve.bench.dataset import BenchRequest
from ringserve.bench.metrics import RequestResult

ENDPOINT_PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


def request_body(endpoint: str, model: str, req: BenchRequest, prompt_format: str) -> dict:
    """The JSON body for ``req``: greedy, streamed with a usage chunk, ``ignore_eos`` and
    ``max_tokens = output_len`` so every request produces exactly ``output_len`` tokens.

    ``prompt_format`` "ids" sends ``prompt`` as a list of token ids (completions only);
    "text" sends ``req.prompt_text``.
    """
    body: dict = {
        "model": model,
        "max_tokens": req.output_len,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": req.prompt_text}]
    elif prompt_format == "ids":
        body["prompt"] = list(req.prompt_ids)
    else:
        body["prompt"] = req.prompt_text
    return body


def _chunk_text(chunk: dict, endpoint: str) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    if endpoint == "chat":
        delta = choices[0].get("delta") or {}
        return (delta.get("content") or "") + (delta.get("reasoning_content") or "")
    return choices[0].get("text") or ""


async def _sse_data(resp: httpx.Response) -> AsyncIterator[bytes]:
    """The payload of each ``data:`` line of an SSE body, stripped, as it arrives.

    Splits the received bytes itself: httpx's ``aiter_lines`` (a text decoder and a line
    decoder over ``aiter_bytes``) cost the load generator about as much CPU per streamed
    token as a whole ringserve front service, on the cores the server under test uses.
    Lines end with LF or CRLF (a lone CR does not occur in these servers' streams).
    """
    pending = b""
    async for raw in resp.aiter_bytes():
        lines = (pending + raw).split(b"\n")
        pending = lines.pop()
        for line in lines:
            if line.startswith(b"data:"):
                yield line[5:].strip()
    if pending.startswith(b"data:"):
        yield pending[5:].strip()


async def send_request(
    client: httpx.AsyncClient, base_url: str, endpoint: str, body: dict, prompt_len: int
) -> RequestResult:
    """POST ``body`` and read its SSE stream.

    A chunk with non-empty text counts as a content chunk (TTFT, ITL). Output tokens come
    from the usage chunk (``stream_options.include_usage``), else the content-chunk count;
    the prompt length likewise from usage, else ``prompt_len``. Never raises: HTTP errors,
    SSE error events and transport errors give ``success=False`` with ``error`` set.
    """
    result = RequestResult(success=False, prompt_len=prompt_len)
    text_parts: list[str] = []
    usage: dict | None = None
    result.start_time = time.perf_counter()
    try:
        async with client.stream("POST", base_url + ENDPOINT_PATHS[endpoint], json=body) as resp:
            if resp.status_code != 200:
                result.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:500]}"
                result.end_time = time.perf_counter()
                return result
            async for data in _sse_data(resp):
                if data == b"[DONE]":
                    break
                now = time.perf_counter()
                chunk = orjson.loads(data)
                if "error" in chunk:
                    result.error = str(chunk["error"])[:500]
                    break
                text = _chunk_text(chunk, endpoint)
                if text:
                    result.chunk_times.append(now)
                    text_parts.append(text)
                if chunk.get("usage"):
                    usage = chunk["usage"]
    except (httpx.HTTPError, orjson.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    result.end_time = time.perf_counter()
    result.generated_text = "".join(text_parts)
    if usage:
        result.output_tokens = int(usage.get("completion_tokens") or 0)
        result.prompt_len = int(usage.get("prompt_tokens") or prompt_len)
    else:
        result.output_tokens = len(result.chunk_times)
    result.success = not result.error
    return result
