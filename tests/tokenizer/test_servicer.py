"""The tokenizer service over real gRPC on localhost, with small in-test scheduler and
detokenizer peers (tests/helpers/tokenizer_peers.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ringserve.grpcutil import ServingServer, insecure_channel, start_server
from ringserve.v1 import (
    common_pb2,
    detokenizer_pb2,
    detokenizer_pb2_grpc,
    scheduler_pb2_grpc,
    tokenizer_pb2,
    tokenizer_pb2_grpc,
)
from services.tokenizer.main import TokenizerConfig, TokenizerService
from tests.helpers.tokenizer_peers import TIMEOUT_S, FakeDetokenizer, FakeScheduler, collect, wait_for_value


class Ring:
    """The tokenizer service under test plus its two fake peers, all in this event loop."""

    def __init__(self, model: Path) -> None:
        self.model = model
        self.detok = FakeDetokenizer()
        self.sched = FakeScheduler(self.detok)
        self.servers: dict[str, ServingServer] = {}

    async def start_peer(self, name: str, port: int = 0) -> None:
        if name == "detokenizer":
            reg = (detokenizer_pb2_grpc.add_DetokenizerServicer_to_server, self.detok, "ringserve.v1.Detokenizer")
        else:
            reg = (scheduler_pb2_grpc.add_SchedulerServicer_to_server, self.sched, "ringserve.v1.Scheduler")
        self.servers[name] = await start_server(f"127.0.0.1:{port}", [reg])
        await self.servers[name].set_serving(True)  # as the real services do once started

    async def start(self) -> None:
        await self.start_peer("detokenizer")
        await self.start_peer("scheduler")
        self.service = TokenizerService(
            TokenizerConfig(
                model=self.model, port=0, instance_id="tok-under-test",
                scheduler=f"127.0.0.1:{self.servers['scheduler'].port}",
                detokenizer=f"127.0.0.1:{self.servers['detokenizer'].port}",
            )
        )
        await self.service.start()
        self.channel = insecure_channel(f"127.0.0.1:{self.service.port}")
        self.stub = tokenizer_pb2_grpc.TokenizerStub(self.channel)
        # Start-up, not behaviour under test: its links connect in attempts of 2 s with back-off,
        # and a process starved beside `make test`'s ring tier once needed more than 10 s.
        await wait_for_value(self.health, health_pb2.HealthCheckResponse.SERVING, 3 * TIMEOUT_S)

    async def health(self) -> int:
        resp = await health_pb2_grpc.HealthStub(self.channel).Check(health_pb2.HealthCheckRequest(service=""))
        return resp.status

    async def wait_health(self, status: int) -> None:
        await wait_for_value(self.health, status)

    async def req_states(self) -> int:
        return (await self.stub.GetLoad(common_pb2.Empty())).req_states

    async def wait_req_states(self, n: int) -> None:
        await wait_for_value(self.req_states, n)

    async def stop(self) -> None:
        await self.channel.close()
        await self.service.stop()
        for server in self.servers.values():
            await server.stop(0)


@pytest.fixture
async def ring(smollm2_dir):
    r = Ring(smollm2_dir)
    await r.start()
    yield r
    await r.stop()


def chat_req(rid: str = "", stream: bool = True, **sp) -> tokenizer_pb2.GenerateReqInput:
    chat = tokenizer_pb2.ChatInput(messages=[tokenizer_pb2.ChatMessage(role="user", content="Say hi.")])
    return tokenizer_pb2.GenerateReqInput(rid=rid, chat=chat, stream=stream,
                                          sampling_params=common_pb2.SamplingParams(**sp))


async def test_serving_hello_and_unary_calls(ring):
    assert [(h.rid, h.abort_all, h.tokenizer_id) for h in ring.sched.hellos] == [("", False, "tok-under-test")]
    info = await ring.stub.GetModelInfo(common_pb2.Empty())
    assert (info.served_model_name, info.context_length, info.vocab_size, list(info.eos_token_ids)) == (
        "SmolLM2-135M-Instruct", 8192, 49152, [2],
    )
    chat = tokenizer_pb2.ChatInput(messages=[
        tokenizer_pb2.ChatMessage(role="system", content="Always answer in French."),
        tokenizer_pb2.ChatMessage(role="user", content="What colour is the sky?"),
    ])
    tok = await ring.stub.Tokenize(tokenizer_pb2.TokenizeRequest(chat=chat))
    assert tok.prompt.count("Always answer in French.") == 1
    assert (tok.count, tok.max_model_len) == (len(tok.input_ids), 8192)
    text = await ring.stub.Detokenize(
        tokenizer_pb2.DetokenizeRequest(ids=list(tok.input_ids), skip_special_tokens=False))
    assert text.text == tok.prompt
    assert await ring.req_states() == 0


async def test_generate_streams_the_rows_back(ring):
    outs = await collect(ring.stub.Generate(chat_req("s1", max_new_tokens=8)))
    assert [o.text for o in outs] == ["Hello", ", world", "!"]
    assert [list(o.output_ids) for o in outs] == [[19556], [28, 905], [17]]
    assert [o.finish_reason.type for o in outs] == [
        common_pb2.FINISH_NONE, common_pb2.FINISH_NONE, common_pb2.FINISH_STOP]
    assert [o.completion_tokens for o in outs] == [1, 2, 3]
    req = ring.sched.reqs[0]
    assert (req.rid, req.tokenizer_id, req.stream, req.sampling_params.max_new_tokens) == (
        "s1", "tok-under-test", True, 8)
    assert all(o.prompt_tokens == len(req.input_ids) for o in outs)
    assert await ring.req_states() == 0

    final = await collect(ring.stub.Generate(chat_req("s2", stream=False, n=2)))
    assert sorted((o.index, o.rid, o.text, tuple(o.output_ids)) for o in final) == [
        (0, "s2", "Hello, world!", (19556, 28, 905, 17)),
        (1, "s2", "Hello, world!", (19556, 28, 905, 17)),
    ]
    assert [r.rid for r in ring.sched.reqs[1:]] == ["s2-0", "s2-1"]
    assert await ring.req_states() == 0


@pytest.mark.parametrize(
    "sp, message, code, param",
    [
        ({"temperature": 3.0}, "temperature must be at most 2, got 3", "invalid_value", "temperature"),
        ({"max_new_tokens": 9000}, "This model's maximum context length is 8192 tokens.", "context_length_exceeded",
         "max_tokens"),
    ],
)
async def test_invalid_request_has_status_message_and_metadata(ring, sp, message, code, param):
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await collect(ring.stub.Generate(chat_req(**sp)))
    err = info.value
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details().startswith(message)
    assert dict(err.trailing_metadata()) == {"code": code, "param": param}
    assert ring.sched.reqs == [] and await ring.req_states() == 0


async def test_duplicate_rid_is_rejected_and_the_first_call_is_untouched(ring):
    ring.sched.hold = True
    first = ring.stub.Generate(chat_req("dup"))
    assert (await asyncio.wait_for(first.read(), TIMEOUT_S)).text == "Hello"
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await collect(ring.stub.Generate(chat_req("dup")))
    assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert dict(info.value.trailing_metadata()) == {"code": "duplicate_request_id", "param": "rid"}
    assert [r.rid for r in ring.sched.reqs] == ["dup"]
    found = await ring.stub.Abort(tokenizer_pb2.AbortRequest(rid="dup"))
    assert found.found
    rest = await collect(first)
    assert [o.finish_reason.type for o in rest] == [common_pb2.FINISH_ABORT]
    assert await ring.req_states() == 0


async def test_cancelled_generate_aborts_and_releases_the_state(ring):
    ring.sched.hold = True
    call = ring.stub.Generate(chat_req("c1", n=2))
    assert (await asyncio.wait_for(call.read(), TIMEOUT_S)).finish_reason.type == common_pb2.FINISH_NONE
    assert await ring.req_states() == 2
    call.cancel()

    async def aborted():
        while sorted(a.rid for a in ring.sched.aborts) != ["c1-0", "c1-1"]:
            await asyncio.sleep(0.01)

    await asyncio.wait_for(aborted(), TIMEOUT_S)
    assert all(a.tokenizer_id == "tok-under-test" for a in ring.sched.aborts)
    await ring.wait_req_states(0)
    assert ring.sched.running == {}


@pytest.mark.parametrize("peer", ["detokenizer", "scheduler"])
async def test_peer_loss_fails_in_flight_calls_then_reconnects(ring, peer):
    ring.sched.hold = True
    call = ring.stub.Generate(chat_req("p1"))
    assert (await asyncio.wait_for(call.read(), TIMEOUT_S)).text == "Hello"
    port = ring.servers[peer].port
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    await ring.servers[peer].stop(0)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await collect(call)
    assert loop.time() - t0 < 2.0  # promptly, not after a keepalive timeout
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert info.value.details() == f"lost the connection to the {peer} at 127.0.0.1:{port}"
    assert await ring.req_states() == 0
    await ring.wait_health(health_pb2.HealthCheckResponse.NOT_SERVING)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await collect(ring.stub.Generate(chat_req("p2")))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert [r.rid for r in ring.sched.reqs] == ["p1"]  # p2 was refused before dispatch
    if peer == "detokenizer":  # the scheduler is still there: it is told to drop the request
        assert [a.rid for a in ring.sched.aborts] == ["p1"]

    await ring.start_peer(peer, port)
    await ring.wait_health(health_pb2.HealthCheckResponse.SERVING)
    link = ring.service.scheduler if peer == "scheduler" else ring.service.detokenizer
    assert link.sessions == 2
    ring.sched.hold = False
    outs = await collect(ring.stub.Generate(chat_req("p3")))
    assert "".join(o.text for o in outs) == "Hello, world!"
    assert await ring.req_states() == 0


class SilentDetokenizer(FakeDetokenizer):
    """A detokenizer that does not send initial metadata when a tokenizer subscribes."""

    async def Subscribe(self, request, context):
        queue: asyncio.Queue[detokenizer_pb2.BatchStrOutput] = asyncio.Queue()
        self.subscribers[request.tokenizer_id] = queue
        try:
            while True:
                yield await queue.get()
        finally:
            self.subscribers.pop(request.tokenizer_id, None)


async def test_subscription_without_initial_metadata_counts_as_up(smollm2_dir):
    r = Ring(smollm2_dir)
    r.detok = SilentDetokenizer()
    r.sched = FakeScheduler(r.detok)
    await r.start()  # reaches SERVING after the grace period
    try:
        outs = await collect(r.stub.Generate(chat_req("q")))
        assert "".join(o.text for o in outs) == "Hello, world!"
    finally:
        await r.stop()


def test_main_serves_until_sigterm(smollm2_dir):
    """The CLI entry: NOT_SERVING without peers, answers GetModelInfo, exits 0 on SIGTERM."""
    import signal
    import subprocess
    import sys
    import time

    from ringserve.ports import free_ports

    port, dead = free_ports(2)  # distinct: one at a time, the kernel may hand a port out twice
    proc = subprocess.Popen(
        [sys.executable, "-m", "ringserve.cli", "tokenizer", "--model", str(smollm2_dir), "--port", str(port),
         "--scheduler", f"127.0.0.1:{dead}", "--detokenizer", f"127.0.0.1:{dead}", "--served-model-name", "smol",
         "--context-length", "4096"],
        cwd=Path(__file__).resolve().parents[2], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None and time.monotonic() < deadline
            with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
                try:
                    info = tokenizer_pb2_grpc.TokenizerStub(ch).GetModelInfo(common_pb2.Empty(), timeout=1)
                    health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1)
                    break
                except grpc.RpcError:
                    time.sleep(0.2)
        assert (info.served_model_name, info.context_length) == ("smol", 4096)
        assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
