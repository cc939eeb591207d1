"""Requests to a launched ring's gateway (OpenAI chat completions) and what tests wait for:
a stream read whole or cut after a few events, the state released after aborts, the ring
serving again after a fault."""

from __future__ import annotations

import asyncio
import json
import time

import httpx

PARIS = [{"role": "user", "content": "What is the capital of France?"}]
PARIS_ANSWER = "The capital of France is Paris."  # SmolLM2-Instruct's greedy answer in fp32 (not in bf16)
PROMPT = "The three primary colors are"  # a completion prompt
# The two valid keys of tests/e2e/conftest.py's keyed_ring (a rotation: the current and the previous).
API_KEYS = ("sk-e2e-current-7Qx2v9", "sk-e2e-previous-Lm4k8Z")
# tests/e2e/conftest.py's priority_ring: its KV pool, and its service options beyond the policy and
# the slots, which test_launcher_pass_through.py follows to exactly the services that have each.
PRIORITY_KV_TOKENS = 128
PASS_THROUGH = {"--served-model-name": "tiny", "--context-length": "512", "--max-queued-requests": "7",
                "--tool-call-parser": "none", "--max-total-tokens": str(PRIORITY_KV_TOKENS)}


def bearer(key: str) -> tuple[tuple[str, str], ...]:
    """gRPC metadata presenting API key ``key``."""
    return (("authorization", f"Bearer {key}"),)


def chat(stack, messages=PARIS, max_tokens: int = 32, stream: bool = False, **extra) -> dict:
    return {"model": stack.model_name, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": stream, **extra}


async def read_events(client: httpx.AsyncClient, body: dict, k: int) -> list[str]:
    """Open a stream, read ``k`` data events, then close the connection (a disconnect)."""
    events = []
    async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200, await resp.aread()
        async for line in resp.aiter_lines():
            if line.startswith("data: "):
                events.append(line)
                if len(events) == k:
                    break
    return events


def assert_released_after_abort(stack, before_aborted: int, n: int, within_s: float) -> float:
    """Wait for baseline; check the scheduler aborted exactly ``n`` more rids. Returns seconds taken."""
    t0 = time.monotonic()
    _, sched, _ = stack.wait_idle(timeout_s=15)
    took = time.monotonic() - t0
    assert sched.num_aborted_reqs == before_aborted + n
    assert took < within_s, f"state released after {took:.2f} s"
    return took


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
        assert resp.json()["choices"][0]["message"]["content"] == PARIS_ANSWER
    ring.wait_idle(timeout_s=5)
