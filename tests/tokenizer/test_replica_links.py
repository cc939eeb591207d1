"""One tokenizer service with two replicas of in-test peers over real gRPC: requests spread,
a replica whose detokenizer is lost fails only its own requests (and aborts them at its
scheduler), health stays SERVING while one replica is up, GetClusterLoad lists both."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ringserve.grpcutil import insecure_channel, start_server
from ringserve.v1 import common_pb2, detokenizer_pb2_grpc, scheduler_pb2_grpc, tokenizer_pb2, tokenizer_pb2_grpc
from services.tokenizer.main import TokenizerConfig, TokenizerService
from tests.helpers.tokenizer_peers import TIMEOUT_S, FakeDetokenizer, FakeScheduler, collect, wait_for_value


class LoadedScheduler(FakeScheduler):
    def __init__(self, detokenizer: FakeDetokenizer, name: str):
        super().__init__(detokenizer)
        self.name = name

    async def GetLoad(self, request, context):
        return common_pb2.LoadReport(instance_id=self.name, num_running_reqs=len(self.running))


class LoadedDetokenizer(FakeDetokenizer):
    def __init__(self, name: str):
        super().__init__()
        self.name = name

    async def GetLoad(self, request, context):
        return common_pb2.LoadReport(instance_id=self.name, decode_states=len(self.subscribers))


async def _count(items: list) -> int:
    return len(items)


def ask(rid: str, content: str) -> tokenizer_pb2.GenerateReqInput:
    chat = tokenizer_pb2.ChatInput(messages=[tokenizer_pb2.ChatMessage(role="user", content=content)])
    return tokenizer_pb2.GenerateReqInput(rid=rid, chat=chat, stream=True)


@pytest.fixture
async def two(smollm2_dir):
    detoks = [LoadedDetokenizer(f"detok-{i}") for i in range(2)]
    scheds = [LoadedScheduler(d, f"sched-{i}") for i, d in enumerate(detoks)]
    servers = []
    for d, s in zip(detoks, scheds, strict=True):
        servers.append(await start_server("127.0.0.1:0", [
            (detokenizer_pb2_grpc.add_DetokenizerServicer_to_server, d, "ringserve.v1.Detokenizer")]))
        servers.append(await start_server("127.0.0.1:0", [
            (scheduler_pb2_grpc.add_SchedulerServicer_to_server, s, "ringserve.v1.Scheduler")]))
    for server in servers:
        await server.set_serving(True)  # as the real services do once started
    specs = tuple(f"127.0.0.1:{servers[2 * i + 1].port},127.0.0.1:{servers[2 * i].port}" for i in range(2))
    service = TokenizerService(TokenizerConfig(model=smollm2_dir, port=0, instance_id="tok-r", replicas=specs))
    await service.start()
    channel = insecure_channel(f"127.0.0.1:{service.port}")
    stub = tokenizer_pb2_grpc.TokenizerStub(channel)

    async def can_move_tokens() -> int:
        return sum(service.readiness.can_move_tokens(r) for r in service.replicas.replicas)

    await wait_for_value(can_move_tokens, 2)
    yield service, stub, scheds, servers, channel
    await channel.close()
    await service.stop()
    for server in servers:
        await server.stop(0)


async def test_detokenizer_loss_fails_only_that_replicas_requests(two):
    service, stub, (s0, s1), servers, channel = two
    for s in (s0, s1):
        s.hold = True
    calls = [stub.Generate(ask(f"q{i}", f"Question {i}")) for i in range(2)]
    for call in calls:
        assert (await asyncio.wait_for(call.read(), TIMEOUT_S)).text == "Hello"
    assert (len(s0.reqs), len(s1.reqs)) == (1, 1)  # least outstanding work
    load = await stub.GetClusterLoad(common_pb2.Empty())
    assert load.tokenizer.req_states == 2
    assert sorted((r.instance_id, r.num_running_reqs) for r in load.schedulers) == [("sched-0", 1), ("sched-1", 1)]
    assert sorted((r.instance_id, r.decode_states) for r in load.detokenizers) == [("detok-0", 1), ("detok-1", 1)]

    detok0_port = servers[0].port
    on0 = calls[int(s0.reqs[0].rid[1:])]
    on1 = calls[int(s1.reqs[0].rid[1:])]
    await servers[0].stop(0)  # replica 0's detokenizer
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await collect(on0)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert info.value.details() == f"lost the connection to the detokenizer at 127.0.0.1:{detok0_port}"
    await wait_for_value(lambda: _count(s0.aborts), 1)  # the abort is written after the call failed
    assert [a.rid for a in s0.aborts] == [s0.reqs[0].rid] and s1.aborts == []  # told its scheduler to drop it
    assert on1.done() is False
    assert (await stub.GetLoad(common_pb2.Empty())).req_states == 1

    # Still SERVING with one replica; a new request goes to replica 1.
    check = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""))
    assert check.status == health_pb2.HealthCheckResponse.SERVING
    s1.hold = False
    outs = await collect(stub.Generate(ask("q9", "Question 0")))
    assert "".join(o.text for o in outs) == "Hello, world!"
    assert [r.rid for r in s1.reqs][-1] == "q9" and len(s0.reqs) == 1
    load = await stub.GetClusterLoad(common_pb2.Empty())
    assert [r.instance_id for r in load.detokenizers] == ["detok-1"]  # the lost one does not answer
    assert await stub.Abort(tokenizer_pb2.AbortRequest(rid=s1.reqs[0].rid)) == tokenizer_pb2.AbortResponse(found=True)
    outs = await collect(on1)  # its last row comes from replica 1's scheduler once the abort arrived
    assert [a.rid for a in s1.aborts] == [s1.reqs[0].rid]  # the abort went to the replica holding the rid
    assert outs[-1].finish_reason.type == common_pb2.FINISH_ABORT
