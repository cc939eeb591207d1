"""The gateway's drain on SIGTERM (services/gateway/drain.py), in front of a tokenizer fake
whose streams wait for the test: a stream in flight finishes, a new request gets 503, the
server returns (exit 0) as soon as nothing is in flight, or cuts what runs after the grace
period. ``handle_exit`` is called as the signal handler would be."""

from __future__ import annotations

import asyncio
import signal
import socket
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import pytest
import pytest_asyncio
import uvicorn

from ringserve import grpcutil
from ringserve.v1 import common_pb2, tokenizer_pb2, tokenizer_pb2_grpc
from services.gateway.app import create_app
from services.gateway.config import GatewayConfig
from services.gateway.drain import CUT_AFTER_S, DrainingServer

pytestmark = pytest.mark.asyncio(loop_scope="session")

BODY = {"model": "m", "prompt": "hi", "max_tokens": 2, "stream": True}


class PausingTokenizer(tokenizer_pb2_grpc.TokenizerServicer):
    """Generate yields one token, waits for ``release``, then yields the last one."""

    def __init__(self) -> None:
        self.release = asyncio.Event()

    async def Generate(self, request, context):
        def output(text: str, n: int, finish: int) -> tokenizer_pb2.GenerateOutput:
            return tokenizer_pb2.GenerateOutput(rid=request.rid, text=text, prompt_tokens=1, completion_tokens=n,
                                                finish_reason=common_pb2.FinishReason(type=finish))

        yield output("a", 1, common_pb2.FINISH_NONE)
        await self.release.wait()
        yield output("b", 2, common_pb2.FINISH_LENGTH)

    async def GetModelInfo(self, request, context):
        return tokenizer_pb2.ModelInfo(model_path="/models/m", served_model_name="m", context_length=2048,
                                       vocab_size=100)

    async def GetReadiness(self, request, context):
        return tokenizer_pb2.Readiness(ready=True, replicas=1)


@pytest_asyncio.fixture(loop_scope="session")
async def tokenizer() -> AsyncIterator[tuple[PausingTokenizer, int]]:
    fake = PausingTokenizer()
    server = await grpcutil.start_server(
        "127.0.0.1:0", [(tokenizer_pb2_grpc.add_TokenizerServicer_to_server, fake, "ringserve.v1.Tokenizer")])
    await server.set_serving(True)
    yield fake, server.port
    fake.release.set()
    await server.stop(0)


@asynccontextmanager
async def started(tokenizer_port: int, grace_s: float) -> AsyncIterator[tuple[DrainingServer, asyncio.Task, str]]:
    """A gateway with ``--grace-period grace_s`` in front of the fake; stopped at the end if a test left it up."""
    app = create_app(GatewayConfig(tokenizer=f"127.0.0.1:{tokenizer_port}", served_model_name="m",
                                   grace_period_s=grace_s))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=CUT_AFTER_S)
    server = DrainingServer(config, app.state.drain, grace_s)
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        yield server, task, f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = server.force_exit = True
        await task


async def first_event(lines: AsyncIterator[str]) -> str:
    async for line in lines:
        if line.startswith("data: "):
            return line
    raise AssertionError("the stream ended before its first event")


async def test_sigterm_lets_the_stream_finish_and_refuses_new_requests(tokenizer) -> None:
    fake, port = tokenizer
    async with started(port, 30) as (server, task, url), httpx.AsyncClient(base_url=url, timeout=10) as client:
        async with client.stream("POST", "/v1/completions", json=BODY) as stream:
            lines = stream.aiter_lines()
            assert '"text":"a"' in await first_event(lines)
            assert server.drain.in_flight == 1
            server.handle_exit(signal.SIGTERM, None)
            async with httpx.AsyncClient(base_url=url, timeout=10) as other:
                refused = await other.post("/v1/completions", json={**BODY, "stream": False})
                health = await other.get("/health")
                metrics = await other.get("/metrics")
            assert refused.status_code == 503 and health.status_code == 503
            assert refused.json() == {"error": {
                "message": "the gateway is shutting down; retry on another instance",
                "type": "service_unavailable_error", "param": None, "code": "service_unavailable"}}
            assert refused.headers["retry-after"] == "1" and refused.headers["connection"] == "close"
            assert metrics.status_code == 200  # scraped until the pod is gone
            await asyncio.sleep(0.3)
            assert not task.done()  # the stream still runs
            fake.release.set()
            rest = [line async for line in lines if line.startswith("data: ")]
        assert '"text":"b"' in rest[0] and '"finish_reason":"length"' in rest[0] and rest[-1] == "data: [DONE]"
        await asyncio.wait_for(task, 2)  # serve returns (exit status 0) once nothing is in flight
        assert server.drain.in_flight == 0 and not server.force_exit


async def test_grace_period_cuts_what_still_runs(tokenizer) -> None:
    _, port = tokenizer
    async with started(port, 0.5) as (server, task, url), httpx.AsyncClient(base_url=url, timeout=10) as client:
        async with client.stream("POST", "/v1/completions", json=BODY) as stream:
            lines = stream.aiter_lines()
            await first_event(lines)
            signalled = time.monotonic()
            server.handle_exit(signal.SIGTERM, None)
            with pytest.raises(httpx.RemoteProtocolError):  # cut: the chunked body never ends
                _ = [line async for line in lines]
        await asyncio.wait_for(task, 5)
        assert 0.5 <= time.monotonic() - signalled < 0.5 + CUT_AFTER_S + 2


async def test_second_signal_stops_at_once(tokenizer) -> None:
    _, port = tokenizer
    async with started(port, 30) as (server, task, url), httpx.AsyncClient(base_url=url, timeout=10) as client:
        async with client.stream("POST", "/v1/completions", json=BODY) as stream:
            lines = stream.aiter_lines()  # kept: a dropped generator would close the stream
            await first_event(lines)
            server.handle_exit(signal.SIGTERM, None)
            await asyncio.sleep(0.2)
            assert not task.done()
            server.handle_exit(signal.SIGINT, None)
            await asyncio.wait_for(task, 3)
