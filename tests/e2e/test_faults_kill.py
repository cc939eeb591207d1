"""Issue 6, faults: a service SIGKILLed or SIGTERMed under load, on a ring of its own.

The launcher runs with ``--restart-on-failure``, so a killed service comes back on the
same port and the others reconnect with backoff; nothing else is restarted. Every
in-flight request ends within 2 s of a kill (an error event mid-stream, 503 before the
first byte), never hangs; after the restart new requests succeed and every service is back
to baseline. SIGTERM lets in-flight requests finish (``--grace-period``) and exits 0.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import pytest

from tests.ringstack import launched
from .test_reliability_endpaths import chat

PARIS = "The capital of France is Paris."


@pytest.fixture(scope="module")
def ring(smollm2_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("faults") / "ring.log"
    with launched(smollm2_dir, "--restart-on-failure", "--grace-period", "5", log_path=log) as s:
        yield s


def long_story(ring, stream: bool) -> dict:
    return chat(ring, [{"role": "user", "content": "Write a very long story."}], max_tokens=2000,
                stream=stream, ignore_eos=True)


async def read_stream(client: httpx.AsyncClient, body: dict,
                      first_event: asyncio.Event | None = None) -> tuple[list[dict | str], float]:
    """Read a whole SSE response: (its events, parsed; [DONE] as the string, monotonic end time).
    ``first_event`` is set when the first event has arrived."""
    events: list[dict | str] = []
    async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200, await resp.aread()
        async for line in resp.aiter_lines():
            if line.startswith("data: "):
                events.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
                if first_event is not None:
                    first_event.set()
    return events, time.monotonic()


async def post(client: httpx.AsyncClient, body: dict) -> tuple[httpx.Response, float]:
    resp = await client.post("/v1/chat/completions", json=body)
    return resp, time.monotonic()


async def wait_until(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"not {what} after {timeout_s} s"
        await asyncio.sleep(0.1)


async def kill_under_load(ring, service: str) -> None:
    """Two requests in flight (streamed, not streamed); SIGKILL ``service``; both end fast with an error."""
    ring.wait_idle()
    async with httpx.AsyncClient(base_url=ring.base_url, timeout=60) as client:
        streamed = asyncio.create_task(read_stream(client, long_story(ring, True)))
        whole = asyncio.create_task(post(client, long_story(ring, False)))
        await wait_until(lambda: ring.scheduler_load().num_running_reqs == 2, 30, "running 2")
        await asyncio.sleep(0.3)
        killed_at = time.monotonic()
        ring.kill(service)
        events, stream_end = await asyncio.wait_for(streamed, 10)
        resp, whole_end = await asyncio.wait_for(whole, 10)
    assert stream_end - killed_at < 2.0 and whole_end - killed_at < 2.0, (stream_end - killed_at, whole_end - killed_at)
    assert events[-1] == "[DONE]"
    error = events[-2]["error"]
    assert error["type"] == "service_unavailable_error", error
    assert resp.status_code == 503, resp.text
    assert resp.json()["error"]["type"] == "service_unavailable_error"
    assert "retry-after" in resp.headers


async def serves_again(ring, timeout_s: float = 120) -> None:
    """The killed service is back: readiness (/health_generate: one token through the whole
    ring) 200, then a request succeeds, everything back to baseline. /health alone is
    liveness: it can be 200 while a restarted peer is still reconnecting."""
    async with httpx.AsyncClient(base_url=ring.base_url, timeout=60) as client:
        deadline = time.monotonic() + timeout_s
        while (await client.get("/health_generate")).status_code != 200:
            assert time.monotonic() < deadline, "the gateway's /health_generate did not come back"
            await asyncio.sleep(0.2)
        resp = await client.post("/v1/chat/completions", json=chat(ring, max_tokens=16))
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["message"]["content"] == PARIS
    ring.wait_idle(timeout_s=5)


async def test_scheduler_killed_mid_stream(ring):
    others = {name: ring.pid(name) for name in ("gateway", "tokenizer", "detokenizer")}
    await kill_under_load(ring, "scheduler")
    async with httpx.AsyncClient(base_url=ring.base_url, timeout=10) as client:
        down = await client.post("/v1/chat/completions", json=chat(ring, max_tokens=4))
        assert down.status_code == 503 and "retry-after" in down.headers, down.text
        assert (await client.get("/health")).status_code == 503
    await serves_again(ring)
    assert {name: ring.pid(name) for name in others} == others  # nothing else restarted


async def test_detokenizer_killed_mid_stream(ring):
    others = {name: ring.pid(name) for name in ("gateway", "tokenizer", "scheduler")}
    await kill_under_load(ring, "detokenizer")
    await serves_again(ring)
    assert {name: ring.pid(name) for name in others} == others


async def test_tokenizer_killed_gateway_503_until_back(ring):
    others = {name: ring.pid(name) for name in ("gateway", "scheduler", "detokenizer")}
    await kill_under_load(ring, "tokenizer")
    async with httpx.AsyncClient(base_url=ring.base_url, timeout=10) as client:
        t0 = time.monotonic()
        down = await client.post("/v1/chat/completions", json=chat(ring, max_tokens=4))
        assert down.status_code == 503 and time.monotonic() - t0 < 5, down.text
    await serves_again(ring)
    assert {name: ring.pid(name) for name in others} == others


async def finishes_through_sigterm(ring, send_sigterm) -> None:
    """A 40-token stream is running when ``send_sigterm()`` runs; it still ends normally.

    The signal goes once the first event reached the client, so that every service holds
    the request (before its first output the detokenizer has no state for it)."""
    ring.wait_idle()
    async with httpx.AsyncClient(base_url=ring.base_url, timeout=60) as client:
        body = chat(ring, [{"role": "user", "content": "Write a very long story."}], max_tokens=40,
                    stream=True, ignore_eos=True)
        first_event = asyncio.Event()
        streamed = asyncio.create_task(read_stream(client, body, first_event))
        await asyncio.wait_for(first_event.wait(), 30)
        assert ring.scheduler_load().num_running_reqs == 1
        send_sigterm()
        events, _ = await asyncio.wait_for(streamed, 30)
    finishes = [c["finish_reason"] for e in events if isinstance(e, dict) for c in e.get("choices", [])]
    assert finishes[-1] == "length", events[-3:]


@pytest.mark.parametrize("service", ["scheduler", "tokenizer", "detokenizer"])
async def test_sigterm_lets_in_flight_finish_then_exits_0(ring, service):
    exits_before = ring.log().count(f"{service} exited with status 0")
    # The launcher starts the service again once it has exited.
    await finishes_through_sigterm(ring, lambda: os.kill(ring.pid(service), signal.SIGTERM))
    await wait_until(lambda: ring.log().count(f"{service} exited with status 0") == exits_before + 1, 15,
                     f"{service} exited 0")
    await serves_again(ring)


async def test_sigterm_on_the_launcher_finishes_in_flight_then_exits_0(ring):
    """Last in the module: stops the ring. The launcher stops the gateway first, then the rest."""
    await finishes_through_sigterm(ring, lambda: ring.proc.send_signal(signal.SIGTERM))
    assert await asyncio.to_thread(ring.proc.wait, 60) == 0
    for name in ("gateway", "tokenizer", "scheduler", "detokenizer"):
        assert f"{name} did not stop in time" not in ring.log()
