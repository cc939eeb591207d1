"""Overload (case C12) and the end paths that need a full scheduler (C08 queued).

On the ring with two request slots, a queue of one (``--max-queued-requests 1``) and a
4096-token KV pool (``keyed_ring``, tests/e2e/conftest.py, behind API keys): two long
requests fill the slots, a third waits, a fourth is refused at once with 429. Liveness stays
fast meanwhile and /get_load reports the occupancy.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.helpers.ring_requests import assert_released_after_abort, chat, read_events


@pytest.fixture
def ring(keyed_ring):
    return keyed_ring


def saturating(ring) -> dict:
    return chat(ring, [{"role": "user", "content": "Write a very long story."}], max_tokens=1000,
                stream=True, ignore_eos=True)


async def wait_load(ring, running: int, waiting: int, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        load = ring.scheduler_load()
        if (load.num_running_reqs, load.num_waiting_reqs) == (running, waiting):
            return
        assert time.monotonic() < deadline, load
        await asyncio.sleep(0.05)


async def test_c12_saturated_liveness_capacity_and_429(ring):
    ring.wait_idle()
    async with httpx.AsyncClient(base_url=ring.base_url, headers=ring.http_headers, timeout=120) as client:
        runners = [asyncio.create_task(read_events(client, saturating(ring), 10_000)) for _ in range(2)]
        await wait_load(ring, 2, 0)
        queued = asyncio.create_task(client.post("/v1/chat/completions", json=chat(ring, max_tokens=8)))
        await wait_load(ring, 2, 1)

        # Liveness answers at once while busy.
        for _ in range(5):
            t0 = time.monotonic()
            health = await client.get("/health")
            took = time.monotonic() - t0
            assert health.status_code == 200 and took < 0.5, (health.status_code, took)

        # Capacity is reported apart from liveness (the scheduler's report is at most ~1 s old).
        await asyncio.sleep(1.2)
        load = (await client.get("/get_load")).json()
        [sched] = load["scheduler"]
        assert (sched["num_running_reqs"], sched["num_waiting_reqs"], sched["req_slots_used"]) == (2, 1, 2)
        assert [t["req_states"] for t in load["tokenizer"]] == [3]
        assert [d["decode_states"] for d in load["detokenizer"]] == [2]

        # Beyond the queue limit: refused at once, 429 with Retry-After and an OpenAI error body.
        for stream in (False, True):
            t0 = time.monotonic()
            resp = await client.post("/v1/chat/completions", json=chat(ring, max_tokens=8, stream=stream))
            took = time.monotonic() - t0
            assert resp.status_code == 429, resp.text
            assert int(resp.headers["retry-after"]) > 0
            error = resp.json()["error"]
            assert error["type"] == "rate_limit_error" and error["code"] == "server_overloaded"
            assert "--max-queued-requests 1" in error["message"]
            assert took < 2.0, took
        assert ring.scheduler_load().num_waiting_reqs == 1

        # C08, queued variant: the waiting request's client leaves; only it is aborted.
        before = ring.scheduler_load().num_aborted_reqs
        queued.cancel()
        with pytest.raises(asyncio.CancelledError):
            await queued
        await wait_load(ring, 2, 0, timeout_s=1.5)
        assert ring.scheduler_load().num_aborted_reqs == before + 1
        assert not any(r.done() for r in runners)  # the running ones are untouched

        before = ring.scheduler_load().num_aborted_reqs
        for r in runners:
            r.cancel()
        await asyncio.gather(*runners, return_exceptions=True)
    assert_released_after_abort(ring, before, 2, within_s=2)


async def test_scheduler_validation_error_after_dispatch_releases_everything(ring):
    """Passes the tokenizer's checks (context 8192) but not the scheduler's (KV pool 4096):
    the error comes back after the ReqState was created and the request dispatched."""
    ring.wait_idle()
    async with httpx.AsyncClient(base_url=ring.base_url, headers=ring.http_headers, timeout=60) as client:
        for stream in (False, True):
            resp = await client.post("/v1/chat/completions", json=chat(ring, max_tokens=5000, stream=stream))
            assert resp.status_code == 400, resp.text
            error = resp.json()["error"]
            assert error["type"] == "invalid_request_error"
            assert "--max-total-tokens" in error["message"]
    ring.wait_idle(timeout_s=5)
    async with httpx.AsyncClient(base_url=ring.base_url, headers=ring.http_headers, timeout=60) as client:
        resp = await client.post("/v1/chat/completions", json=chat(ring, max_tokens=16))
    assert resp.json()["choices"][0]["message"]["content"] == "The capital of France is Paris."
    ring.wait_idle(timeout_s=5)
