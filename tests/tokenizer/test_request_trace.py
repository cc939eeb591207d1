"""The tokenizer's request ids, spans and log lines: ``x-request-id`` metadata, the ``generate`` and
``template + tokenize`` spans (in memory), the ``traceparent`` each dispatched choice carries,
and the off path. The service over real gRPC with in-test peers (tests/helpers/tokenizer_peers.py)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc
import pytest
from opentelemetry.trace import SpanKind, StatusCode

from ringserve import tracing
from ringserve.grpcutil import ServingServer, insecure_channel, start_server
from ringserve.v1 import common_pb2, detokenizer_pb2_grpc, scheduler_pb2_grpc, tokenizer_pb2, tokenizer_pb2_grpc
from services.tokenizer.main import TokenizerConfig, TokenizerService
from tests.helpers.otlp import recording
from tests.helpers.tokenizer_peers import FakeDetokenizer, FakeScheduler, collect

TRACE = "0af7651916cd43dd8448eb211c80319c"
CALLER = "b7ad6b7169203331"
CALLER_METADATA = (("traceparent", f"00-{TRACE}-{CALLER}-01"),)


class Peers:
    def __init__(self) -> None:
        self.detok = FakeDetokenizer()
        self.sched = FakeScheduler(self.detok)
        self.servers: list[ServingServer] = []


@pytest.fixture
async def ring(smollm2_dir):
    """The tokenizer service with --log-requests before two fake peers; yields (peers, stub)."""
    peers = Peers()
    ports = []
    for add, servicer, name in ((detokenizer_pb2_grpc.add_DetokenizerServicer_to_server, peers.detok,
                                 "ringserve.v1.Detokenizer"),
                                (scheduler_pb2_grpc.add_SchedulerServicer_to_server, peers.sched,
                                 "ringserve.v1.Scheduler")):
        server = await start_server("127.0.0.1:0", [(add, servicer, name)])
        await server.set_serving(True)
        peers.servers.append(server)
        ports.append(server.port)
    service = TokenizerService(TokenizerConfig(
        model=smollm2_dir, port=0, instance_id="tok-traced", detokenizer=f"127.0.0.1:{ports[0]}",
        scheduler=f"127.0.0.1:{ports[1]}", log_requests=True))
    await service.start()
    channel = insecure_channel(f"127.0.0.1:{service.port}")
    stub = tokenizer_pb2_grpc.TokenizerStub(channel)
    await asyncio.wait_for(_until(lambda: service.ready), 10)
    yield peers, stub
    await channel.close()
    await service.stop()
    for server in peers.servers:
        await server.stop(0)


async def _until(done: Callable[[], bool]) -> None:
    while not done():
        await asyncio.sleep(0.02)


def chat_req(rid: str = "", **sp) -> tokenizer_pb2.GenerateReqInput:
    chat = tokenizer_pb2.ChatInput(messages=[tokenizer_pb2.ChatMessage(role="user", content="Say hi.")])
    return tokenizer_pb2.GenerateReqInput(rid=rid, chat=chat, stream=True,
                                          sampling_params=common_pb2.SamplingParams(**sp))


async def _generate(stub, req, metadata=()) -> list[tokenizer_pb2.GenerateOutput]:
    return await collect(stub.Generate(req, metadata=metadata, wait_for_ready=True))


async def test_x_request_id_metadata_names_the_rid(ring, caplog):
    peers, stub = ring
    caplog.set_level(logging.INFO, "services.tokenizer.request_trace")
    outs = await _generate(stub, chat_req(), (("x-request-id", "meta-1"),))
    assert [r.rid for r in peers.sched.reqs] == ["meta-1"] and {o.rid for o in outs} == {"meta-1"}
    prompt = len(peers.sched.reqs[0].input_ids)
    assert caplog.messages[-1] == f"request meta-1 finished: {prompt} prompt tokens, 3 output tokens, " \
                                  "finish reasons stop"
    await _generate(stub, chat_req("same-1"), (("x-request-id", "same-1"),))  # the same in both: fine
    assert peers.sched.reqs[-1].rid == "same-1"


@pytest.mark.parametrize(("rid", "given", "message"), [
    ("body-1", "meta-2", "x-request-id metadata 'meta-2' and the request's rid 'body-1' differ; give one, or the "
                         "same in both"),
    ("", "two words", "x-request-id metadata 'two words' must be visible ASCII characters without spaces"),
])
async def test_bad_or_conflicting_x_request_id_is_refused(ring, rid, given, message):
    peers, stub = ring
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await _generate(stub, chat_req(rid), (("x-request-id", given),))
    assert (info.value.code(), info.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT, message)
    assert peers.sched.reqs == []


async def test_traced_generate_continues_the_callers_span_and_hands_it_to_every_choice(ring):
    peers, stub = ring
    with recording() as exporter:
        await _generate(stub, chat_req("traced-2", n=2, max_new_tokens=8, temperature=0.5), CALLER_METADATA)
    spans = {s.name: s for s in exporter.get_finished_spans()}
    generate, tokenize = spans["generate"], spans["template + tokenize"]
    assert generate.kind == SpanKind.SERVER and format(generate.parent.span_id, "016x") == CALLER
    assert format(generate.context.trace_id, "032x") == TRACE and tokenize.parent.span_id == generate.context.span_id
    prompt = len(peers.sched.reqs[0].input_ids)
    assert dict(generate.attributes) == {
        tracing.RID: "traced-2", tracing.GEN_AI_REQUEST_MODEL: "SmolLM2-135M-Instruct", "rpc.system": "grpc",
        "rpc.method": "Generate", tracing.GEN_AI_REQUEST_MAX_TOKENS: 8, tracing.GEN_AI_REQUEST_TEMPERATURE: 0.5,
        tracing.GEN_AI_RESPONSE_ID: "traced-2", tracing.GEN_AI_USAGE_INPUT_TOKENS: prompt,
        tracing.GEN_AI_USAGE_OUTPUT_TOKENS: 6, tracing.GEN_AI_RESPONSE_FINISH_REASONS: ("stop", "stop")}
    assert dict(tokenize.attributes) == {tracing.RID: "traced-2", tracing.GEN_AI_USAGE_INPUT_TOKENS: prompt,
                                         "ringserve.choices": 2}
    assert generate.start_time <= tokenize.start_time <= tokenize.end_time <= generate.end_time
    own = format(generate.context.span_id, "016x")
    assert [(r.rid, r.traceparent) for r in peers.sched.reqs] == [
        ("traced-2-0", f"00-{TRACE}-{own}-01"), ("traced-2-1", f"00-{TRACE}-{own}-01")]
    assert generate.status.status_code == StatusCode.UNSET


async def test_a_refused_generate_ends_its_span_with_the_error(ring, caplog):
    peers, stub = ring
    caplog.set_level(logging.INFO, "services.tokenizer.request_trace")
    with recording() as exporter:
        with pytest.raises(grpc.aio.AioRpcError):
            await _generate(stub, chat_req("hot-1", temperature=3.0), CALLER_METADATA)
    (span,) = exporter.get_finished_spans()
    assert span.name == "generate" and span.status.status_code == StatusCode.ERROR
    assert span.status.description == "temperature must be at most 2, got 3"
    assert caplog.messages[-1] == "request hot-1 failed: temperature must be at most 2, got 3"


async def test_off_no_traceparent_travels(ring):
    peers, stub = ring
    assert tracing.tracer is None
    await _generate(stub, chat_req("plain-1"), CALLER_METADATA)
    assert [(r.rid, r.traceparent) for r in peers.sched.reqs] == [("plain-1", "")]
