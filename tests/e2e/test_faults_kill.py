"""Faults: a service SIGKILLed or SIGTERMed under load, on a ring of its own.

The launcher runs with ``--restart-on-failure``, so a killed service comes back on the
same port and the others reconnect with backoff; nothing else is restarted. Every
in-flight request ends within 2 s of a kill (an error event mid-stream, 503 before the
first byte), never hangs; after the restart new requests succeed and every service is back
to baseline. SIGTERM lets in-flight requests finish (``--grace-period``) and exits 0.
Readiness (``/health``, the tokenizer's gRPC health) fails within 5 s of a stopped
(SIGSTOP) or killed detokenizer, naming it, and comes back when it resumes; liveness (the
gateway's ``/metrics``, the tokenizer's ``liveness`` health service) never fails.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.helpers.ring_requests import chat, post, read_stream, serves_again, wait_until
from tests.helpers.ringstack import launched, still_serves
from tests.helpers.tiers import ring_fixture


@ring_fixture(scope="module")
def ring(smollm2_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("faults") / "ring.log"
    with launched(smollm2_dir, "--restart-on-failure", "--grace-period", "5", log_path=log) as s:
        yield s


def long_story(ring, stream: bool) -> dict:
    return chat(ring, [{"role": "user", "content": "Write a very long story."}], max_tokens=2000,
                stream=stream, ignore_eos=True)


async def kill_under_load(ring, service: str) -> None:
    """Two requests in flight (streamed, not streamed); SIGKILL ``service``; both end fast with an error.
    The kill waits for the stream's first event: before it the gateway has sent no status yet and
    answers a failure with an HTTP 503, which a loaded machine can delay past the 0.3 s below."""
    ring.wait_idle()
    async with httpx.AsyncClient(base_url=ring.base_url, timeout=60) as client:
        first_event = asyncio.Event()
        streamed = asyncio.create_task(read_stream(client, long_story(ring, True), first_event))
        whole = asyncio.create_task(post(client, long_story(ring, False)))
        await wait_until(lambda: ring.scheduler_load().num_running_reqs == 2, 30, "running 2")
        await asyncio.wait_for(first_event.wait(), 30)
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


async def health_becomes(client: httpx.AsyncClient, status: int, within_s: float) -> httpx.Response:
    """Poll /health until it answers ``status``; fail if that takes longer than ``within_s``."""
    deadline = time.monotonic() + within_s
    while (resp := await client.get("/health")).status_code != status:
        assert time.monotonic() < deadline, f"/health still {resp.status_code} after {within_s} s: {resp.text}"
        await asyncio.sleep(0.1)
    return resp


def tokenizer_health(ring, service: str) -> int:
    with grpc.insecure_channel(ring.tokenizer) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=2).status


async def assert_not_ready_but_alive(ring, client: httpx.AsyncClient, reason: str, message: str) -> None:
    """/health is 503 naming ``reason``; the tokenizer's gRPC health and metrics agree; liveness holds."""
    resp = await health_becomes(client, 503, 5.0)
    assert resp.json() == {
        "error": {"message": f"the ring cannot move a token: {message}", "type": "service_unavailable_error",
                  "param": None, "code": "service_unavailable"},
        "status": "not_ready", "replicas": 1,
        "not_ready": [{"replica": ring.scheduler, "reason": reason, "message": message}]}
    assert tokenizer_health(ring, "") == health_pb2.HealthCheckResponse.NOT_SERVING
    assert tokenizer_health(ring, "liveness") == health_pb2.HealthCheckResponse.SERVING
    assert (await client.get("/metrics")).status_code == 200  # the gateway's liveness probe
    samples = ring.scrape("tokenizer")
    name = (("model_name", ring.model_name),)
    assert samples[("ringserve:ready", name)] == 0.0
    assert samples[("ringserve:replica_not_ready", (*name, ("reason", reason), ("replica", ring.scheduler)))] == 1.0


async def test_readiness_fails_while_the_detokenizer_is_stopped(ring):
    ring.wait_idle()
    pid = ring.pid("detokenizer")
    async with httpx.AsyncClient(base_url=ring.base_url, timeout=10) as client:
        await health_becomes(client, 200, 5.0)
        os.kill(pid, signal.SIGSTOP)
        try:
            await assert_not_ready_but_alive(
                ring, client, "detokenizer_health_check",
                f"the detokenizer at {ring.detokenizer} did not answer its health check within 2 s")
        finally:
            os.kill(pid, signal.SIGCONT)
        resp = await health_becomes(client, 200, 5.0)
        assert resp.json() == {"status": "ok", "replicas": 1, "not_ready": []}
    assert tokenizer_health(ring, "") == health_pb2.HealthCheckResponse.SERVING
    assert ring.pid("detokenizer") == pid  # resumed, not restarted
    still_serves(ring)


async def test_readiness_names_a_killed_detokenizer_until_it_is_back(ring):
    ring.wait_idle()
    others = {name: ring.pid(name) for name in ("gateway", "tokenizer", "scheduler")}
    async with httpx.AsyncClient(base_url=ring.base_url, timeout=10) as client:
        await health_becomes(client, 200, 5.0)
        ring.kill("detokenizer")
        await assert_not_ready_but_alive(ring, client, "detokenizer_link_down",
                                         f"the detokenizer at {ring.detokenizer} is not connected")
        await health_becomes(client, 200, 120.0)  # the launcher restarts it (model load included)
    assert {name: ring.pid(name) for name in others} == others
    still_serves(ring)


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
